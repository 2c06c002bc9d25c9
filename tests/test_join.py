"""Uneven inputs under torch's ``Join`` (issue 42, item 3; [Note: join] in runtime/join.py).

Ranks get different numbers of batches (rank r: ``BATCHES[r]``); aligndp trains on under
``Join([model, opt])`` or ``model.join()`` as torch DDP does under ``Join([ddp])`` with the same
data and torch's AdamW: the params after the join are the reference's on every rank, in
``"none"``, ``"zero1"`` and layer-wise Muon. Each case builds its model on a group of its own
with a short timeout, so a shadow that leaves the ranks' collectives out of step fails fast.
"""

from __future__ import annotations

import dataclasses
import datetime

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.join import Join
from torch.distributed.optim import ZeroRedundancyOptimizer

import aligndp
from aligndp.optim.muon import FLOPS_SPLIT
from tests._dist import case, make_tests
from tests._habits_models import (
    LR,
    MODES,
    REL,
    BatchNormNet,
    Net,
    TorchDDP,
    assert_params_match,
    backward_on,
    newton_schulz_fp32,
    seeded,
    wrap,
)
from tests.models import batch

FORCED = dataclasses.replace(FLOPS_SPLIT, min_cols=1, col_multiple=1, min_part_cost=0, budget=1.0)
"""Every matrix split (tests/test_muon.py's FORCED)."""
BATCHES = (3, 1, 2)
"""Batches per rank: rank 1 runs out first, rank 0 trains longest."""


def assert_synced(module: nn.Module, what: str) -> None:
    """Params and buffers equal rank 0's bit for bit on every rank, checked on every rank alike
    (all of them take part and fail together, so none waits in the next collective for one
    that failed): the join's final sync broadcasts them from the last joiner."""
    flat = torch.cat(
        [t.detach().double().reshape(-1) for t in [*module.parameters(), *module.buffers()]]
    )
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    differ = [r for r, g in enumerate(gathered) if not torch.equal(g, gathered[0])]
    assert not differ, (
        f"{what}: ranks {differ} hold other params or buffers than rank 0 after the join: its "
        "final sync (params and buffers from the last joiner) did not reach every rank"
    )


def _group() -> dist.ProcessGroup:
    return dist.new_group(
        list(range(dist.get_world_size())), timeout=datetime.timedelta(seconds=20)
    )


def _train(model, opt, rank: int, ws: int, batches: int, *, join) -> None:
    """``batches`` steps of ``rank``'s data inside ``join`` (a context manager)."""
    with join:
        for step in range(batches):
            backward_on(model, step, rank, ws)
            opt.step()
            opt.zero_grad()


def _reference(mode: str, rank: int, ws: int, *, divide: bool = True) -> nn.Module:
    """torch DDP + Join (torch's AdamW, or Muon + AdamW) over the same uneven batches."""
    ref = TorchDDP(seeded(Net), mode)
    with newton_schulz_fp32(mode):
        _train(
            ref.model,
            ref,
            rank,
            ws,
            BATCHES[rank],
            join=Join([ref.model], divide_by_initial_world_size=divide),
        )
    return ref.module


def _uneven(rank: int, ws: int, mode: str, how: str, *, divide: bool = True, **kwargs) -> None:
    model, opt = wrap(seeded(Net), mode, process_group=_group(), **kwargs)
    if "split" in kwargs:
        assert any(p.split for layout in model.layouts for p in layout.params), "nothing split"
    if how == "model.join()":
        join = model.join(divide_by_initial_world_size=divide)
    else:
        join = Join([model, opt], divide_by_initial_world_size=divide)
    with newton_schulz_fp32(mode):
        _train(model, opt, rank, ws, BATCHES[rank], join=join)
    what = f"{mode}, {how}, divide_by_initial_world_size={divide}"
    assert_synced(model.module, what)
    assert_params_match(model.module, _reference(mode, rank, ws, divide=divide), what, REL)


@case(2, 3)
def case_uneven_inputs_train_on_like_torch_ddp_under_join(rank, ws):
    """Ports of torch's ``test_ddp_uneven_inputs`` in aligndp's modes, both ways of joining."""
    for mode in ("none", "zero1"):
        for how in ("model.join()", "Join([model, opt])"):
            _uneven(rank, ws, mode, how)


@case(2, 3)
def case_divide_by_the_active_ranks(rank, ws):
    """``divide_by_initial_world_size=False``: the ranks still active divide the sum (torch's
    count of non-joined ranks), not the group size."""
    for mode in ("none", "zero1"):
        _uneven(rank, ws, mode, "model.join()", divide=False)
    _uneven(rank, ws, "zero1", "Join([model, opt])", divide=False)


