"""DataParallel against torch DDP and against one process on the global batch (gloo)."""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import aligndp
from aligndp.plan.spec import Mode
from aligndp.runtime.collective_backends import register_collectives
from aligndp.runtime.collectives import TorchCollectives
from aligndp.runtime.ddp import DataParallel, DDPConfig
from tests._dist import case, make_tests
from tests.models import (
    ADAMW_GAIN,
    GLOBAL_BATCH,
    TOKENS,
    VOCAB,
    NetWithBuffers,
    assert_close,
    batch,
    loss_of,
    make_net,
    order_tolerance,
)

TERMS = GLOBAL_BATCH * TOKENS
"""The longest sum behind a gradient element: one process sums the global batch's 60 token rows
in one GEMM, the ranks sum their share and the all-reduce adds the partial sums."""
GRAD_REL = order_tolerance(terms=TERMS)
SGD_REL = order_tolerance(terms=TERMS, steps=4)
ADAMW_REL = order_tolerance(terms=TERMS, steps=3, gain=ADAMW_GAIN)
BF16_GRAD_REL = 4 * torch.finfo(torch.bfloat16).eps / 2 * 2**0.5
"""bf16 params, GEMMs accumulating in fp32: each side rounds a gradient to bf16 up to four times
(a rank's partial GEMM, the twice-used ``mix``'s bf16 accumulation, the one-process result),
and the two ranks' roundings add up to sqrt(2) times one."""


def reference_grads(step: int = 0, frozen: bool = False) -> dict[str, torch.Tensor]:
    """One process, global batch."""
    net = make_net(frozen)
    loss_of(net, *batch(step)).backward()
    return {n: p.grad for n, p in net.named_parameters() if p.requires_grad}


def grads_match_torch_ddp(overlap: bool) -> None:
    rank, ws = dist.get_rank(), dist.get_world_size()
    ours = DataParallel(make_net(), config=DDPConfig(bucket_numel=200, overlap=overlap))
    theirs = nn.parallel.DistributedDataParallel(make_net(), bucket_cap_mb=0.001)
    assert len(ours.layouts[0].buckets) > 2, "the test needs several buckets"
    seen_in_flight: list[list] = []
    # emb.weight is registered first, so its gradient arrives last; this hook runs after ours
    ours.module.emb.weight.register_post_accumulate_grad_hook(
        lambda _p: seen_in_flight.append(ours.buckets_in_flight())
    )
    for step in range(3):  # step 0 learns readiness; later steps overlap
        ours.zero_grad_buffer()
        theirs.zero_grad()
        seen_in_flight.clear()
        loss_of(ours, *batch(step, rank, ws)).backward()
        launched_early = ours.last_round.launched_during_backward
        # the last gradient of a learned step launched every bucket, none waited for yet
        expected_in_flight = ours.bucket_refs if overlap and step > 0 else []
        assert seen_in_flight == [expected_in_flight], (step, seen_in_flight)
        assert ours.buckets_in_flight() == [], "backward returns with every bucket reduced"
        ours.finish_grad_sync()
        ours.finish_grad_sync()  # idempotent
        loss_of(theirs, *batch(step, rank, ws)).backward()
        if overlap and step > 0:
            assert launched_early == len(ours.bucket_refs), (
                f"only {launched_early} buckets launched during backward"
            )
        if not overlap:
            assert launched_early == 0
        for (n, p), q in zip(ours.module.named_parameters(), theirs.module.parameters()):
            assert p.grad is not None and p.grad.data_ptr() == p.main_grad.data_ptr(), (
                f"{n}: param.grad must show the reduced main_grad view itself"
            )
            assert_close(p.main_grad, q.grad, n, GRAD_REL)
    ours.remove_hooks()


@case(2, 3)
def case_grads_match_torch_ddp_overlap(rank, ws):
    grads_match_torch_ddp(overlap=True)


@case(2)
def case_grads_match_torch_ddp_no_overlap(rank, ws):
    grads_match_torch_ddp(overlap=False)


