"""parallelize(optimizer="muon"): layer-wise sharded Muon + AdamW against one process (gloo).

The reference is one process on the global batch: ``torch.optim.Muon`` on the routed
matrices and ``torch.optim.AdamW`` on the rest; the comparison is the relative 2-norm error
per param. torch's Muon runs Newton–Schulz in bf16, which turns the last-bit difference
between an all-reduced and a one-process gradient into bf16 rounding flips that five
matmul iterations spread over the whole update (measured up to ~1e-4 relative on a 515x11
matrix after one step). So the fp32 comparisons (:data:`REL`, derived as tests/models.py
[Tolerances] says) patch torch's Newton–Schulz to run in fp32
(:func:`fp32_newton_schulz`, both sides alike); torch's own bf16 path is checked bit for bit
against sharding="none" at dp 2 and loosely against one process.
"""

from __future__ import annotations

import contextlib
import dataclasses
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import aligndp
from aligndp.optim.muon import FLOPS_SPLIT
from aligndp.plan.routing import route_params
from aligndp.plan.spec import Mode
from tests._dist import case, make_tests
from tests.models import (
    BASE,
    GLOBAL_BATCH,
    HUGE,
    MUON_GAIN,
    ONE_MATRIX,
    TIED,
    TOKENS,
    Shape,
    assert_replicas_identical,
    batch,
    ckpt,
    fp32_newton_schulz,
    loss_of,
    order_tolerance,
    rel_error,
)
from tests.models import make_shaped_net as make_net

STEPS = 5
REL = order_tolerance(terms=GLOBAL_BATCH * TOKENS, steps=STEPS, gain=MUON_GAIN)
"""fp32 Newton–Schulz against one process on the global batch's 60 token rows, STEPS steps."""
MUON_LR, ADAMW_LR = 0.02, 0.01
BF16_REL = MUON_GAIN * torch.finfo(torch.bfloat16).eps / 2
"""torch's bf16 Newton–Schulz against one process: the two sides' momenta differ in fp32's last
bits, which bf16 rounds apart in some elements; one bf16 rounding of the step (u_bf16 = 2^-8
relative) moves the params by at most MUON_GAIN times that."""


def backward(model, step: int, rank: int, ws: int, micro_batches: int) -> None:
    """This rank's share of the global batch, in 1 or 2 micro-batches (split along tokens)."""
    idx, tgt = batch(step, rank, ws)
    if micro_batches == 1:
        loss_of(model, idx, tgt).backward()
        return
    with model.no_sync():
        (2 / 5 * loss_of(model, idx[:, :2], tgt[:, :2])).backward()
    (3 / 5 * loss_of(model, idx[:, 2:], tgt[:, 2:])).backward()


class Reference:
    """One process, global batch: Muon on the routed matrices, AdamW on the rest."""

    def __init__(self, shape: Shape, max_grad_norm: float | None = None):
        self.net = make_net(shape)
        routing = route_params(self.net)
        named = dict(self.net.named_parameters())
        self.muon = torch.optim.Muon(
            [named[n] for n in routing.whole], lr=MUON_LR, adjust_lr_fn="match_rms_adamw"
        )
        self.adamw = torch.optim.AdamW([named[n] for n in routing.adamw], lr=ADAMW_LR)
        self.max_grad_norm = max_grad_norm

    def step(self, step: int) -> None:
        loss_of(self.net, *batch(step)).backward()
        if self.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.net.parameters(), self.max_grad_norm)
        for opt in (self.muon, self.adamw):
            opt.step()
            opt.zero_grad()


def assert_owners_partition(opt, routing) -> None:
    """Every Muon matrix is stepped by exactly one rank, and only there has momentum."""
    muon = opt.parts[0]
    mine = [muon.names[i] for i in muon.owned]
    every: list[list[str]] = [None] * dist.get_world_size()  # type: ignore[list-item]
    dist.all_gather_object(every, mine)
    flat = [n for names in every for n in names]
    assert sorted(flat) == sorted(routing.whole), f"owners {every} do not partition {routing.whole}"
    stepped = [n for n in muon.names if "momentum_buffer" in muon.state_of(n)]
    assert sorted(stepped) == sorted(mine), f"momentum on {stepped}, owned {mine}"


