"""Property tests: every layout invariant of DESIGN.md over thousands of random plans.

Each test draws spec lists of 1-40 params with 1-3-D shapes of odd sizes (1 included), dp_size
1-8, all three modes, random bucket sizes, random consumer requirements (elements and bytes)
and fp32/bf16 param and grad dtypes. The checks below are written from the rules, not from the
planner's code: alignments as byte/element divisibility, coverage and ownership as interval
arithmetic.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aligndp.plan.layout import plan_layout
from aligndp.plan.spec import Mode, ParamSpec, Requirement
from aligndp.plan.validate import validate

DTYPES = [torch.float32, torch.bfloat16]

# Profiles: "ci" (the default) runs 1,112 examples in each of the 9 properties, 10,008 in all,
# in ~35 s on 2 cores; "dev" 100 each for a quick local loop
# (ALIGNDP_HYPOTHESIS_PROFILE=dev). The profile is applied to this module's tests only.
settings.register_profile(
    "ci",
    max_examples=1_112,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "dev", max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
PROFILE = os.environ.get("ALIGNDP_HYPOTHESIS_PROFILE", "ci")
EXAMPLES = settings(settings.get_profile(PROFILE))


def _size(byte: int) -> int:
    """A dim size in 1..300 from one byte, with the ends over-represented (1: 1 in 8, 300
    and 299: 1 in 16 each) so that size 1 and odd sizes come up often."""
    if byte < 32:
        return 1
    if byte >= 240:
        return 300 - (byte & 1)
    return 2 + (byte - 32) * 297 // 208


@st.composite
def shape_lists(draw):
    """1-40 shapes of 1-3 dims, four bytes each (the rank, then the sizes): one draw instead of
    one per dim keeps generation at ~0.2 ms, so the properties can run 10,000 examples."""
    count = draw(st.integers(1, 40))
    raw = draw(st.binary(min_size=4 * count, max_size=4 * count))
    return [
        tuple(_size(b) for b in raw[4 * i + 1 : 4 * i + 2 + raw[4 * i] % 3]) for i in range(count)
    ]


@st.composite
def requirements(draw):
    kind = draw(_KINDS)
    elements = 2 ** draw(_POW8) if kind != "bytes" else 1
    nbytes = 2 ** draw(_POW10) if kind != "elements" else 1
    return Requirement(
        f"consumer {elements} el / {nbytes} B", start_elements=elements, start_bytes=nbytes
    )


@dataclasses.dataclass(frozen=True)
class Plan:
    """One random planning problem: the inputs, so a test can re-plan and re-derive."""

    specs: tuple[ParamSpec, ...]
    kwargs: dict

    def layout(self):
        return plan_layout(self.specs, **self.kwargs)


# Strategies built once: a strategy made inside a draw is validated anew on every example.
_KINDS = st.sampled_from(["elements", "bytes", "both"])
_POW7, _POW8, _POW10 = st.integers(0, 7), st.integers(0, 8), st.integers(0, 10)
_DTYPES = st.sampled_from(DTYPES)
_GRAD_DTYPES = st.sampled_from([None, *DTYPES])
_DP_SIZES = st.integers(1, 8)
_REQUIREMENTS = st.lists(requirements(), max_size=3)
_SHAPE_LISTS = shape_lists()
_NO_BUCKET_LIMIT = st.booleans()
_BUCKET_FRACTION = st.integers(1, 1_000_000)


@st.composite
def plans(draw, modes=tuple(Mode)):
    param_dtype = draw(_DTYPES)
    specs = tuple(
        ParamSpec(f"layer{i}.w", shape, param_dtype) for i, shape in enumerate(draw(_SHAPE_LISTS))
    )
    total = sum(s.numel for s in specs)
    # bucket_numel: None, or 1 .. total * 1.2 (a fraction of the largest, 1 in the shrunk case)
    largest = max(1, total + total // 5)
    bucket_numel = (
        None
        if draw(_NO_BUCKET_LIMIT)
        else 1 + (largest - 1) * (draw(_BUCKET_FRACTION) - 1) // 999_999
    )
    kwargs = dict(
        dp_size=draw(_DP_SIZES),
        mode=draw(_modes(modes)),
        bucket_numel=bucket_numel,
        requirements=tuple(draw(_REQUIREMENTS)),
        start_alignment=2 ** draw(_POW7),
        grad_dtype=draw(_GRAD_DTYPES),
    )
    return Plan(specs, kwargs)


@functools.cache
def _modes(modes: tuple) -> st.SearchStrategy:
    return st.sampled_from(modes)


def _round_up(n, multiple):
    return -(-n // multiple) * multiple


def _itemsizes(layout):
    return {layout.grad_dtype.itemsize, layout.param_dtype.itemsize}


def _expected_alignment(plan, layout):
    """Powers of two: their lcm is the largest of the start alignment and each requirement's."""
    asked = [plan.kwargs["start_alignment"]]
    for r in plan.kwargs["requirements"]:
        asked += [r.start_elements] + [-(-r.start_bytes // size) for size in _itemsizes(layout)]
    return max(asked)


@EXAMPLES
@given(plans())
def test_layout_is_a_function_of_the_inputs_not_their_order(plan):
    """Requirements combine by lcm, so their order is immaterial; and planning from equal but
    freshly built specs gives an equal layout (nothing depends on object identity)."""
    shuffled = dict(plan.kwargs, requirements=tuple(reversed(plan.kwargs["requirements"])))
    fresh = tuple(ParamSpec(s.name, tuple(s.shape), s.dtype) for s in plan.specs)
    a, b = plan_layout(fresh, **shuffled), plan.layout()
    assert (a.params, a.buckets, a.start_alignment, a.padded_numel) == (
        b.params,
        b.buckets,
        b.start_alignment,
        b.padded_numel,
    )


@EXAMPLES
@given(plans())
def test_every_start_meets_every_requirement(plan):
    layout = plan.layout()
    assert layout.start_alignment == _expected_alignment(plan, layout)
    for p in layout.params:
        assert p.start % plan.kwargs["start_alignment"] == 0
        for r in plan.kwargs["requirements"]:
            assert p.start % r.start_elements == 0, (p, r)
            for size in _itemsizes(layout):
                assert p.start * size % r.start_bytes == 0, (p, r, size)


@EXAMPLES
@given(plans())
def test_buckets_are_contiguous_and_hold_every_param_once_without_overlap(plan):
    layout = plan.layout()
    # reverse registration order, bucket by bucket (layerwise: grouped by owner inside a bucket)
    in_order = sorted(layout.params, key=lambda p: (p.bucket, -p.index))
    assert [p.name for p in in_order] == [s.name for s in reversed(plan.specs)]
    grouped = sorted(layout.params, key=lambda p: (p.bucket, p.owner or 0, -p.index))
    assert list(layout.params) == grouped
    assert sorted(p.index for p in layout.params) == list(range(len(plan.specs)))
    assert layout.buckets[0].start == 0
    for i, (a, b) in enumerate(zip(layout.buckets, layout.buckets[1:])):
        assert a.index == i and a.end == b.start
    assert layout.buckets[-1].end == layout.padded_numel
    for p in layout.params:
        spec = plan.specs[p.index]
        assert (p.name, p.shape, p.end - p.start) == (spec.name, spec.shape, spec.numel)
        bucket = layout.buckets[p.bucket]
        assert bucket.start <= p.start < p.end <= bucket.end
    assert {p.bucket for p in layout.params} == set(range(len(layout.buckets)))  # no empty bucket
    ordered = sorted(layout.params, key=lambda p: p.start)
    assert all(a.end <= b.start for a, b in zip(ordered, ordered[1:]))
    assert layout.numel == sum(s.numel for s in plan.specs)
    assert layout.padding_numel == layout.padded_numel - layout.numel >= 0


@EXAMPLES
@given(plans(modes=(Mode.SHARDED, Mode.LAYERWISE)))
def test_sharded_buckets_split_into_equal_aligned_shards(plan):
    layout = plan.layout()
    dp_size = plan.kwargs["dp_size"]
    shard_alignment = max(128, layout.start_alignment)
    for b in layout.buckets:
        assert b.numel % dp_size == 0
        assert (b.numel // dp_size) % shard_alignment == 0
        assert layout.shard_range(b.index, dp_size - 1)[1] == b.end


@EXAMPLES
@given(plans(modes=(Mode.LAYERWISE,)))
def test_layerwise_params_lie_whole_in_their_owners_shard(plan):
    layout = plan.layout()
    for p in layout.params:
        inside = [
            r
            for r in range(layout.dp_size)
            if layout.shard_range(p.bucket, r)[0] <= p.start
            and p.end <= layout.shard_range(p.bucket, r)[1]
        ]
        assert inside == [p.owner], p


def _rank_pieces(layout):
    """Per param: the [lo, hi) pieces owned ranks hold (shard range ∩ param), with the rank."""
    pieces = {p.name: [] for p in layout.params}
    for b in layout.buckets:
        for rank in range(layout.dp_size if layout.sharded else 1):
            lo, hi = layout.shard_range(b.index, rank)
            for p in layout.params_in_bucket(b.index):
                if max(lo, p.start) < min(hi, p.end):
                    pieces[p.name].append((max(lo, p.start), min(hi, p.end), rank))
    return pieces


@EXAMPLES
@given(plans())
def test_owned_ranges_partition_the_real_elements_exactly_once(plan):
    layout = plan.layout()
    pieces = _rank_pieces(layout)
    for p in layout.params:
        owned = sorted(pieces[p.name])
        assert owned[0][0] == p.start and owned[-1][1] == p.end
        assert all(a[1] == b[0] for a, b in zip(owned, owned[1:])), owned  # no gap, no double
        if layout.mode is Mode.LAYERWISE:
            assert [rank for *_, rank in owned] == [p.owner]


@EXAMPLES
@given(plans())
def test_padding_is_reported_and_bounded(plan):
    """Bounds, with A the start alignment, S = max(128, A) the shard alignment, U a bucket's
    params rounded up to A each and M the largest of them:

    - replicated and sharded: the gap after a param up to the next param is <= A - 1; the last
      param of a bucket is followed by <= A - 1 (replicated) or dp_size * S - 1 (sharded).
    - layerwise: within a shard gaps are <= A - 1 too, and each shard is at most
      round_up(max(U / dp_size + M, 1.005 * U / dp_size), S): a rank is filled only while it
      stays under ~U / dp_size (0.5% slack), else the emptiest rank takes the param, so no
      rank passes the mean by more than one param.
    """
    layout = plan.layout()
    A, dp_size = layout.start_alignment, layout.dp_size
    S = max(128, A)
    for b in layout.buckets:
        members = sorted(layout.params_in_bucket(b.index), key=lambda p: p.start)
        if layout.mode is Mode.LAYERWISE:
            shard = b.numel // dp_size
            sizes = [_round_up(p.numel, A) for p in members]
            U, M = sum(sizes), max(sizes)
            assert shard <= _round_up(
                max(math.ceil(U / dp_size) + M, math.ceil(1.005 * U / dp_size)), S
            )
            for r in range(dp_size):
                lo, hi = layout.shard_range(b.index, r)
                mine = [p for p in members if p.owner == r]
                assert all(q.start - p.end <= A - 1 for p, q in zip(mine, mine[1:]))
                assert not mine or mine[0].start == lo
        else:
            assert all(q.start - p.end <= A - 1 for p, q in zip(members, members[1:]))
            tail = A - 1 if layout.mode is Mode.REPLICATED else dp_size * S - 1
            assert b.end - members[-1].end <= tail
            assert members[0].start == b.start


@EXAMPLES
@given(plans(), st.data())
def test_validate_names_a_param_shifted_by_ten_elements(plan, data):
    layout = plan.layout()
    if (
        layout.start_alignment < 16
    ):  # a shift of 10 only breaks alignments of 4 and up; keep it loud
        return
    victim = data.draw(st.sampled_from(layout.params))
    moved = dataclasses.replace(victim, start=victim.start + 10, end=victim.end + 10)
    broken = dataclasses.replace(
        layout, params=tuple(moved if p is victim else p for p in layout.params)
    )
    with pytest.raises(
        ValueError, match=f"param '{victim.name}' starts at element {victim.start + 10}"
    ):
        validate(broken)


@EXAMPLES
@given(plans(modes=(Mode.LAYERWISE,)), st.data())
def test_validate_names_a_param_given_the_wrong_owner(plan, data):
    layout = plan.layout()
    if layout.dp_size == 1:
        return
    victim = data.draw(st.sampled_from(layout.params))
    wrong = dataclasses.replace(victim, owner=(victim.owner + 1) % layout.dp_size)
    broken = dataclasses.replace(
        layout, params=tuple(wrong if p is victim else p for p in layout.params)
    )
    with pytest.raises(ValueError, match=f"param '{victim.name}'.*owner is {wrong.owner}"):
        validate(broken)