def compiled_gpt_launch_order(rank: int, ws: int) -> None:
    """Per-block ``torch.compile`` (torchtitan style) keeps the overlap: in a learned step,
    bucket all-reduces launch while earlier blocks' backward has yet to start, and the
    gradients equal one process's on the global batch. The bf16 forward has no graph break."""
    from aligndp.models.gpt import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=32, seq_len=8, dim=32, num_layers=4, head_dim=16)
    torch.manual_seed(0)
    ours = DataParallel(GPT(cfg), config=DDPConfig(bucket_numel=13_000))
    torch.manual_seed(0)
    ref = GPT(cfg)
    blocks = ours.module.blocks
    assert len(ours.bucket_refs) >= 4, "the test needs about one bucket per block"
    events: list[tuple[str, int]] = []
    reduce = ours.collectives.all_reduce_mean

    def launch(grad):
        events.append(("launch", len(events)))
        return reduce(grad)

    ours.collectives.all_reduce_mean = launch

    def note_backward_start(i: int, out: torch.Tensor) -> None:
        out.register_hook(lambda g: events.append(("block", i)))  # block i's backward begins

    for i, block in enumerate(blocks):
        compiled = torch.compile(block, backend="aot_eager")
        compiled.register_forward_hook(lambda _m, _a, out, i=i: note_backward_start(i, out))
        blocks.register_module(str(i), compiled)
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, cfg.vocab_size, (2 * ws, cfg.seq_len), generator=g)
    mine = idx[rank * 2 : rank * 2 + 2]
    for _step in range(2):  # step 0 learns readiness; step 1 overlaps
        ours.zero_grad_buffer()
        events.clear()
        ours(mine, mine).backward()
    first_block = events.index(("block", 0))
    early = [e for e in events[:first_block] if e[0] == "launch"]
    assert early, f"no bucket launched before block 0's backward began: {events}"
    ref(idx, idx).backward()
    # one process sums the global batch's token rows (and the blocks' inner dims) in another
    # order, and aot_eager may reorder the forward's sums
    rel = order_tolerance(terms=2 * ws * cfg.seq_len * cfg.dim)
    for (n, p), q in zip(ours.module.named_parameters(), ref.parameters()):
        assert_close(p.grad, q.grad, n, rel)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        explained = torch._dynamo.explain(ours)(mine, mine)
    assert explained.graph_count >= 1 and explained.graph_break_count == 0, explained.break_reasons
    ours.remove_hooks()
    torch._dynamo.reset()