def run_against_reference(
    rank,
    ws,
    *,
    shape=BASE,
    sharding="zero1",
    overlap=True,
    micro_batches=1,
    max_grad_norm=None,
    bucket_numel=150,
    rel=REL,
    fp32_ns=True,
    overlap_param_gather=False,
    split=None,
) -> float:
    with fp32_newton_schulz() if fp32_ns else contextlib.nullcontext():
        model, opt = aligndp.parallelize(
            make_net(shape),
            optimizer="muon",
            sharding=sharding,
            lr=MUON_LR,
            adamw_lr=ADAMW_LR,
            overlap=overlap,
            bucket_numel=bucket_numel,
            max_grad_norm=max_grad_norm,
            overlap_param_gather=overlap_param_gather,
            split=split,
        )
        if split is not None:
            assert_some_matrix_split(model, opt)
        return _run_against_reference(
            rank, ws, model, opt, shape, sharding, micro_batches, max_grad_norm, rel
        )


def _run_against_reference(
    rank, ws, model, opt, shape, sharding, micro_batches, max_grad_norm, rel
):
    ref = Reference(shape, max_grad_norm)
    assert opt.routing == route_params(ref.net)
    if sharding == "zero1":
        assert {layout.mode for layout in model.layouts} >= {Mode.LAYERWISE}
    worst = 0.0
    for step in range(STEPS):
        backward(model, step, rank, ws, micro_batches)
        opt.step()
        opt.zero_grad()
        ref.step(step)
        opt.gather.wait_all()  # overlap_param_gather: the gather may still be in flight
        assert_replicas_identical(model.module)
        for (n, p), q in zip(model.module.named_parameters(), ref.net.parameters()):
            err = rel_error(p, q)
            worst = max(worst, err)
            assert err <= rel, (
                f"{shape} {sharding} step {step} {n}: relative error {err:.2e} > {rel}"
            )
    if sharding == "zero1":
        assert_owners_partition(opt, opt.routing)
    return worst


@case(2, 3, 4)
def case_zero1_matches_one_process(rank, ws):
    worst = max(
        run_against_reference(rank, ws, shape=shape, sharding="zero1")
        for shape in (BASE, TIED, ONE_MATRIX, HUGE)
    )
    if rank == 0:
        print(f"zero1, dp {ws}: worst relative error {worst:.2e}")


# [Note: split Newton–Schulz]: tiny matrices split anyway. FORCED cuts every matrix over as many
# ranks as it has rows (ws at most); BALANCED splits only what a perfect balance asks for (flops)
FORCED = dataclasses.replace(FLOPS_SPLIT, min_cols=1, col_multiple=1, min_part_cost=0, budget=1.0)
BALANCED = dataclasses.replace(FORCED, budget=None, target=1.0)


def assert_some_matrix_split(model, opt) -> None:
    """The plan split some matrix, and this rank holds a part exactly where the plan says."""
    splits = {p.name: p.split for lo in model.layouts for p in lo.params if p.split is not None}
    assert splits, "the split policy split nothing"
    mine = {opt.parts[0].names[i] for i in opt.parts[0].splits}
    assert mine == {n for n, s in splits.items() if model.rank in s.ranks}