@case(2, 3)
def case_layerwise_muon_trains_on(rank, ws):
    """Layer-wise Muon in both shardings: the joined rank steps its matrices on the reduced
    gradients, and runs the split Newton-Schulz collectives with the others where a matrix's
    step is shared (every matrix split over as many ranks as it has rows)."""
    for mode in ("muon none", "muon zero1"):
        _uneven(rank, ws, mode, "model.join()")
    _uneven(rank, ws, "muon zero1", "Join([model, opt])", split=FORCED)


@case(2)
def case_buffers_come_from_an_active_rank(rank, ws):
    """BatchNorm's running stats: broadcast at each forward from an active rank (rank 0 stays
    active longest here, rank 1 joins first), then from the last joiner at the end, as torch
    DDP's join hook does."""
    counts = (1, 3)  # rank 0 runs out first: the buffers must not come from it afterwards

    def run(model, opt, join):
        with join:
            for step in range(counts[rank]):
                backward_on(model, step, rank, ws)
                opt.step()
                opt.zero_grad()

    for mode in ("none", "zero1"):
        model, opt = aligndp.parallelize(
            seeded(BatchNormNet), **MODES[mode], lr=LR, process_group=_group()
        )
        run(model, opt, model.join())
        assert_synced(model.module, f"{mode} BatchNorm under join")
        ref = nn.parallel.DistributedDataParallel(seeded(BatchNormNet))
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
        run(ref, ref_opt, Join([ref]))
        assert_params_match(model.module, ref.module, f"{mode} BatchNorm under join", REL)
        for (name, ours), theirs in zip(model.module.named_buffers(), ref.module.buffers()):
            assert torch.allclose(ours.float(), theirs.float()), (mode, name, ours, theirs)