@case(2)
def case_direct_path_backward_copies_no_gradient(rank, ws):
    """[Note: gradient as bucket view] and [Note: one copy per bucket]: with fp32 params and
    fp32 grad buffers a synchronised backward issues no more per-param copies or adds than
    plain torch's (whose AccumulateGrad steals the fresh gradient): the first backward adds
    into armed views, later ones keep the stolen gradients and copy each bucket's in one
    ``_foreach_copy_`` at its launch, and an accumulating backward adds into the views; the
    reduced grads still equal torch DDP's."""
    from torch.profiler import ProfilerActivity, profile

    def ops_in_backward(model, idx, tgt) -> tuple[int, int, int]:
        """(tensor copies, in-place adds, both outside a ``_foreach_copy_``, and
        ``_foreach_copy_`` calls)."""
        loss = loss_of(model, idx, tgt)
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            loss.backward()

        def in_foreach(e) -> bool:
            while e is not None:
                if e.name == "aten::_foreach_copy_":
                    return True
                e = e.cpu_parent
            return False

        # the end-of-backward agreement builds its flags from 0-dim scalars: not counted
        def count(name: str) -> int:
            return sum(
                1
                for e in prof.events()
                if e.name == name and e.input_shapes[0] and not in_foreach(e)
            )

        foreach = sum(1 for e in prof.events() if e.name == "aten::_foreach_copy_")
        return count("aten::copy_"), count("aten::add_"), foreach

    ours = DataParallel(make_net(), config=DDPConfig(bucket_numel=200))
    # without overlap no round defers: every step adds into armed views, zeroed by zero_grad
    armed = DataParallel(make_net(), config=DDPConfig(bucket_numel=200, overlap=False))
    theirs = nn.parallel.DistributedDataParallel(make_net(), bucket_cap_mb=0.001)
    plain = make_net()
    buckets = len(ours.reducer.buckets)
    assert buckets > 1
    for step in range(4):
        idx, tgt = batch(step, rank, ws)
        if step != 2:  # step 2 accumulates onto step 1's gradients
            ours.zero_grad_buffer()
            armed.zero_grad_buffer()
            theirs.zero_grad()
            plain.zero_grad()
        loss_of(armed, idx, tgt).backward()
        plain_copies, plain_adds, _ = ops_in_backward(plain, idx, tgt)
        copies, adds, foreach = ops_in_backward(ours, idx, tgt)
        assert copies <= plain_copies, f"step {step}: {copies} copies, plain torch {plain_copies}"
        if step in (1, 3):  # hinted rounds: stolen gradients, one copy per bucket
            assert adds <= plain_adds, f"step {step}: {adds} adds, plain torch {plain_adds}"
            assert foreach == buckets, (step, foreach, buckets)
        else:  # the first backward (no hints) adds into armed views, step 2 onto reduced ones
            assert foreach == 0, (step, foreach)
        loss_of(theirs, idx, tgt).backward()
        for model in (ours, armed):
            for (n, p), q in zip(model.module.named_parameters(), theirs.module.parameters()):
                assert p.grad is p.main_grad or p.grad.data_ptr() == p.main_grad.data_ptr(), n
                assert_close(p.grad, q.grad, f"step {step} {n}", GRAD_REL)
    ours.remove_hooks()
    armed.remove_hooks()


@case(2)
def case_per_block_compile_keeps_the_overlap(rank, ws):
    compiled_gpt_launch_order(rank, ws)


@case(2, 3)
def case_grads_match_single_process_global_batch(rank, ws):
    ours = DataParallel(make_net(), config=DDPConfig(bucket_numel=300))
    loss_of(ours, *batch(0, rank, ws)).backward()
    ours.finish_grad_sync()
    ref = reference_grads()
    for n, p in ours.module.named_parameters():
        assert_close(p.main_grad, ref[n], n, GRAD_REL)


@case(2, 3)
def case_no_sync_four_micro_batches(rank, ws):
    """4 micro-batches per rank, the first 3 under no_sync, equal one process on the global
    batch."""
    ours = DataParallel(make_net(), config=DDPConfig(bucket_numel=250))
    idx, tgt = batch(0, rank, ws)
    # split the 5 tokens of every row: equal micro-batch counts on every world size
    chunks = [
        (idx[:, :2], tgt[:, :2]),
        (idx[:, 2:3], tgt[:, 2:3]),
        (idx[:, 3:4], tgt[:, 3:4]),
        (idx[:, 4:], tgt[:, 4:]),
    ]
    weights = [2 / 5, 1 / 5, 1 / 5, 1 / 5]  # token share of each micro-batch
    for i, ((x, y), w) in enumerate(zip(chunks, weights)):
        if i < 3:
            with ours.no_sync():
                (w * loss_of(ours, x, y)).backward()
            assert ours.state.value == "accumulating" and ours.last_round is None, (
                "no reduction may run under no_sync"
            )
        else:
            (w * loss_of(ours, x, y)).backward()
    ours.finish_grad_sync()
    ref = reference_grads()
    for n, p in ours.module.named_parameters():
        assert_close(p.main_grad, ref[n], n, GRAD_REL)