@case(2, 3, 4)
def case_split_newton_schulz_matches_one_process(rank, ws):
    """Matrices whose Newton–Schulz a group of ranks shares (odd widths: 515 columns cut 258 +
    257, 172 + 172 + 171, ...) train as one process does with torch's Muon: fp32 Newton–Schulz
    (both sides) to REL, torch's bf16 as loosely as without a split (BF16_REL: each part's
    Gram rounds to bf16 as torch's GEMM does, and their fp32 sum rounds once more)."""
    runs = [(HUGE, FORCED)]
    runs += [(HUGE, BALANCED)] if ws > 2 else []  # at dp 2 no cut of 515x11 lowers the max
    worst = max(run_against_reference(rank, ws, shape=shape, split=split) for shape, split in runs)
    bf16 = run_against_reference(rank, ws, shape=HUGE, split=FORCED, fp32_ns=False, rel=BF16_REL)
    if rank == 0:
        print(f"split NS, dp {ws}: worst relative error {worst:.2e} (fp32), {bf16:.2e} (bf16)")


@case(4)
def case_split_newton_schulz_in_a_subgroup(rank, ws):
    """Data parallel over the subgroups {0, 2} and {1, 3} (group ranks are not global ranks, as
    in a mesh's shard group): each matrix's split group is found by its global ranks, and each
    pair trains as one process on its global batch."""
    pairs = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    group = pairs[rank % 2]
    me, size = dist.get_rank(group), dist.get_world_size(group)
    with fp32_newton_schulz():
        model, opt = aligndp.parallelize(
            make_net(HUGE), optimizer="muon", sharding="zero1", lr=MUON_LR, adamw_lr=ADAMW_LR,
            bucket_numel=150, process_group=group, split=FORCED,
        )  # fmt: skip
        assert_some_matrix_split(model, opt)
        ref = Reference(HUGE)
        for step in range(3):
            backward(model, step, me, size, 1)
            opt.step()
            opt.zero_grad()
            ref.step(step)
    for (n, p), q in zip(model.module.named_parameters(), ref.net.parameters()):
        assert rel_error(p, q) <= REL, f"{n}: {rel_error(p, q):.2e}"


@case(4)
def case_split_groups_that_overlap_are_made_on_every_rank(rank, ws):
    """The wrap-time hang of issue 42: ranks {0, 1, 3} and {0, 1, 2} each need one split group,
    and the two overlap. Every rank makes every group in one agreed order (split_groups), so
    each group works for its members and every rank holds the same groups, in the same order;
    made with ``use_local_synchronization=True`` by their members alone, ranks 0-2 waited
    forever."""
    from aligndp.optim import split_ns

    made_anywhere = ((0, 1, 3), (0, 1, 2))
    needed = [r for r in made_anywhere if rank in r]
    made = split_ns.split_groups(needed)
    assert sorted(made) == sorted(needed)
    for ranks, group in made.items():
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=group)
        assert t.item() == sum(ranks), f"group {ranks}: {t.item()}"
    keys = [
        k[1] for k in split_ns._GROUPS if k[0] == id(dist.group.WORLD) and k[1] in made_anywhere
    ]
    everyone = [None] * ws
    dist.all_gather_object(everyone, keys)
    assert all(k == everyone[0] for k in everyone), f"groups differ between ranks: {everyone}"
    assert split_ns.split_groups(needed) == made  # cached: no group made twice


@case(4)
def case_split_groups_of_a_job_smaller_than_the_default_group(rank, ws):
    """A job of ranks {0, 1, 2} while rank 3 does other work: rank 0 needs {0, 1} then {0, 2},
    rank 2 only {0, 2}. Members make a group with local synchronisation, which torch names by
    how many groups the caller has made: rank 2 makes a group of itself at {0, 1}'s turn, so
    ranks 0 and 2 name {0, 2} alike (without it they waited for each other forever)."""
    from aligndp.optim import split_ns

    job = dist.new_group([0, 1, 2])
    if rank == 3:
        return
    needed = [r for r in ((0, 1), (0, 2)) if rank in r]
    made = split_ns.split_groups(needed, job)
    assert sorted(made) == sorted(needed)
    for ranks, group in made.items():
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t, group=group)
        assert t.item() == sum(r + 1 for r in ranks), f"group {ranks}: {t.item()}"


def _issue_gpt():
    from aligndp.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=4096, seq_len=8, dim=768, num_layers=2, head_dim=64))