@case(2, 3)
def case_torch_optimizer_params_come_from_the_last_joiner(rank, ws):
    """A bare ``DataParallel`` stepped by a torch optimizer (nothing steps on a joined rank, as
    with torch DDP): the join's end broadcasts params and buffers from the last joiner, so
    every rank ends with torch DDP + Join's params."""
    model = aligndp.DataParallel(
        seeded(Net), process_group=_group(), config=aligndp.DDPConfig(bucket_numel=150)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    _train(model, opt, rank, ws, BATCHES[rank], join=model.join())
    assert_synced(model.module, "torch AdamW over DataParallel")
    what = "torch AdamW over DataParallel under join"
    assert_params_match(model.module, _reference("none", rank, ws), what, REL)


@case(2)
def case_no_sync_micro_batches_inside_join(rank, ws):
    """Micro-batches under ``no_sync`` then one synchronised backward per step: the joined rank
    shadows only the synchronised one (the forward's sum says which)."""
    for mode in ("none", "zero1"):
        model, opt = wrap(seeded(Net), mode, process_group=_group())
        ref = TorchDDP(seeded(Net), mode)
        for m, o in ((model, opt), (ref.model, ref)):
            with Join([m]):
                for step in range(BATCHES[rank]):
                    with m.no_sync():
                        backward_on(m, 10 + step, rank, ws)
                    backward_on(m, step, rank, ws)
                    o.step()
                    o.zero_grad()
        assert_synced(model.module, f"{mode} no_sync under join")
        assert_params_match(model.module, ref.module, f"{mode} no_sync under join", REL)


@case(2)
def case_enable_false_is_no_join(rank, ws):
    """``join(enable=False)`` changes nothing: even inputs train as torch DDP does without Join."""
    for mode in ("none", "zero1"):
        model, opt = wrap(seeded(Net), mode, process_group=_group())
        ref = TorchDDP(seeded(Net), mode)
        _train(model, opt, rank, ws, 2, join=model.join(enable=False))
        _train(ref.model, ref, rank, ws, 2, join=ref.model.join(enable=False))
        assert_params_match(model.module, ref.module, f"{mode} join(enable=False)", REL)


@case(2, 3)
def case_throw_on_early_termination_raises_on_every_rank(rank, ws):
    """torch's ``throw_on_early_termination=True``: once a rank runs out, every rank raises
    torch's RuntimeError (the joined rank "exhausted all inputs", the others "Detected at
    least one rank that exhausted inputs"), and the group is still in step afterwards."""
    for mode in ("none", "zero1"):
        group = _group()
        model, opt = wrap(seeded(Net), mode, process_group=group)
        with pytest.raises(RuntimeError, match="exhausted"):
            _train(
                model,
                opt,
                rank,
                ws,
                BATCHES[rank],
                join=model.join(throw_on_early_termination=True),
            )
        dist.barrier(group=group)


@case(2)
def case_refusals_name_the_alternative_on_every_rank(rank, ws):
    """What cannot join is refused at once on every rank, with torch's error types: a
    replicate x shard mesh and an FP8 param gather (RuntimeError naming
    ``DistributedSampler(drop_last=True)``), the model after another joinable or the optimizer
    alone (ValueError: put the model first), a user's norm inside a Join (RuntimeError naming
    ``max_grad_norm=``), a keyword that is not a bool (TypeError)."""
    mesh = aligndp.replica_mesh(2, "cpu")
    model, opt = wrap(seeded(Net), "zero1", mesh=mesh)
    with pytest.raises(RuntimeError, match=r"replicate x shard mesh.*drop_last=True"):
        model.join()
    with pytest.raises(RuntimeError, match=r"replicate x shard mesh.*drop_last=True"):
        with Join([model, opt]):
            backward_on(model, 0, rank, ws)
    from tests.test_fp8_param_gather import wrap as fp8_wrap

    model, opt = fp8_wrap("adamw")
    with pytest.raises(RuntimeError, match=r"FP8 param gather.*drop_last=True"):
        model.join()
    model, opt = wrap(seeded(Net), "zero1", process_group=_group())
    with pytest.raises(ValueError, match=r"put the model first: Join\(\[model, opt\]\)"):
        with Join([opt, model]):
            backward_on(model, 0, rank, ws)
    with pytest.raises(ValueError, match=r"put the model first"):
        with Join([opt]):
            backward_on(model, 0, rank, ws)
            opt.step()
    opt.zero_grad()
    for read in ("clip_grad_norm_", "grad_norm"):
        with pytest.raises(RuntimeError, match="max_grad_norm="):
            with model.join():
                backward_on(model, 0, rank, ws)
                getattr(opt, read)(*((1.0,) if read == "clip_grad_norm_" else ()))
        opt.zero_grad()
    with pytest.raises(TypeError, match="divide_by_initial_world_size"):
        model.join(divide_by_initial_world_size=1)
    _train(model, opt, rank, ws, BATCHES[rank], join=model.join())  # still trains on after


@case(2)
def case_max_grad_norm_clips_on_every_rank_inside_join(rank, ws):
    """``max_grad_norm=`` (the optimizer's clipping) runs its all-reduce on the joined rank too:
    torch DDP + Join with ``clip_grad_norm_`` on the active ranks is the reference."""
    for mode in ("none", "zero1"):
        model, opt = wrap(seeded(Net), mode, process_group=_group(), max_grad_norm=0.05)
        _train(model, opt, rank, ws, BATCHES[rank], join=model.join())
        assert_synced(model.module, f"{mode} max_grad_norm under join")
        ref = TorchDDP(seeded(Net), mode)
        with Join([ref.model]):
            for step in range(BATCHES[rank]):
                backward_on(ref.model, step, rank, ws)
                torch.nn.utils.clip_grad_norm_(ref.module.parameters(), 0.05)
                ref.step()
                ref.zero_grad()
        assert_params_match(model.module, ref.module, f"{mode} max_grad_norm under join", REL)


@case(
    2,
    xfail="torch's ZeroRedundancyOptimizer under Join steps a joined rank's shard on "
    "the gradients it no longer has (DDP's shadow all-reduce discards its result), so that "
    "shard stops training; aligndp's zero1 trains it as DDP + AdamW does",
)
def case_zero1_matches_torch_zero_redundancy_optimizer_under_join(rank, ws):
    """torch DDP + ZeroRedundancyOptimizer under ``Join([ddp, zero])`` against aligndp's zero1."""
    model, opt = wrap(seeded(Net), "zero1", process_group=_group())
    _train(model, opt, rank, ws, BATCHES[rank], join=Join([model, opt]))
    ddp = nn.parallel.DistributedDataParallel(seeded(Net))
    zero = ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.AdamW, lr=LR)
    _train(ddp, zero, rank, ws, BATCHES[rank], join=Join([ddp, zero]))
    assert_params_match(model.module, ddp.module, "zero1 against torch ZeRO under Join", REL)


def test_batch_rows_differ_by_rank():
    """The uneven cases train on different data per rank (else a missed shadow could pass)."""
    assert not torch.equal(batch(0, 0, 2)[0], batch(0, 1, 2)[0])


make_tests(globals())