@case(2)
def case_unused_param_after_zero_grad_reads_zero(rank, ws):
    """[Note: lazy zeroing]: a param without a gradient this step must reduce to zero, not to
    last step's value — where zero_grad zeroes the buffer (fp32 grads of fp32 params) and where
    the view is zeroed lazily (an fp64 grad buffer: [Note: gradient as bucket view] does not
    apply)."""
    for grad_dtype in (None, torch.float64):
        ours = DataParallel(make_net(), config=DDPConfig(bucket_numel=200, grad_dtype=grad_dtype))
        loss_of(ours, *batch(0, rank, ws)).backward()
        ours.finish_grad_sync()
        assert ours.module.mix.weight.main_grad.abs().sum() > 0
        ours.zero_grad_buffer()
        idx, tgt = batch(1, rank, ws)
        F.cross_entropy(ours(idx, skip_mix=True).reshape(-1, VOCAB), tgt.reshape(-1)).backward()
        ours.finish_grad_sync()
        assert ours.module.mix.weight.main_grad.abs().sum() == 0, grad_dtype
        assert ours.module.mix.bias.main_grad.abs().sum() == 0, grad_dtype
        net = make_net()
        F.cross_entropy(
            net(*batch(1)[:1], skip_mix=True).reshape(-1, VOCAB), batch(1)[1].reshape(-1)
        ).backward()
        main_grad = ours.module.fc1.weight.main_grad.float()
        assert_close(main_grad, net.fc1.weight.grad, f"fc1.weight {grad_dtype}", GRAD_REL)
        ours.remove_hooks()


@case(2)
def case_reduced_grads_view_holds_owned_slices_and_goes_stale(rank, ws):
    """[Note: reduced grads view]: finish_grad_sync() returns one read-only view: each param's
    owned elements are the one-process global-batch gradient cut at this rank's piece (all of
    it when replicated), a param no rank used has none, and once the epoch moves (zero_grad,
    a new reduction, a forward that reopens) every read raises."""
    sharded = {n: Mode.SHARDED for n, _ in make_net().named_parameters() if n.startswith("fc")}
    ours = DataParallel(make_net(), config=DDPConfig(bucket_numel=200), modes=sharded)
    assert any(s.owned is not None and 0 < s.owned.numel for s in ours.index.slots.values())
    idx, tgt = batch(1, rank, ws)
    F.cross_entropy(ours(idx, skip_mix=True).reshape(-1, VOCAB), tgt.reshape(-1)).backward()
    grads = ours.finish_grad_sync()
    assert ours.finish_grad_sync() is grads, "a second call reduces nothing: the same view"
    net = make_net()
    F.cross_entropy(
        net(batch(1)[0], skip_mix=True).reshape(-1, VOCAB), batch(1)[1].reshape(-1)
    ).backward()
    ref = dict(net.named_parameters())
    for n, p in ours.module.named_parameters():
        if n.startswith("mix"):
            assert not grads.has_grad(p), n
            continue
        assert grads.has_grad(p), n
        piece = ours.index.slots[p].owned
        lo, hi = (0, p.numel()) if piece is None else (piece.lo, piece.hi)
        assert_close(grads.owned(p), ref[n].grad.reshape(-1)[lo:hi], n, GRAD_REL)
    weight = ours.module.fc1.weight
    ours.zero_grad()
    for read in (grads.has_grad, grads.view, grads.owned):
        with pytest.raises(RuntimeError, match="stale"):
            read(weight)
    loss_of(ours, *batch(0, rank, ws)).backward()
    fresh = ours.finish_grad_sync()
    assert all(fresh.has_grad(p) for p in ours.module.parameters())
    ours(idx)  # a forward with grad reopens the reduced buffers
    with pytest.raises(RuntimeError, match="stale"):
        fresh.owned(weight)
    ours.remove_hooks()


@case(2)
def case_frozen_params_excluded(rank, ws):
    ours = DataParallel(make_net(frozen=True), config=DDPConfig(bucket_numel=200))
    names = {p.name for layout in ours.layouts for p in layout.params}
    assert "fc1.weight" not in names and "fc1.bias" not in names
    assert not hasattr(ours.module.fc1.weight, "main_grad")
    loss_of(ours, *batch(0, rank, ws)).backward()
    ours.finish_grad_sync()
    assert ours.module.fc1.weight.grad is None
    ref = reference_grads(frozen=True)
    for n, p in ours.module.named_parameters():
        if p.requires_grad:
            assert_close(p.main_grad, ref[n], n, GRAD_REL)