@case(4)
def case_layerwise_muon_whose_split_groups_overlap_wraps_and_trains(rank, ws):
    """Issue 42's model (2 blocks, width 768, vocabulary 4096) at 4 ranks, flat and on a 2 x 2
    mesh: the flops model's split policy (Muon's default when the plan hung) shares matrices
    over overlapping groups of ranks; every rank finishes parallelize() and two steps, and the
    replicas stay identical."""
    from torch.distributed.device_mesh import init_device_mesh

    for mesh in (None, init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))):
        model, opt = aligndp.parallelize(
            _issue_gpt(), optimizer="muon", sharding="zero1", mesh=mesh, split=FLOPS_SPLIT
        )
        groups = {
            tuple(p.split.ranks) for lo in model.layouts for p in lo.params if p.split is not None
        }
        if mesh is None:  # the plan that hung: distinct groups of ranks that overlap
            overlap = any(set(a) & set(b) for a in groups for b in groups if a != b)
            assert len(groups) > 1 and overlap, f"split groups {groups}"
        for step in range(2):
            gen = torch.Generator().manual_seed(100 * step + rank)
            x = torch.randint(0, 4096, (1, 8), generator=gen)
            model(x).float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        assert_replicas_identical(model.module)


@case(2, 3, 4)
def case_none_matches_one_process(rank, ws):
    worst = max(
        run_against_reference(rank, ws, shape=shape, sharding="none") for shape in (BASE, TIED)
    )
    if rank == 0:
        print(f"none, dp {ws}: worst relative error {worst:.2e}")


@case(2, 3)
def case_micro_batches_and_overlap_off(rank, ws):
    for sharding in ("zero1", "none"):
        run_against_reference(rank, ws, sharding=sharding, micro_batches=2, overlap=False)
        run_against_reference(
            rank, ws, sharding=sharding, micro_batches=2, overlap=True, overlap_param_gather=True
        )


@case(2, 3)
def case_clipping_one_global_norm(rank, ws):
    for sharding in ("zero1", "none"):
        run_against_reference(rank, ws, shape=HUGE, sharding=sharding, max_grad_norm=0.05)


@case(3)
def case_torch_bf16_newton_schulz_close_to_one_process(rank, ws):
    worst = run_against_reference(rank, ws, shape=HUGE, fp32_ns=False, rel=BF16_REL)
    if rank == 0:
        print(f"bf16 Newton–Schulz, dp {ws}: worst relative error {worst:.2e}")


@case(2)
def case_torch_bf16_newton_schulz_bitwise_equal_to_replicated(rank, ws):
    """At dp 2 an all-reduce and a reduce-scatter add the same two numbers: the layer-wise step
    must then give exactly what every rank stepping torch's Muon on the all-reduced grads gives."""
    runs = {}
    for sharding in ("none", "zero1"):
        model, opt = aligndp.parallelize(
            make_net(HUGE), optimizer="muon", sharding=sharding, lr=MUON_LR, bucket_numel=150
        )
        for step in range(STEPS):
            backward(model, step, rank, ws, 1)
            opt.step()
            opt.zero_grad()
        runs[sharding] = [p.detach().clone() for p in model.module.parameters()]
    for n, a, b in zip(dict(make_net(HUGE).named_parameters()), runs["none"], runs["zero1"]):
        assert torch.equal(a, b), (
            f"{n}: layer-wise differs from replicated by {rel_error(b, a):.2e}"
        )


