"""ZeRO-1 (sharding="zero1") against torch's optimizers on one process with the global batch
(gloo)."""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import aligndp
from aligndp.optim.sharded import ShardedOptimizer, check_elementwise
from aligndp.plan.layout import plan_layout
from aligndp.plan.spec import Mode, ParamSpec
from aligndp.runtime.step_state import BucketRef
from tests._dist import case, make_tests
from tests.models import (
    ADAMW_GAIN,
    GLOBAL_BATCH,
    TOKENS,
    assert_params_match,
    assert_replicas_identical,
    batch,
    loss_of,
    make_net,
    order_tolerance,
)

STEPS = 5
RTOL = order_tolerance(terms=GLOBAL_BATCH * TOKENS, steps=STEPS, gain=ADAMW_GAIN)
"""fp32, one process on the global batch's 60 token rows against the ranks' partial sums, over
``STEPS`` Adam(W) steps (the largest gain of the optimizers compared here)."""


def train_and_compare(
    *,
    optimizer="adamw",
    ref_class=torch.optim.AdamW,
    steps=STEPS,
    rtol=RTOL,
    max_grad_norm=None,
    micro_batches=1,
    **kwargs,
) -> None:
    """``steps`` ZeRO-1 steps vs ``ref_class`` on one process with the global batch, compared every
    step."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    opt_kwargs = {"lr": 1e-2} | ({"momentum": 0.9} if ref_class is torch.optim.SGD else {})
    model, opt = aligndp.parallelize(
        make_net(),
        optimizer=optimizer,
        sharding="zero1",
        max_grad_norm=max_grad_norm,
        **opt_kwargs,
        **kwargs,
    )
    assert isinstance(opt, ShardedOptimizer)
    ref = make_net()
    ref_opt = ref_class(ref.parameters(), **opt_kwargs)
    for step in range(steps):
        idx, tgt = batch(step, rank, ws)
        for i in range(
            micro_batches
        ):  # split every row's 5 tokens; equal shares keep the mean exact
            cols = slice(i * 5 // micro_batches, (i + 1) * 5 // micro_batches)
            weight = (cols.stop - cols.start) / 5
            if i < micro_batches - 1:
                with model.no_sync():
                    (weight * loss_of(model, idx[:, cols], tgt[:, cols])).backward()
            else:
                (weight * loss_of(model, idx[:, cols], tgt[:, cols])).backward()
        opt.step()
        opt.zero_grad()
        if kwargs.get("overlap_param_gather") and ws > 1:
            assert opt.gather.in_flight == len(model.layouts[0].buckets), (
                "the gather should still be in flight"
            )
            with torch.no_grad():
                model(idx)  # every module's pre-hook waits for its own buckets
            assert opt.gather.in_flight == 0, "forward pre-hooks left gathers unwaited"
        loss_of(ref, *batch(step)).backward()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), max_grad_norm)
        ref_opt.step()
        ref_opt.zero_grad()
        assert_replicas_identical(model.module)
        assert_params_match(model.module, ref, f"step {step}", rtol)


@case(2, 3, 4)
def case_adamw_equals_single_process(rank, ws):
    """Small buckets: params straddle slices; several buckets; grad and param-gather overlap
    on/off."""
    train_and_compare(bucket_numel=200, overlap=True)
    train_and_compare(bucket_numel=300, overlap=False, overlap_param_gather=True)


@case(2, 3)
def case_adamw_clipping_and_one_bucket(rank, ws):
    train_and_compare(max_grad_norm=0.05, overlap_param_gather=True)


@case(2, 3)
def case_micro_batches_no_sync(rank, ws):
    train_and_compare(micro_batches=3, bucket_numel=250, steps=3)


@case(2)
def case_adam_and_sgd(rank, ws):
    train_and_compare(optimizer="adam", ref_class=torch.optim.Adam, bucket_numel=200, steps=3)
    train_and_compare(
        optimizer="sgd", ref_class=torch.optim.SGD, bucket_numel=200, steps=3, max_grad_norm=0.1
    )


@case(2)
def case_lr_scheduler_reaches_inner_optimizer(rank, ws):
    model, opt = aligndp.parallelize(make_net(), sharding="zero1", lr=0.1, optimizer="sgd")
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for step in range(2):
        loss_of(model, *batch(step, rank, ws)).backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    assert opt.inner[0].param_groups[0]["lr"] == pytest.approx(0.025)


@case(2)
def case_bf16_params_fp32_masters(rank, ws):
    """bf16 forward/backward, fp32 grad buffer and masters vs one process: bf16 model, fp32
    master AdamW.

    The only difference is where grads are rounded: the reference's param.grad is bf16 of the
    global batch, ours are bf16 per rank, averaged in fp32. Adam divides by sqrt(v), so an
    element whose tiny gradient rounds to the other sign moves by ~2 lr the other way: the
    bound is on the mean (measured ~7e-3 lr after 5 steps at ws 2) and the max (measured ~1 lr).
    """
    bf16_against_fp32_masters(torch.float32, mean_bound=0.02)
    bf16_against_fp32_masters(
        None, mean_bound=0.05
    )  # bf16 grad buffer: also rounded after the reduction


def bf16_against_fp32_masters(grad_dtype: torch.dtype | None, *, mean_bound: float) -> None:
    rank, ws = dist.get_rank(), dist.get_world_size()
    lr = 1e-2
    model, opt = aligndp.parallelize(
        make_net().to(torch.bfloat16),
        sharding="zero1",
        grad_dtype=grad_dtype,
        lr=lr,
        bucket_numel=200,
    )
    assert all(b.layout.grad_dtype == (grad_dtype or torch.bfloat16) for b in model.flat_buffers)
    ref = make_net().to(torch.bfloat16)
    masters = [p.detach().float().clone() for p in ref.parameters()]
    ref_opt = torch.optim.AdamW(masters, lr=lr)
    for step in range(STEPS):
        loss_of(model, *batch(step, rank, ws)).backward()
        opt.step()
        opt.zero_grad()
        loss_of(ref, *batch(step)).backward()
        for m, p in zip(masters, ref.parameters()):
            m.grad = p.grad.float()
            p.grad = None
        ref_opt.step()
        with torch.no_grad():
            for m, p in zip(masters, ref.parameters()):
                p.copy_(m)
        assert_replicas_identical(model.module)
        assert all(p.dtype == torch.bfloat16 for p in model.module.parameters())
    ours = {p.piece.name: p for p in opt.masters}
    diffs = []
    for (n, _), m in zip(model.module.named_parameters(), masters):
        if n in ours:
            seg = ours[n].piece
            diffs.append(
                (ours[n].master - m.reshape(-1)[seg.offset : seg.offset + seg.numel]).abs()
            )
    diff = torch.cat(diffs)
    print(
        f"bf16 params, {grad_dtype} grads: masters vs reference: mean |diff| "
        f"{diff.mean() / lr:.3g} lr, "
        f"max {diff.max() / lr:.3g} lr"
    )
    assert diff.mean() <= mean_bound * lr and diff.max() <= 2 * lr, (
        diff.mean() / lr,
        diff.max() / lr,
    )


def bf16_zero1_and_torch_ddp(*, master_weights, grad_dtype=None, same_batch=False):
    """STEPS of ZeRO-1 and of torch DDP + ``torch.optim.AdamW`` on identical bf16 models, each
    rank feeding both its own slice of the global batch (``same_batch``: every rank rank 0's).
    Returns our wrapped model, our optimizer and torch's DDP model."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    lr = 1e-2
    model, opt = aligndp.parallelize(
        make_net().to(torch.bfloat16),
        sharding="zero1",
        master_weights=master_weights,
        grad_dtype=grad_dtype,
        lr=lr,
        bucket_numel=200,  # several buckets; params straddle slices
    )
    theirs = nn.parallel.DistributedDataParallel(make_net().to(torch.bfloat16))
    their_opt = torch.optim.AdamW(theirs.parameters(), lr=lr)
    for step in range(STEPS):
        data = batch(step, 0, ws) if same_batch else batch(step, rank, ws)
        for m, o in ((model, opt), (theirs, their_opt)):
            loss_of(m, *data).backward()
            o.step()
            o.zero_grad()
    assert_replicas_identical(model.module)
    return model, opt, theirs


def params_differing(model: nn.Module, theirs: nn.Module) -> list[str]:
    return [
        n
        for (n, p), q in zip(model.named_parameters(), theirs.parameters())
        if not torch.equal(p.detach(), q.detach())
    ]


def state_dtypes(opt) -> set[torch.dtype]:
    return {t.dtype for s in opt.inner[0].state.values() for k, t in s.items() if k != "step"}


@case(2, 3)
def case_bf16_without_masters_equals_torch_ddp(rank, ws):
    """``master_weights=False``: ZeRO-1 on a bf16 model is torch DDP + torch AdamW on it, bit
    for bit (every param and its AdamW state in bf16, as torch steps them).

    What makes it exact: on gloo both average the same way (each rank divides by dp_size,
    the collective sums), AdamW is elementwise (a slice steps as the whole tensor does), so it
    is exact wherever the reduced bf16 gradient is the same number on both sides. At dp 2 it
    is for any data: one sum of two halved addends, whatever the order; with an fp32 grad
    buffer (``grad_dtype``) it is the same fp32 addition gloo does for bf16, rounded to bf16
    once when the step casts it. At dp 3 it is not: gloo's ring adds three bf16 addends,
    rounding after each, in an order set by the element's place in the message, and torch
    DDP's bucket holds the params at other offsets than our padded buffers, so some gradients
    differ by one bf16 ulp (measured: 7 of 8 params after one step) and Adam's normalisation
    makes that an lr-sized step. So at dp 3 every rank feeds the same batch (three equal
    addends: one rounding in any order) and the check stays exact for the three-way slicing,
    ownership and gathers; averaging over different data is dp 2's part.

    The default (fp32 masters) must differ from torch here only by optimizer precision: the
    same comparison sees it (so an ignored ``master_weights=False`` fails), and it stays close.
    """
    same_batch = ws > 2
    for grad_dtype in (None, torch.float32) if ws == 2 else (None,):
        model, opt, theirs = bf16_zero1_and_torch_ddp(
            master_weights=False, grad_dtype=grad_dtype, same_batch=same_batch
        )
        differ = params_differing(model.module, theirs.module)
        assert not differ, f"grad_dtype {grad_dtype}: {differ} differ from torch DDP + AdamW"
        assert opt.masters, "every rank owns a part of this model"
        for p in opt.masters:
            view = p.buffer.param_data[p.piece.start : p.piece.end]
            assert not p.cast_back and p.master.data_ptr() == view.data_ptr(), (
                f"{p.piece.name}: the master must be the param_data view itself"
            )
        assert state_dtypes(opt) == {torch.bfloat16}, state_dtypes(opt)
    model, opt, theirs = bf16_zero1_and_torch_ddp(master_weights=None, same_batch=same_batch)
    assert all(p.cast_back and p.master.dtype == torch.float32 for p in opt.masters)
    assert state_dtypes(opt) == {torch.float32}, state_dtypes(opt)
    assert params_differing(model.module, theirs.module), (
        "fp32 masters round differently from torch's bf16 step; this comparison must see it"
    )
    diff = torch.cat(
        [
            (p.detach().float() - q.detach().float()).abs().reshape(-1)
            for p, q in zip(model.module.parameters(), theirs.module.parameters())
        ]
    )
    assert diff.mean() <= 0.2 * 1e-2, f"mean |diff| {diff.mean():.3g} (measured ~0.08 lr)"


@case(2)
def case_master_weights_true_without_sharding_is_refused(rank, ws):
    """fp32 masters are kept by ZeRO-1 only: asking for them with sharding='none' is refused
    before anything is wrapped, on every rank (this case runs on each), naming the fix."""
    net = make_net().to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"master_weights=True.*sharding='zero1'.*fp32 params"):
        aligndp.parallelize(net, sharding="none", master_weights=True)
    with pytest.raises(TypeError, match=r"master_weights= takes None, True or False.*'no'"):
        aligndp.parallelize(net, sharding="zero1", master_weights="no")
    assert type(net.fc1.weight) is nn.Parameter, "a refused call must not wrap the model"
    model, opt = aligndp.parallelize(net, sharding="none", master_weights=False)
    assert isinstance(opt.inner[0], torch.optim.AdamW)