@case(2, 3)
def case_adamw_three_steps_identical_replicas_and_single_process(rank, ws):
    model, opt = aligndp.parallelize(make_net(), lr=1e-2, bucket_numel=200)
    ref = make_net()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(3):
        loss_of(model, *batch(step, rank, ws)).backward()
        opt.step()
        opt.zero_grad()
        loss_of(ref, *batch(step)).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        flat = torch.cat([p.detach().reshape(-1) for p in model.module.parameters()])
        gathered = [torch.empty_like(flat) for _ in range(ws)]
        dist.all_gather(gathered, flat)
        for other in gathered[1:]:
            assert torch.equal(other, gathered[0]), "replicas differ"
        for (n, p), q in zip(model.module.named_parameters(), ref.parameters()):
            assert_close(p, q, f"step {step} {n}", ADAMW_REL)


@case(2)
def case_lr_scheduler_and_clipping(rank, ws):
    model, opt = aligndp.parallelize(make_net(), lr=0.1, max_grad_norm=0.05, optimizer="sgd")
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    ref = make_net()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=1, gamma=0.5)
    for step in range(3):
        loss_of(model, *batch(step, rank, ws)).backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        loss_of(ref, *batch(step)).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        ref_opt.step()
        ref_sched.step()
        ref_opt.zero_grad()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**3)
    for (n, p), q in zip(model.module.named_parameters(), ref.parameters()):
        assert_close(p, q, n, SGD_REL)


@case(2)
def case_lr_edits_reach_the_inner_optimizers_after_a_checkpoint_load(rank, ws):
    """Regression: Optimizer.load_state_dict replaces an inner optimizer's group dicts; a
    param_groups list captured at construction then pointed at dead dicts and an lr set
    through opt.param_groups after a resume was silently ignored (seen as a resumed
    `aligndp train` diverging from the uninterrupted run at the first step after resume)."""
    import tempfile

    for sharding in ("none", "zero1"):
        model, opt = aligndp.parallelize(make_net(), lr=1e-2, sharding=sharding)
        loss_of(model, *batch(0, rank, ws)).backward()
        opt.step()
        opt.zero_grad()
        path = tempfile.gettempdir() + f"/aligndp_lr_regression_{sharding}"
        obj = [path]
        dist.broadcast_object_list(obj)
        aligndp.save(obj[0], model, opt, step=1)
        aligndp.load(obj[0], model, opt)
        for group in opt.param_groups:
            group["lr"] = 0.0
        assert all(g["lr"] == 0.0 for inner in opt.inner for g in inner.param_groups)
        before = [p.detach().clone() for p in model.module.parameters()]
        loss_of(model, *batch(1, rank, ws)).backward()
        opt.step()
        for (n, p), b in zip(model.module.named_parameters(), before):
            assert torch.equal(p.detach(), b), f"{sharding}: {n} moved with lr=0 after a load"


@case(2)
def case_bf16_params_fp32_grad_buffer(rank, ws):
    net = make_net().to(torch.bfloat16)
    ours = DataParallel(net, config=DDPConfig(grad_dtype=torch.float32, bucket_numel=200))
    assert all(layout.grad_dtype == torch.float32 for layout in ours.layouts)
    for buf in ours.flat_buffers:
        for g in buf.main_grads:
            assert g.dtype == torch.float32 and g.data_ptr() % 256 == 0
    idx, tgt = batch(0, rank, ws)
    loss_of(ours, idx, tgt).backward()
    ours.finish_grad_sync()
    ref = make_net().to(torch.bfloat16)
    loss_of(ref, *batch(0)).backward()
    for (n, p), q in zip(ours.module.named_parameters(), ref.parameters()):
        assert_close(p.main_grad, q.grad.float(), n, BF16_GRAD_REL)