@case(2)
def case_param_groups_and_lr_scheduler(rank, ws):
    model, opt = aligndp.parallelize(
        make_net(),
        optimizer="muon",
        sharding="zero1",
        lr=MUON_LR,
        adamw_lr=ADAMW_LR,
        adamw_betas=(0.8, 0.9),
        momentum=0.9,
        split=FLOPS_SPLIT,  # owners balanced by the flops, as worked by hand below
    )
    tags = [g["optimizer"] for g in opt.param_groups]
    assert tags == ["muon", "adamw"], tags
    assert opt.param_groups[0]["momentum"] == 0.9 and opt.param_groups[1]["betas"] == (0.8, 0.9)
    assert (
        opt.param_groups[0]["weight_decay"] == 0.1 and opt.param_groups[1]["weight_decay"] == 0.01
    )  # torch's
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5**s)
    for step in range(2):
        backward(model, step, rank, ws, 1)
        opt.step()
        sched.step()
        opt.zero_grad()
    assert opt.param_groups[0]["lr"] == pytest.approx(MUON_LR / 4)
    assert opt.parts[1].inner[0].param_groups[0]["lr"] == pytest.approx(ADAMW_LR / 4)
    assert "muon" in repr(opt).lower()
    # Newton-Schulz cost m²·(2n + m) (m <= n), by hand: mlp.0 (37x11) and mlp.1 (11x37) cost
    # 121 * 85 = 10285 each, mix (11x11) 121 * 33 = 3993. The balanced owners put the two 10285s
    # on different ranks: costs 10285 + 3993 = 14278 and 10285, mean 12281.5; matrices this
    # small are never split (parts of at least 2^24 multiply-adds).
    owned: list[list[str]] = [None] * ws  # type: ignore[list-item]
    dist.all_gather_object(owned, [opt.parts[0].names[i] for i in opt.parts[0].owned])
    cost = {"mlp.0.weight": 10285, "mlp.1.weight": 10285, "mix.weight": 3993}
    per_rank = sorted(sum(cost[n] for n in names) for names in owned)
    assert per_rank == [10285, 14278], owned
    assert opt.imbalance == pytest.approx(14278 / 12281.5) and not opt.parts[0].splits
    real = sum(p.numel() for p in model.module.parameters())
    allocated = sum(buf.grad_data.numel() for buf in model.flat_buffers)
    assert opt.padding_fraction == pytest.approx(1 - real / allocated) and allocated > real


@case(2)
def case_bf16_params_fp32_masters(rank, ws):
    net = make_net(HUGE).to(torch.bfloat16)
    model, opt = aligndp.parallelize(
        net, optimizer="muon", sharding="zero1", lr=MUON_LR, grad_dtype=torch.float32
    )
    muon = opt.parts[0]
    for step in range(3):
        backward(model, step, rank, ws, 1)
        opt.step()
        opt.zero_grad()
        assert_replicas_identical(model.module)
    for i in muon.owned:
        assert muon.targets[i].dtype == torch.float32 and muon.targets[i] is not muon.params[i]
        assert torch.equal(muon.params[i], muon.targets[i].to(torch.bfloat16))
        assert muon.state_of(muon.names[i])["momentum_buffer"].dtype == torch.float32


@case(2)
def case_bf16_without_masters_bitwise_equal_to_replicated(rank, ws):
    """``master_weights=False``: the layer-wise Muon part and the ZeRO-1 AdamW part step bf16
    params in bf16 (no fp32 copies, state in bf16), so at dp 2 (a reduce-scatter adds the same
    two numbers as an all-reduce) they give exactly what every rank stepping torch's Muon and
    AdamW on the bf16 model gives (``sharding="none"``). The default's fp32 masters do not,
    which shows the comparison can fail."""
    runs = {}
    for sharding, master_weights in (("none", None), ("zero1", False), ("zero1", None)):
        model, opt = aligndp.parallelize(
            make_net(HUGE).to(torch.bfloat16),
            optimizer="muon",
            sharding=sharding,
            lr=MUON_LR,
            adamw_lr=ADAMW_LR,
            bucket_numel=150,
            master_weights=master_weights,
        )
        for step in range(STEPS):
            backward(model, step, rank, ws, 1)
            opt.step()
            opt.zero_grad()
        opt.gather.wait_all()
        assert_replicas_identical(model.module)
        runs[sharding, master_weights] = [p.detach().clone() for p in model.module.parameters()]
        if sharding == "none":
            continue
        kept = master_weights is None
        state_dtype = torch.float32 if kept else torch.bfloat16
        muon, adamw = opt.parts
        for i in muon.owned:
            assert (muon.targets[i] is not muon.params[i]) == kept, muon.names[i]
            assert muon.state_of(muon.names[i])["momentum_buffer"].dtype == state_dtype
        assert all(p.cast_back == kept for p in adamw.masters)
        assert all(s["exp_avg"].dtype == state_dtype for s in adamw.inner[0].state.values())
    names = list(dict(make_net(HUGE).named_parameters()))
    for n, a, b in zip(names, runs["none", None], runs["zero1", False]):
        assert torch.equal(a, b), f"{n}: layer-wise without masters differs from replicated"
    assert any(not torch.equal(a, b) for a, b in zip(runs["none", None], runs["zero1", None])), (
        "fp32 masters round differently from a bf16 step; this comparison must see it"
    )


