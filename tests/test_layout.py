"""Hand-worked layouts, bad input and the MXFP8 regression for the pure planner.

Every expected number below is worked out by hand in the comment next to it from the rules
in DESIGN.md: reverse registration order, 64-element starts, bucket ends rounded to the
start alignment (replicated) or to ``dp_size * 128`` (sharded), layerwise shards of
``round_up(largest rank's aligned elements, 128)``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from aligndp.lowp.recipes import wgrad_requirements
from aligndp.optim.muon import newton_schulz_cost
from aligndp.plan.layout import plan_layout
from aligndp.plan.request import PlanRequest, modes_for_sharding, plan_buffers
from aligndp.plan.spec import DEFAULT_BUCKET_NUMEL, Mode, ParamSpec, Requirement, numel_cost
from aligndp.plan.validate import validate

MODES = [m.value for m in Mode]


def spans(layout):
    return {p.name: (p.start, p.end) for p in layout.params}


def test_two_odd_params_get_64_element_starts():
    # layout order is reverse registration: b (103) at [0, 103), a (97) at round_up(103, 64) = 128,
    # ends at 225; the bucket ends at round_up(225, 64) = 256, so 256 - 200 = 56 padding.
    layout = plan_layout([ParamSpec("a", (97,)), ParamSpec("b", (103,))])
    assert spans(layout) == {"b": (0, 103), "a": (128, 225)}
    assert [(b.start, b.end) for b in layout.buckets] == [(0, 256)]
    assert (layout.numel, layout.padded_numel, layout.padding_numel) == (200, 256, 56)
    assert layout.param("a").index == 0 and layout.param("b").index == 1


def test_three_matrices_split_into_two_buckets():
    # c [0, 10000): 10000 < 15000 keeps bucket 0 open; b starts at round_up(10000, 64) = 10048, ends
    # 20048; 20000 elements >= 15000 closes bucket 0 at round_up(20048, 64) = 20096.
    # a fills bucket 1
    # from 20096 to 30096, rounded to 20096 + 10048 = 30144.
    specs = [ParamSpec(n, (100, 100)) for n in "abc"]
    layout = plan_layout(specs, bucket_numel=15_000)
    assert spans(layout) == {"c": (0, 10_000), "b": (10_048, 20_048), "a": (20_096, 30_096)}
    assert [(b.start, b.end) for b in layout.buckets] == [(0, 20_096), (20_096, 30_144)]
    assert [p.bucket for p in layout.params] == [0, 0, 1]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dp_size", [1, 3, 8])
def test_sizes_not_multiple_of_64_start_aligned_in_every_mode(mode, dp_size):
    specs = [
        ParamSpec(f"p{i}", shape)
        for i, shape in enumerate([(7, 9), (65,), (1,), (33, 3), (127,), (5, 5, 5)])
    ]
    layout = plan_layout(specs, dp_size=dp_size, mode=mode, bucket_numel=300)
    assert all(p.start % 64 == 0 for p in layout.params)


def test_sharded_bucket_is_a_multiple_of_dp_times_128():
    # b [0, 103), a [128, 225); the bucket rounds 225 up to a multiple of 3 * 128 = 384: three
    # shards of 128 elements, rank 1's shard [128, 256) holds all of a.
    layout = plan_layout([ParamSpec("a", (97,)), ParamSpec("b", (103,))], dp_size=3, mode="sharded")
    assert spans(layout) == {"b": (0, 103), "a": (128, 225)}
    assert [(b.start, b.end) for b in layout.buckets] == [(0, 384)]
    assert [layout.shard_range(0, r) for r in range(3)] == [(0, 128), (128, 256), (256, 384)]
    assert all(b.numel % (3 * 128) == 0 for b in layout.buckets)


def test_layerwise_balances_two_big_and_two_small_matrices():
    # Registration A, B (64x64: 4096 elements, cost 3·64^3) and C, D (32x32: 1024, cost 3·32^3).
    # Layout order D, C, B, A. Greedy by cost, ties to the earlier in layout order and then to
    # the rank with least cost, fewest elements, lowest id: B -> rank 0, A -> rank 1, D -> rank 0
    # (all tied), C -> rank 1. Shards are round_up(4096 + 1024, 128) = 5120; within a shard params
    # keep layout order: rank 0 holds D then B, rank 1 holds C then A. No padding at all.
    specs = [
        ParamSpec("A", (64, 64)),
        ParamSpec("B", (64, 64)),
        ParamSpec("C", (32, 32)),
        ParamSpec("D", (32, 32)),
    ]
    layout = plan_layout(specs, dp_size=2, mode="layerwise", owner_cost=newton_schulz_cost)
    assert {p.name: p.owner for p in layout.params} == {"A": 1, "B": 0, "C": 1, "D": 0}
    assert spans(layout) == {
        "D": (0, 1024),
        "B": (1024, 5120),
        "C": (5120, 6144),
        "A": (6144, 10_240),
    }
    assert [(b.start, b.end) for b in layout.buckets] == [(0, 10_240)]
    assert layout.padding_numel == 0
    # a square m x m matrix costs m²·(2m + m) = 3m³ multiply-adds per iteration
    assert layout.rank_costs() == [3 * (64.0**3 + 32.0**3)] * 2 and layout.imbalance == 1.0
    # the costs recorded at plan time, or any cost function given afterwards (numel here)
    assert [p.cost for p in layout.params] == [3 * 32.0**3, 3 * 64.0**3, 3 * 32.0**3, 3 * 64.0**3]
    assert layout.rank_costs(numel_cost) == [64.0**2 + 32.0**2] * 2


def test_layerwise_one_param_per_rank_pads_to_the_largest():
    # dp 2, a (100,) and b (300,): each rank owns one;
    # shards round_up(300 -> 320 aligned, 128) = 384.
    layout = plan_layout(
        [ParamSpec("a", (100,)), ParamSpec("b", (300,))], dp_size=2, mode="layerwise"
    )
    assert spans(layout) == {"b": (0, 300), "a": (384, 484)}
    assert {p.name: p.owner for p in layout.params} == {"b": 0, "a": 1}
    assert layout.padded_numel == 768 and layout.padding_numel == 368


def test_duplicate_name_is_refused_with_the_name():
    specs = [
        ParamSpec("tok.weight", (10, 4)),
        ParamSpec("ln.weight", (4,)),
        ParamSpec("tok.weight", (10, 4)),
    ]
    with pytest.raises(ValueError, match=r"\['tok.weight'\].*once"):
        plan_layout(specs)


def test_plan_buffers_groups_by_dtype_in_registration_order():
    specs = [
        ParamSpec("a", (3,), torch.bfloat16),
        ParamSpec("b", (5,)),
        ParamSpec("c", (7,), torch.bfloat16),
    ]
    bf16, fp32 = plan_buffers(specs, grad_dtype=torch.float32)
    assert [p.name for p in bf16.params] == ["c", "a"] and [p.name for p in fp32.params] == ["b"]
    assert bf16.grad_dtype == fp32.grad_dtype == torch.float32


def test_plan_request_is_one_request_for_every_caller():
    """[Note: one plan request]: the specs form equals the request form; a request binds only to
    the params and dp size it was made for; wrapper requirements join it once."""
    specs = [ParamSpec("w", (64, 48)), ParamSpec("b", (48,)), ParamSpec("v", (48, 64))]
    request = PlanRequest(
        specs=specs, dp_size=2, modes=modes_for_sharding("zero1", ["w", "b", "v"], whole=["w"])
    )
    assert request.bucket_numel == DEFAULT_BUCKET_NUMEL == 40_000_000
    assert {n: request.mode_of(n).value for n in ("w", "b", "v")} == {
        "w": "layerwise",
        "b": "sharded",
        "v": "sharded",
    }
    layouts = plan_buffers(request)
    assert layouts == plan_buffers(specs, dp_size=2, modes=request.modes)
    assert [lo.mode for lo in layouts] == [Mode.LAYERWISE, Mode.SHARDED]
    fp8 = Requirement("fp8", start_bytes=16)
    bound = request.bind(specs, dp_size=2, requirements=[fp8, fp8])
    assert (
        bound.requirements == (fp8,) and bound.bind(specs, dp_size=2, requirements=[fp8]) == bound
    )
    with pytest.raises(ValueError, match=r"other params.*\('b', \(48,\).*module being wrapped"):
        request.bind([s for s in specs if s.name != "b"], dp_size=2)
    with pytest.raises(ValueError, match="dp_size 2 but the process group has 3 ranks"):
        request.bind(specs, dp_size=3)
    with pytest.raises(ValueError, match="unknown sharding 'zero3'"):
        modes_for_sharding("zero3", ["w"])
    with pytest.raises(ValueError, match=r"modes name params .*\['x'\]"):
        PlanRequest(specs=specs, modes={"x": Mode.SHARDED})
    with pytest.raises(TypeError, match="grad_dtype must be a floating"):
        PlanRequest(specs=specs, grad_dtype=torch.int32)


# --- the bug this project exists for -------------------------------------------------------

ODD_SHAPES = [
    (40, 120),
    (120,),
    (40, 40),
    (40,),
    (160, 40),
    (160,),
    (40, 160),
    (97, 40),
    (32, 40),
    (40,),
]


@pytest.mark.parametrize(("recipe", "start_alignment"), [("none", 64), ("mxfp8", 64), ("mxfp8", 1)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_regression_layerwise_main_grad_views_start_64_aligned(recipe, start_alignment, dtype):
    """Megatron-LM's layer-wise optimizer packed params back to back in its gradient buffer.

    With hidden sizes that are not multiples of 64 a ``main_grad`` view then began at an element
    offset like 4,840; the first step's MXFP8 wgrad GEMM wrote into that view through cuBLASLt,
    which refused the unaligned output with CUBLAS_STATUS_NOT_SUPPORTED. Here every start must be
    a multiple of 64 elements (128 B for bf16) in layer-wise mode: by default, with the MXFP8
    requirement, and even when a user lowers ``start_alignment`` to 1 while MXFP8 needs 64.
    (That the allocated tensor's pointer is aligned too is the buffer's test.)
    """
    specs = [ParamSpec(f"blocks.{i // 4}.w{i}", shape, dtype) for i, shape in enumerate(ODD_SHAPES)]
    assert any(ParamSpec("x", s).numel % 64 for s in ODD_SHAPES)
    for bucket_numel in (None, 5000):
        layout = plan_layout(
            specs,
            dp_size=4,
            mode="layerwise",
            bucket_numel=bucket_numel,
            requirements=wgrad_requirements(recipe),
            start_alignment=start_alignment,
        )
        assert layout.start_alignment == 64
        assert [p.name for p in layout.params if p.start % 64] == []
        assert all(p.start * torch.bfloat16.itemsize % 128 == 0 for p in layout.params)


def test_lowered_alignment_is_honoured_without_a_consumer():
    # start_alignment=1 and no requirement: b [0, 103), a [103, 200) packed back to back.
    layout = plan_layout([ParamSpec("a", (97,)), ParamSpec("b", (103,))], start_alignment=1)
    assert spans(layout) == {"b": (0, 103), "a": (103, 200)} and layout.padding_numel == 0


def test_fp8_requirement_counts_bytes_of_the_wider_dtype():
    # FP8 wgrad asks 16 B: 8 elements of bf16 params, 4 of fp32 grads -> lcm 8;
    # b [0, 103), a at 104.
    specs = [ParamSpec("a", (97,), torch.bfloat16), ParamSpec("b", (103,), torch.bfloat16)]
    layout = plan_layout(
        specs, start_alignment=1, requirements=wgrad_requirements("fp8"), grad_dtype=torch.float32
    )
    assert layout.start_alignment == 8 and spans(layout) == {"b": (0, 103), "a": (104, 201)}


# --- validate() on hand-broken layouts ---------------------------------------------------------


def _with_param(layout, name, **changes):
    params = tuple(
        dataclasses.replace(p, **changes) if p.name == name else p for p in layout.params
    )
    return dataclasses.replace(layout, params=params)


def test_validate_names_a_param_shifted_off_alignment():
    layout = plan_layout([ParamSpec("a", (97,)), ParamSpec("b", (103,))])
    broken = _with_param(layout, "a", start=138, end=235)  # a was [128, 225)
    with pytest.raises(
        ValueError, match=r"param 'a' starts at element 138 .*start % 64 = 10.*start_alignment=64"
    ):
        validate(broken)


def test_validate_names_overlapping_params():
    layout = plan_layout(
        [ParamSpec("a", (97,)), ParamSpec("b", (200,))]
    )  # b [0, 200), a [256, 353)
    broken = _with_param(layout, "a", start=192, end=289)
    with pytest.raises(ValueError, match=r"param 'a'.*overlaps param 'b'"):
        validate(broken)


def test_validate_names_a_param_straddling_two_shards():
    # dp 2: b (100,) rank 0 [0, 100), a (100,) rank 1 [128, 228). Widen the bucket to 512 (shards
    # [0, 256), [256, 512)), keep a whole in shard 1 at [320, 420) and move b to [192, 292).
    layout = plan_layout(
        [ParamSpec("a", (100,)), ParamSpec("b", (100,))], dp_size=2, mode="layerwise"
    )
    assert spans(layout) == {"b": (0, 100), "a": (128, 228)}
    broken = _with_param(layout, "b", start=192, end=292)
    broken = _with_param(broken, "a", start=320, end=420)
    broken = dataclasses.replace(broken, buckets=(dataclasses.replace(broken.buckets[0], end=512),))
    with pytest.raises(
        ValueError, match=r"param 'b' starts at element 192.*straddles shards 0 and 1"
    ):
        validate(broken)


def test_validate_names_a_param_with_the_wrong_owner():
    layout = plan_layout(
        [ParamSpec("a", (100,)), ParamSpec("b", (100,))], dp_size=2, mode="layerwise"
    )
    with pytest.raises(ValueError, match=r"param 'a'.*lies in shard 1 but its owner is 0"):
        validate(_with_param(layout, "a", owner=0))


def test_every_bucket_closes_at_bucket_numel():
    # reverse order e, d, c, b, a (100 elements each, 1-element starts): e + d = 200 >= 150 closes
    # bucket 0, c + b = 200 closes bucket 1 (the count restarts at every bucket), a is bucket 2.
    layout = plan_layout(
        [ParamSpec(n, (100,)) for n in "abcde"], bucket_numel=150, start_alignment=1
    )
    assert {p.name: p.bucket for p in layout.params} == {"e": 0, "d": 0, "c": 1, "b": 1, "a": 2}
    assert [(b.start, b.end) for b in layout.buckets] == [(0, 200), (200, 400), (400, 500)]


def test_validate_names_a_sharded_bucket_that_does_not_split_into_equal_shards():
    # dp 2, sharded: b [0, 100), a [128, 228); the bucket is padded to a multiple of 2 x 128 = 256.
    # Cutting it to 255 elements leaves shards of unequal length.
    layout = plan_layout(
        [ParamSpec("a", (100,)), ParamSpec("b", (100,))], dp_size=2, mode="sharded"
    )
    assert [(b.start, b.end) for b in layout.buckets] == [(0, 256)]
    broken = dataclasses.replace(layout, buckets=(dataclasses.replace(layout.buckets[0], end=255),))
    with pytest.raises(
        ValueError, match=r"bucket 0 has 255 elements, not a multiple of dp_size 2.*equal shards"
    ):
        validate(broken)


def test_validate_checks_requirements_given_later():
    layout = plan_layout([ParamSpec("a", (97,)), ParamSpec("b", (103,))], start_alignment=1)
    with pytest.raises(ValueError, match=r"param 'a' starts at element 103.*MXFP8"):
        validate(layout, wgrad_requirements("mxfp8"))


# --- bad input: the error says what to do ------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda: plan_layout([]), ValueError, r"no trainable params.*requires_grad=True"),
        (
            lambda: ParamSpec("w", (4, 0)),
            ValueError,
            r"'w'.*\(4, 0\).*zero elements.*requires_grad=False",
        ),
        (lambda: ParamSpec("w", (4,), dtype="bf16"), TypeError, r"'w'.*torch.dtype"),
        (
            lambda: plan_layout([ParamSpec("w", (4,))], start_alignment=48),
            ValueError,
            r"power of two.*48",
        ),
        (
            lambda: plan_layout([ParamSpec("w", (4,))], shard_alignment=0, mode="sharded"),
            ValueError,
            r"shard_alignment.*power of two.*0",
        ),
        (
            lambda: Requirement("mine", start_elements=96),
            ValueError,
            r"'mine'.*start_elements=96.*power of two",
        ),
        (
            lambda: plan_layout([ParamSpec("w", (4,))], bucket_numel=0),
            ValueError,
            r"bucket_numel.*positive.*None.*0",
        ),
        (
            lambda: plan_layout([ParamSpec("w", (4,))], bucket_numel=-5),
            ValueError,
            r"bucket_numel.*-5",
        ),
        (lambda: plan_layout([ParamSpec("w", (4,))], dp_size=0), ValueError, r"dp_size.*>= 1.*0"),
        (
            lambda: plan_layout([ParamSpec("w", (4,))], mode="zero3"),
            ValueError,
            r"'zero3'.*replicated, sharded",
        ),
        (
            lambda: plan_layout([ParamSpec("a", (4,)), ParamSpec("b", (4,), torch.bfloat16)]),
            ValueError,
            r"one param dtype.*plan_buffers",
        ),
        (
            lambda: plan_layout(
                [ParamSpec("w", (4,))],
                mode="sharded",
                requirements=[Requirement("Muon", whole_param_per_shard=True)],
            ),
            ValueError,
            r"Muon.*whole.*mode='layerwise'",
        ),
    ],
)
def test_bad_input_says_what_to_do(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_unknown_wgrad_recipe_lists_the_choices():
    with pytest.raises(ValueError, match=r"'fp4'.*none, fp8, mxfp8"):
        wgrad_requirements("fp4")


def test_shard_divisible_requirement_is_met_in_replicated_mode():
    # A consumer that slices replicated buckets into dp_size pieces: b [0, 103), a [128, 225); the
    # bucket rounds to lcm(64, 3) = 192 -> 384, so each of 3 slices is 128 elements.
    layout = plan_layout(
        [ParamSpec("a", (97,)), ParamSpec("b", (103,))],
        dp_size=3,
        requirements=[Requirement("slicer", shard_divisible=True)],
    )
    assert [(b.start, b.end) for b in layout.buckets] == [(0, 384)]


def test_layerwise_buckets_close_only_where_they_pack_without_padding():
    """Layerwise buckets grow past bucket_numel until their whole params fill dp_size equal shards.

    Closing at the first param past bucket_numel (the old rule) cut 8-matrix buckets from GPT
    blocks at dp_size 8 and padded each to 8 x the largest matrix (25-29% padding).
    """
    # dp 2, alignments 1, bucket_numel 1. Layout order (reverse registration) has sizes
    # r5=3, r4=1, r3=2 | r2=1, r1=1, r0=2. Bucket 0 can't close at [3, 1] (shards of 3, 2 padding);
    # [3, 1, 2] packs as rank 0 {r5}, rank 1 {r4, r3}: 3 + 3, no padding. [1, 1] closes (1 + 1),
    # but the tail [2] alone would pad 2, so it merges back: [1, 1, 2] packs as rank 0 {r0} (costs
    # tie at 3, lower rank), rank 1 {r2, r1}: 2 + 2.
    specs = [ParamSpec(f"r{i}", (n,)) for i, n in enumerate([2, 1, 1, 2, 1, 3])]
    layout = plan_layout(
        specs, dp_size=2, mode="layerwise", bucket_numel=1, start_alignment=1, shard_alignment=1
    )
    assert [(b.start, b.end) for b in layout.buckets] == [(0, 6), (6, 10)]
    assert {p.name: (p.start, p.end, p.owner) for p in layout.params} == {
        "r5": (0, 3, 0),
        "r4": (3, 4, 1),
        "r3": (4, 6, 1),
        "r0": (6, 8, 0),
        "r2": (8, 9, 1),
        "r1": (9, 10, 1),
    }
    assert layout.padding_numel == 0