@case(2)
def case_bad_input(rank, ws):
    with pytest.raises(RuntimeError, match="no trainable params"):  # torch DDP's type
        DataParallel(nn.Sequential(nn.ReLU()))
    with pytest.raises(RuntimeError, match="no trainable params"):
        DataParallel(make_net().requires_grad_(False))
    two = make_net()
    two.head = nn.Linear(11, VOCAB, bias=False, device="meta")
    with pytest.raises(ValueError, match="devices"):
        DataParallel(two)
    with pytest.raises(TypeError):
        DataParallel(lambda x: x)
    with pytest.raises(ValueError, match="bucket_numel"):
        DDPConfig(bucket_numel=0)
    with pytest.raises(ValueError, match="power of two"):
        DataParallel(make_net(), config=DDPConfig(start_alignment=48))
    with pytest.raises(ValueError, match="sharding"):
        aligndp.parallelize(make_net(), sharding="zero3")
    with pytest.raises(ValueError, match="optimizer"):
        aligndp.parallelize(make_net(), optimizer="lion")


# ---- guards against breaks that once passed the whole suite (issue 16) ----


class LaunchCounting(TorchCollectives):
    """Records every collective launched through the collectives seam (the buckets' mean
    reductions and gathers, and the blocking sums of the agreement)."""

    name = "launch-counting"

    def __init__(self, group) -> None:
        super().__init__(group)
        self.calls: list[str] = []

    def all_reduce_mean(self, bucket):
        self.calls.append("all_reduce_mean")
        return super().all_reduce_mean(bucket)

    def reduce_scatter_mean(self, bucket):
        self.calls.append("reduce_scatter_mean")
        return super().reduce_scatter_mean(bucket)

    def all_gather_shards(self, bucket):
        self.calls.append("all_gather_shards")
        return super().all_gather_shards(bucket)

    def all_reduce_sum(self, tensor):
        self.calls.append("all_reduce_sum(blocking)")
        super().all_reduce_sum(tensor)


register_collectives("launch-counting", LaunchCounting)


def micro_batches(step: int, rank: int, ws: int) -> list[tuple[torch.Tensor, torch.Tensor, float]]:
    """This rank's share of step's global batch as 3 micro-batches split along tokens:
    (x, y, weight)."""
    idx, tgt = batch(step, rank, ws)
    return [
        (idx[:, :2], tgt[:, :2], 2 / 5),
        (idx[:, 2:4], tgt[:, 2:4], 2 / 5),
        (idx[:, 4:], tgt[:, 4:], 1 / 5),
    ]