# (optimizer, sharding, param dtype, grad dtype, wgrad, start_alignment asked, bytes expected)
ALIGNMENT_RUNS = [
    ("muon", "zero1", torch.float32, None, "mxfp8", 1, 256),  # layerwise + sharded
    ("muon", "none", torch.float32, None, "mxfp8", 1, 256),  # replicated
    ("muon", "zero1", torch.bfloat16, None, "mxfp8", 1, 128),
    ("muon", "zero1", torch.bfloat16, torch.float32, "mxfp8", 1, 256),
    ("muon", "zero1", torch.bfloat16, torch.float32, "fp8", 64, 256),  # the default start alignment
    (
        "adamw",
        "zero1",
        torch.bfloat16,
        None,
        "fp8",
        1,
        16,
    ),  # FP8 asks only 16 B: the user may lower the rest
]


@case(2, 3)
def case_regression_mxfp8_wgrad_with_layerwise_muon_every_view_aligned(rank, ws):
    """Regression for the bug this project exists for.

    Megatron-LM's layer-wise (Muon) optimizer packed params back to back in its buffers, so
    with param sizes that are not multiples of 64 a ``main_grad`` view started at an element
    offset that was not a multiple of 64, and the MXFP8 wgrad GEMM (cuBLASLt) refused it on
    the first step. Here the requirement comes from the wgrad recipe declared to
    ``parallelize`` — not from the optimizer path — and every buffer of every mode
    (replicated, sharded, layerwise), at dp 2 and 3, with odd sizes and the user asking for
    no alignment at all (start_alignment=1), must give 64-element starts and
    ``data_ptr() % (64 * itemsize) == 0`` for every ``main_grad`` and param view.
    """
    seen = set()
    for (
        optimizer,
        sharding,
        dtype,
        grad_dtype,
        wgrad,
        start_alignment,
        align_bytes,
    ) in ALIGNMENT_RUNS:
        model, opt = aligndp.parallelize(
            make_net(HUGE).to(dtype),
            optimizer=optimizer,
            sharding=sharding,
            wgrad=wgrad,
            start_alignment=start_alignment,
            bucket_numel=150,
            grad_dtype=grad_dtype,
        )
        for buf in model.flat_buffers:
            seen.add(buf.layout.mode)
            for p, slot, g in zip(buf.params, buf.slots, buf.main_grads):
                where = f"{optimizer}/{sharding}/{wgrad}/{buf.layout.mode.value} {slot.name}"
                assert (slot.start * g.element_size()) % align_bytes == 0, (
                    f"{where}: starts at {slot.start}"
                )
                assert g is p.main_grad and g.data_ptr() % align_bytes == 0, f"{where}: main_grad"
                if wgrad == "mxfp8":
                    assert slot.start % 64 == 0 and g.data_ptr() % (64 * g.element_size()) == 0, (
                        where
                    )
                if buf.param_data is not None and wgrad == "mxfp8":
                    assert p.data_ptr() % (64 * p.element_size()) == 0, f"{where}: param view"
        backward(model, 0, rank, ws, 1)
        opt.step()
    assert seen == set(Mode), f"modes covered: {seen}"