class Tiny(nn.Module):
    """Two params, 4 elements: fewer params than ranks; most ranks own only padding."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(3, 1)

    def forward(self, x):
        return self.lin(x)


@case(2)
def case_masters_live_with_the_buckets(rank, ws):
    """[Note: masters with the buckets]: the ZeRO-1 part steps exactly the masters its buckets
    keep, one per non-empty owned piece (the plan's ``OwnedPiece``s of this rank, buffer by
    buffer), fp32 copies of the bf16 params; a bucket's gather launch casts them back into
    ``param_data`` (and the optimizer installs no hook on the model)."""
    net = make_net().to(torch.bfloat16)
    hooks_before = len(net._forward_pre_hooks)
    model, opt = aligndp.parallelize(net, sharding="zero1", lr=1e-2, bucket_numel=200)
    kept = [m for b in model.buckets if b.masters for m in b.masters]
    assert {id(m) for m in opt.masters} == {id(m) for m in kept}, "the part's own masters"
    planned = [piece for buf in model.flat_buffers for piece in buf.layout.owned_pieces(rank)]
    assert sorted((m.piece.name, m.piece.start) for m in kept) == sorted(
        (piece.name, piece.start) for piece in planned
    )
    assert all(m.cast_back and m.master.dtype == torch.float32 for m in kept)
    assert len(net._forward_pre_hooks) == hooks_before, "the optimizer installs no hook"
    with torch.no_grad():
        for m in kept:
            m.master.fill_(0.5)
    model.param_gather.launch_rest()
    model.param_gather.wait_all()
    for p in model.module.parameters():
        assert torch.equal(p.detach(), torch.full_like(p, 0.5)), "cast back, then gathered"


@case(4)
def case_fewer_params_than_ranks(rank, ws):
    model, opt = aligndp.parallelize(Tiny(), sharding="zero1", lr=1e-1)
    owned = sum(p.piece.numel for p in opt.masters)
    assert owned == (4 if rank == 0 else 0), f"rank {rank} owns {owned} elements"
    ref = Tiny()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-1)
    x = torch.randn(8, 3, generator=torch.Generator().manual_seed(0))
    for _ in range(3):
        model(x[rank * 2 : (rank + 1) * 2]).square().mean().backward()
        opt.step()
        opt.zero_grad()
        ref(x).square().mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
        assert_replicas_identical(model.module)
        assert_params_match(model.module, ref, "tiny", RTOL)


@case(2)
def case_param_gather_runs_in_forward_order(rank, ws):
    """The first module of the next forward must wait only for its own bucket: NCCL runs
    gathers in launch order and layouts put the first layers in the *last* bucket, so the
    gathers are launched in forward order, not bucket order."""
    model, opt = aligndp.parallelize(
        make_net(), sharding="zero1", bucket_numel=200, overlap_param_gather=True
    )
    layout = model.layouts[0]
    assert len(layout.buckets) > 2
    first_bucket = layout.param("emb.weight").bucket
    assert first_bucket == len(layout.buckets) - 1, "reverse registration order puts emb last"
    assert opt.gather.order[0] == BucketRef(0, first_bucket)
    assert [ref.bucket for ref in opt.gather.order] == sorted(
        range(len(layout.buckets)), reverse=True
    )
    loss_of(model, *batch(0, rank, ws)).backward()
    opt.step()
    emb = model.module.emb

    def pending(m: nn.Module) -> bool:  # type() reads no values: it never waits
        return type(m.weight).__name__.startswith("Pending")

    assert pending(emb), "emb's gather is in flight: its weight reads must wait"
    seen = []  # registered after aligndp's pre-hook, so it runs after it, before forward
    handle = emb.register_forward_pre_hook(lambda m, _args: seen.append(pending(m)))
    with torch.no_grad():
        emb(batch(1, rank, ws)[0])  # the first module alone
    handle.remove()
    assert seen == [False], "emb's own pre-hook must wait for its bucket before its forward"
    assert opt.gather.in_flight == len(layout.buckets) - 1, (
        "only emb's bucket may have been waited for"
    )
    opt.gather.wait_all()


@case(2)
def case_optimizer_state_is_sharded(rank, ws):
    model, opt = aligndp.parallelize(make_net(), sharding="zero1", lr=1e-2, bucket_numel=200)
    loss_of(model, *batch(0, rank, ws)).backward()
    opt.step()
    state_numel = sum(s["exp_avg"].numel() for s in opt.inner[0].state.values())
    total = sum(p.numel() for p in model.module.parameters())
    everyone = [None] * ws
    dist.all_gather_object(everyone, state_numel)
    assert sum(everyone) == total, f"state elements {everyone} do not add up to {total}"


class Scaled(nn.Module):
    """``(w * x).sum()``: the gradient of the bf16 ``w`` is ``x`` exactly, whatever ``w``."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(n, dtype=torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.w * x).sum()