@case(2)
def case_no_sync_after_readiness_is_learned_launches_nothing(rank, ws):
    """Regression (issue 16): the only no_sync assertion ran on step 0, before readiness is
    learned, when nothing can launch anyway, so a no_sync() that kept synchronising passed.
    Here step 0 (1 micro-batch) learns readiness and step 1 runs 3 micro-batches, 2 under
    no_sync. Reference: torch DDP on the same schedule, whose comm hook counts its bucket
    collectives: none inside no_sync, and the accumulated grads reduced once after."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    ours = DataParallel(
        make_net(), config=DDPConfig(bucket_numel=200, collectives="launch-counting")
    )
    calls = ours.collectives.calls
    theirs = nn.parallel.DistributedDataParallel(make_net(), bucket_cap_mb=0.001)
    their_calls = [0]

    def hook(state, bucket):
        their_calls[0] += 1
        return allreduce_hook(state, bucket)

    theirs.register_comm_hook(None, hook)
    num_buckets = len(ours.bucket_refs)
    assert num_buckets > 2, "the test needs several buckets"
    loss_of(ours, *batch(0, rank, ws)).backward()
    ours.finish_grad_sync()
    loss_of(theirs, *batch(0, rank, ws)).backward()
    ours.zero_grad_buffer()
    theirs.zero_grad()
    *accumulated, (x, y, w) = micro_batches(1, rank, ws)
    for i, (xa, ya, wa) in enumerate(accumulated):
        before = their_calls[0]
        with theirs.no_sync():
            (wa * loss_of(theirs, xa, ya)).backward()
        assert their_calls[0] == before, (
            "reference check: torch DDP launches nothing inside no_sync"
        )
        calls.clear()
        with ours.no_sync():
            (wa * loss_of(ours, xa, ya)).backward()
        assert not calls, (
            f"micro-batch {i} under no_sync launched collectives after readiness was learned: "
            f"{calls}"
        )
    (w * loss_of(theirs, x, y)).backward()
    assert their_calls[0] > 0
    calls.clear()
    (w * loss_of(ours, x, y)).backward()
    ours.finish_grad_sync()
    bucket_calls = [c for c in calls if not c.endswith("(blocking)")]
    assert len(bucket_calls) == num_buckets, (
        f"{len(bucket_calls)} collectives for {num_buckets} buckets: {calls}"
    )
    assert calls.count("all_reduce_sum(blocking)") == 1, (
        f"one agreement all-reduce per reduction: {calls}"
    )
    for (n, p), q in zip(ours.module.named_parameters(), theirs.module.parameters()):
        assert_close(p.main_grad, q.grad, f"step 1 {n}", GRAD_REL)
    ours.remove_hooks()


@case(2)
def case_check_finite_names_the_param_for_nan_and_both_infinities(rank, ws):
    """Regression (issue 16): check_finite was tested with NaN only and a match on
    "non-finite", so a check that misses +-inf, or a message without the param, passed. Each
    run poisons one element of one param's gradient (the same on every rank)."""
    for value, name in [
        (math.inf, "fc2.bias"),
        (-math.inf, "mix.weight"),
        (math.nan, "emb.weight"),
    ]:
        ours = DataParallel(make_net(), config=DDPConfig(check_finite=True, bucket_numel=200))
        param = dict(ours.module.named_parameters())[name]
        poison = param.register_hook(
            lambda g, v=value: g.flatten().index_fill(0, torch.tensor([3]), v).view_as(g)
        )
        with pytest.raises(FloatingPointError, match=re.escape(repr(name))) as error:
            loss_of(ours, *batch(0, rank, ws)).backward()
            ours.finish_grad_sync()
        assert "non-finite" in str(error.value) and f"rank {rank}" in str(error.value), str(
            error.value
        )
        poison.remove()
        ours.remove_hooks()
    clean = DataParallel(make_net(), config=DDPConfig(check_finite=True, bucket_numel=200))
    loss_of(clean, *batch(0, rank, ws)).backward()
    clean.finish_grad_sync()  # finite grads pass
    clean.remove_hooks()


@case(2, 3)
def case_wrap_broadcasts_rank0_params_and_buffers(rank, ws):
    """Regression (issue 16): every other test seeds every rank alike, so a wrapper that never
    broadcast rank 0's state passed. Ranks start from different seeds here; after wrapping,
    params and buffers must be rank 0's initial values, as torch DDP makes them."""
    torch.manual_seed(100)
    expected = NetWithBuffers()
    wraps = {
        "torch DDP (reference)": lambda net: nn.parallel.DistributedDataParallel(net).module,
        "DataParallel": lambda net: DataParallel(net, config=DDPConfig(bucket_numel=200)).module,
        "sgd none": lambda net: (
            aligndp.parallelize(net, optimizer="sgd", bucket_numel=200)[0].module
        ),
        "adamw zero1": lambda net: (
            aligndp.parallelize(net, sharding="zero1", bucket_numel=200)[0].module
        ),
        "muon zero1": lambda net: (
            aligndp.parallelize(net, optimizer="muon", sharding="zero1")[0].module
        ),
    }
    for what, wrap in wraps.items():
        torch.manual_seed(100 + rank)
        module = wrap(NetWithBuffers())
        theirs = dict(expected.named_parameters()) | dict(expected.named_buffers())
        ours = dict(module.named_parameters()) | dict(module.named_buffers())
        assert ours.keys() == theirs.keys()
        differ = [n for n, t in ours.items() if not torch.equal(t.detach(), theirs[n])]
        every: list[list[str]] = [None] * ws  # type: ignore[list-item]
        dist.all_gather_object(
            every, differ
        )  # fail on every rank at once: no rank left in a collective
        assert not any(every), f"{what}: not rank 0's values after wrapping, per rank: {every}"