@case(2)
def case_hand_made_misaligned_layout_refused_naming_the_param(rank, ws):
    """No mode skips validation: a layout whose first param starts one element off is refused
    when ``parallelize`` builds the buffers, with an error naming that param."""
    from aligndp.plan import request as request_module

    for mode, optimizer, sharding in [
        (Mode.REPLICATED, "muon", "none"),
        (Mode.SHARDED, "muon", "zero1"),
        (Mode.LAYERWISE, "muon", "zero1"),
    ]:

        def misaligned(specs, *, _mode=mode, **kwargs):
            layout = aligndp.plan_layout(specs, **kwargs)
            if layout.mode is not _mode:
                return layout
            first = layout.params[0]
            shifted = dataclasses.replace(first, start=first.start + 1, end=first.end + 1)
            return dataclasses.replace(layout, params=(shifted,) + layout.params[1:])

        with mock.patch.object(request_module, "plan_layout", misaligned):  # plan_buffers calls it
            with pytest.raises(ValueError) as error:
                aligndp.parallelize(
                    make_net(HUGE), optimizer=optimizer, sharding=sharding, wgrad="mxfp8"
                )
        message = str(error.value)
        assert "start % 64 = 1" in message and "param '" in message, message
        name = message.split("param '")[1].split("'")[0]
        assert name in dict(make_net(HUGE).named_parameters()), message


# ---- checkpoints: Muon momentum and AdamW state in model space, resharded ----
# ws 4 and 2 save; ws 2 resumes what ws 4 saved (4 -> 2); ws 1 and 3 resume what ws 2 saved.

SAVED_AT = 2


def train(model, opt, steps: range) -> None:
    for step in steps:
        backward(model, step, dist.get_rank(), dist.get_world_size(), 1)
        opt.step()
        opt.zero_grad()
    opt.gather.wait_all()


def build(variant: str, bucket_numel: int | None):
    """``variant``: a sharding, or ``"split"``: zero1 with every matrix's Newton–Schulz shared
    (FORCED; a split is a run-time detail, the checkpoint the same)."""
    return aligndp.parallelize(
        make_net(TIED),
        optimizer="muon",
        sharding="zero1" if variant == "split" else variant,
        lr=MUON_LR,
        adamw_lr=ADAMW_LR,
        bucket_numel=bucket_numel,
        split=FORCED if variant == "split" else None,
    )


@case(2, 4)
def case_checkpoint_save(rank, ws):
    """Writes the checkpoints the resume cases read; asserts that what is saved is the
    one-process state after SAVED_AT steps and that loading it back restores it exactly."""
    with fp32_newton_schulz():
        ref = Reference(TIED)
        for step in range(SAVED_AT):
            ref.step(step)
        for sharding in ("zero1", "none", "split"):
            model, opt = build(sharding, bucket_numel=150)
            if sharding == "split":
                assert_some_matrix_split(model, opt)
            train(model, opt, range(SAVED_AT))
            for (n, p), q in zip(model.module.named_parameters(), ref.net.parameters()):
                assert rel_error(p, q) <= REL, f"{sharding} dp {ws}: {n} before saving"
            aligndp.save(ckpt(f"muon-{sharding}-dp{ws}"), model, opt, step=SAVED_AT)
            fresh, fresh_opt = build(sharding, bucket_numel=150)
            with torch.no_grad():
                for p in fresh.module.parameters():
                    p.add_(1.0)
            assert aligndp.load(ckpt(f"muon-{sharding}-dp{ws}"), fresh, fresh_opt) == SAVED_AT
            for (n, p), q in zip(fresh.module.named_parameters(), model.module.parameters()):
                assert torch.equal(p, q), (
                    f"{sharding} dp {ws}: {n} not restored by a load at the same dp"
                )