@case(2)
def case_bf16_weight_writes_reach_the_fp32_masters_exactly(rank, ws):
    """Issue 25, group 9. A bf16 param under ZeRO-1 with fp32 masters, SGD at lr 1 with
    gradients of 1-4 x 2^-10 (every sum exact in fp32 and in any order), against a hand-kept
    fp32 master stepped by torch's SGD, compared bit for bit after the bf16 cast:
    - a write of one element (``w[0] = 0.5``, ``w.data[0] = 0.5``) refreshes that element's
      master only; the others keep their fp32 precision (below bf16's ulp here), which
      later steps show;
    - ``w.data = t`` after wrapping reaches the masters: the next step starts from ``t``."""
    n = 130  # both ranks own part of it
    x = torch.tensor([(1 + i % 4) * 2.0**-10 for i in range(n)], dtype=torch.bfloat16)
    for how in ("w[0] = 0.5", "w.data[0] = 0.5", "w.data = t"):
        model, opt = aligndp.parallelize(Scaled(n), optimizer="sgd", sharding="zero1", lr=1.0)
        master = torch.ones(n)
        ref_opt = torch.optim.SGD([master], lr=1.0)
        w = model.module.w
        for step in range(6):
            if step == 2:
                assert not torch.equal(master, master.to(torch.bfloat16).float()), (
                    "the masters must hold precision below bf16's for this test to see it"
                )
                with torch.no_grad():
                    if how == "w[0] = 0.5":
                        w[0] = 0.5
                        master[0] = 0.5
                    elif how == "w.data[0] = 0.5":
                        w.data[0] = 0.5
                        master[0] = 0.5
                    else:
                        w.data = torch.full((n,), 0.75, dtype=torch.bfloat16)
                        master.fill_(0.75)
            model(x).backward()
            opt.step()
            opt.zero_grad()
            master.grad = x.float()
            ref_opt.step()
            expected = master.to(torch.bfloat16)
            differ = (w.detach() != expected).nonzero().flatten().tolist()
            assert not differ, f"{how} step {step}: elements {differ[:8]} differ"