def run_sgd_against_one_process(
    rank, ws, *, sharding: str, max_grad_norm: float | None, steps: int = 4
):
    """parallelize(optimizer="sgd") with several buckets against one-process torch SGD on the
    global batch: plain SGD moves params by lr * grad, so a gradient of the wrong scale (sum
    instead of mean, a bucket not reduced) shows in the params. Returns the reference norms."""
    model, opt = aligndp.parallelize(
        make_net(),
        optimizer="sgd",
        sharding=sharding,
        lr=0.5,
        bucket_numel=200,
        max_grad_norm=max_grad_norm,
    )
    assert sum(len(layout.buckets) for layout in model.layouts) > 2, (
        "the test needs several buckets"
    )
    ref = make_net()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    syncs = []  # issue 22: step() finished the gradient sync up to three times (clip, bind)
    reducer = model.reducer  # the step window (reducer.update()) syncs through it
    reducer.finish_grad_sync = lambda sync=reducer.finish_grad_sync: syncs.append(1) or sync()
    norms = []
    for step in range(steps):
        loss_of(model, *batch(step, rank, ws)).backward()
        syncs.clear()
        opt.step()
        assert len(syncs) == 1, f"step() finished the gradient sync {len(syncs)} times, not once"
        opt.zero_grad()
        loss_of(ref, *batch(step)).backward()
        norms.append(
            float(torch.nn.utils.clip_grad_norm_(ref.parameters(), max_grad_norm or math.inf))
        )
        ref_opt.step()
        ref_opt.zero_grad()
        for (n, p), q in zip(model.module.named_parameters(), ref.parameters()):
            assert_close(p, q, f"{sharding} clip {max_grad_norm} step {step} {n}", SGD_REL)
    return norms


@case(2, 3)
def case_sgd_several_buckets_matches_one_process(rank, ws):
    for sharding in ("none", "zero1"):
        run_sgd_against_one_process(rank, ws, sharding=sharding, max_grad_norm=None)


@case(2)
def case_clipping_on_some_steps_only_matches_one_process(rank, ws):
    """Clipping on every step normalises the gradient and hides its scale; here the threshold
    lies between the steps' norms, so some steps are clipped and some are not."""
    for sharding in ("none", "zero1"):
        norms = run_sgd_against_one_process(rank, ws, sharding=sharding, max_grad_norm=0.245)
        assert min(norms) < 0.245 < max(norms), f"the threshold must split the steps: norms {norms}"


make_tests(globals())


def test_nonfinite_counts_match_per_param_counts():
    """check_finite counts per param from one pass over the bucket (step_agreement.py); the
    reference counts each param's slice on its own. Spans of zero length, at the bucket's
    ends, and NaN / +Inf / -Inf at span edges included."""
    from aligndp.runtime.step_agreement import nonfinite_counts

    g = torch.Generator().manual_seed(0)
    for trial in range(200):
        numel = int(torch.randint(1, 60, (1,), generator=g))
        bucket = torch.randn(numel, generator=g)
        kind = torch.randint(0, 8, (numel,), generator=g)
        bucket[kind == 0] = float("nan")
        bucket[kind == 1] = float("inf")
        bucket[kind == 2] = float("-inf")
        cuts = torch.randint(0, numel + 1, (6,), generator=g).sort().values.tolist()
        spans = list(zip(cuts[:-1], cuts[1:])) + [(0, numel), (0, 0), (numel, numel)]
        starts = torch.tensor([a for a, _ in spans])
        ends = torch.tensor([b for _, b in spans])
        got = nonfinite_counts(bucket, starts=starts, ends=ends).tolist()
        expected = [int((~torch.isfinite(bucket[a:b])).sum()) for a, b in spans]
        assert got == expected, (trial, spans, got, expected)