def resume_and_compare(saved_dp: int) -> None:
    """Load what dp ``saved_dp`` wrote into a scrambled model at this dp size (both shardings,
    crossed), train to STEPS, compare with the uninterrupted one-process run."""
    with fp32_newton_schulz():
        ref = Reference(TIED)
        for step in range(STEPS):
            ref.step(step)
        crossed = [("zero1", "zero1"), ("none", "zero1"), ("zero1", "none")]
        crossed += [("split", "zero1"), ("zero1", "split")]  # momentum stays with the owner
        for saved, sharding in crossed:
            model, opt = build(sharding, bucket_numel=None if sharding == "zero1" else 150)
            with torch.no_grad():
                for p in model.module.parameters():
                    p.add_(1.0)
            assert aligndp.load(ckpt(f"muon-{saved}-dp{saved_dp}"), model, opt) == SAVED_AT
            if sharding != "none":
                stepped = [n for n in opt.routing.whole if opt.parts[0].state_of(n)]
                assert sorted(stepped) == sorted(opt.parts[0].names[i] for i in opt.parts[0].owned)
            train(model, opt, range(SAVED_AT, STEPS))
            for (n, p), q in zip(model.module.named_parameters(), ref.net.parameters()):
                err = rel_error(p, q)
                assert err <= REL, (
                    f"dp {saved_dp} {saved} -> dp {dist.get_world_size()} {sharding}: {n} {err:.2e}"
                )


@case(2, after=(4,))
def case_checkpoint_resume_from_dp4(rank, ws):
    resume_and_compare(4)


@case(1, 3, after=(2,))
def case_checkpoint_resume_from_dp2(rank, ws):
    resume_and_compare(2)


@case(2)
def case_checkpoint_names_whole_matrix_state_when_groups_reorder_params(rank, ws):
    """param_groups listing the params in another order than the module (two groups, each
    reversed): each matrix's momentum is saved under its own name, as torch's Muon over the
    same groups holds it after one step (read back with plain DCP)."""
    routing = route_params(make_net())
    names = [*routing.whole, *routing.adamw][::-1]
    groups = [{"params": names[::2]}, {"params": names[1::2]}]
    ref_net = make_net()
    named = dict(ref_net.named_parameters())
    whole = [[named[n] for n in g["params"] if n in routing.whole] for g in groups]
    adamw = [[named[n] for n in g["params"] if n in routing.adamw] for g in groups]
    muon = torch.optim.Muon([{"params": ps} for ps in whole if ps], lr=MUON_LR)
    torch_adamw = torch.optim.AdamW([{"params": ps} for ps in adamw if ps], lr=ADAMW_LR)
    loss_of(ref_net, *batch(0)).backward()
    muon.step()
    torch_adamw.step()
    for sharding in ("zero1", "none"):
        model, opt = aligndp.parallelize(
            make_net(),
            optimizer="muon",
            sharding=sharding,
            lr=MUON_LR,
            adamw_lr=ADAMW_LR,
            param_groups=groups,
        )
        train(model, opt, range(1))
        path = ckpt(f"muon-reordered-{sharding}")
        aligndp.save(path, model, opt, step=1)
        read = {n: {"momentum_buffer": torch.empty(named[n].shape)} for n in routing.whole}
        dcp.load({"optim": {"state": read}}, checkpoint_id=path, no_dist=True)
        for n in routing.whole:
            expected = muon.state[named[n]]["momentum_buffer"]
            err = rel_error(read[n]["momentum_buffer"], expected)
            assert err <= REL, f"{sharding}: {n}'s saved momentum is {err:.2e} from torch's"


@case(2)
def case_bad_options(rank, ws):
    with pytest.raises(TypeError, match="adamw_"):
        aligndp.parallelize(make_net(), optimizer="muon", betas=(0.9, 0.99))
    with pytest.raises(ValueError, match="mlp.0.bias"):
        aligndp.parallelize(
            make_net(), optimizer="muon", muon_filter=lambda n, p, m: n.startswith("mlp")
        )


make_tests(globals())