# ---- single-process tests ----


def test_owned_pieces_partition_real_elements():
    """Over all ranks, owned pieces cover every real element of every buffer exactly once."""
    rng = random.Random(0)
    for trial in range(60):
        specs = [
            ParamSpec(f"p{i}", tuple(rng.randint(1, 40) for _ in range(rng.randint(1, 2))))
            for i in range(rng.randint(1, 9))
        ]
        dp_size = rng.choice([1, 2, 3, 4, 8])
        bucket = rng.choice([None, 50, 300, 2000])
        layout = plan_layout(specs, dp_size=dp_size, mode=Mode.SHARDED, bucket_numel=bucket)
        count = torch.zeros(layout.padded_numel, dtype=torch.int32)
        for rank in range(dp_size):
            for s in layout.owned_pieces(rank):
                lo, hi = layout.shard_range(s.bucket, rank)
                assert lo <= s.start < s.end <= hi
                slot = layout.param(s.name)
                assert s.offset == s.start - slot.start and s.offset + s.numel <= slot.numel
                count[s.start : s.end] += 1
        real = torch.zeros_like(count)
        for p in layout.params:
            real[p.start : p.end] = 1
        assert torch.equal(count, real), (
            f"trial {trial}: owned pieces do not partition the real elements"
        )


@case(2)
def case_step_hooks_fire(rank, ws):
    """torch's ``register_step_pre_hook`` / ``register_step_post_hook`` work on aligndp's
    optimizers (``torch.optim.Optimizer.__init__`` runs and patches ``step``), once per step,
    around the inner step, in every mode."""
    for kwargs in ({"sharding": "zero1"}, {"sharding": "none"}, {"optimizer": "muon"}):
        model, opt = aligndp.parallelize(make_net(), lr=1e-2, **kwargs)
        seen: list[tuple[str, bool]] = []

        def hook(name, seen=seen, opt=opt):
            return lambda o, args, kw: seen.append((name, o is opt))

        opt.register_step_pre_hook(hook("pre"))
        opt.register_step_post_hook(hook("post"))
        for step in range(2):
            loss_of(model, *batch(step, rank, ws)).backward()
            opt.step()
            opt.zero_grad()
        assert seen == [("pre", True), ("post", True)] * 2, (kwargs, seen)
        assert opt.defaults == opt.inner[0].defaults and len(opt.param_groups) >= 1


def test_non_elementwise_optimizer_is_refused():
    class Whole(torch.optim.Optimizer):
        def __init__(self, params, lr=0.1):
            super().__init__(params, {"lr": lr})

    with pytest.raises(ValueError, match="layer-wise mode"):
        check_elementwise(Whole)
    with pytest.raises(ValueError, match="layer-wise mode"):
        aligndp.parallelize(make_net(), sharding="zero1", optimizer=Whole)
    with pytest.raises(ValueError, match="layer-wise mode"):
        check_elementwise(torch.optim.Muon)
    check_elementwise(torch.optim.AdamW)
    check_elementwise("sgd")


make_tests(globals())
