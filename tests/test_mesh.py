"""Data parallelism over a 2-D DeviceMesh ([Note: replicate x shard mesh] in
aligndp/runtime/mesh.py) on gloo: 4 ranks as 2x2, 8 ranks as 2x4 and 4x2.

Every mode trains as one process on the global batch does (the same tolerances as the flat
parity tests: tests/models.py [Tolerances]); replicas hold bit-identical params after every
step; a 1-D mesh is the flat group bit for bit; each rank's bytes across replicas per step
are its owned shards, once per step whatever the number of micro-batches; a mesh that does
not fit the job is refused on every rank with one line.
"""

from __future__ import annotations

import contextlib
import math
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import aligndp
from aligndp.plan.routing import route_params
from aligndp.plan.spec import Mode
from aligndp.runtime.ddp import DataParallel
from tests._dist import case, make_tests
from tests._habits_models import dropped
from tests.models import (
    ADAMW_GAIN,
    MUON_GAIN,
    TOKENS,
    VOCAB,
    assert_close,
    assert_params_match,
    assert_replicas_identical,
    batch,
    ckpt,
    fp32_newton_schulz,
    loss_of,
    make_net,
    make_shaped_net,
    order_tolerance,
    snapshot,
)

ROWS = 24
"""Global batch rows: divisible by 4 and 8."""
STEPS = 3
_MESHES: dict[tuple, DeviceMesh] = {}


def mesh(*shape: int, names: tuple[str, ...] | None = ("replicate", "shard")) -> DeviceMesh:
    """One mesh per shape and names for the whole module (building one is a collective)."""
    key = (shape, names)
    if key not in _MESHES:
        _MESHES[key] = init_device_mesh("cpu", shape, mesh_dim_names=names)
    return _MESHES[key]


def shapes(ws: int) -> list[tuple[int, int]]:
    return [(2, 2)] if ws == 4 else [(2, 4), (4, 2)]


def one_line(e: BaseException) -> str:
    text = str(e)
    assert "\n" not in text, f"not one line: {text!r}"
    return text


# ---- refusals ----


@case(4)
def case_meshes_that_do_not_fit_are_refused_on_every_rank(rank, ws):
    net = make_net()
    # 2 of the 4 ranks, without process groups: torch would make them on ranks 0 and 1 only,
    # leaving the group names out of step for the later cases' new_group
    small = DeviceMesh("cpu", [0, 1], mesh_dim_names=("dp",), _init_backend=False)
    refused = [
        (dict(mesh=small), ValueError, "on a job of 4 ranks"),
        (dict(mesh=mesh(2, 2), process_group=dist.group.WORLD), ValueError, "not both"),
        (dict(mesh=mesh(1, 2, 2, names=("a", "replicate", "shard"))), ValueError, "got 3 dims"),
        (dict(mesh=mesh(2, 2, names=None)), ValueError, "needs named dims"),
        (dict(mesh=mesh(2, 2, names=("replicate", "tp"))), ValueError, "needs named dims"),
        (dict(mesh="2x2"), TypeError, "DeviceMesh"),
    ]
    for kwargs, error, words in refused:
        with pytest.raises(error) as info:
            aligndp.parallelize(net, sharding="zero1", **kwargs)
        assert words in one_line(info.value), (kwargs, info.value)
        with pytest.raises(error):
            DataParallel(net, **kwargs)
    for replicas in (3, 0, 8):
        with pytest.raises(ValueError) as info:
            aligndp.replica_mesh(replicas, "cpu")
        assert str(replicas) in one_line(info.value)
    built = aligndp.replica_mesh(2, "cpu")
    assert built.mesh_dim_names == ("replicate", "shard") and tuple(built.shape) == (2, 2)
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    model, _ = aligndp.parallelize(net, mesh=mesh(2, 2))
    with pytest.raises(ValueError) as info:
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    assert "not a 2-D mesh" in one_line(info.value)


# ---- parity ----


def one_process(muon: bool) -> tuple[torch.nn.Module, list[torch.optim.Optimizer]]:
    """The reference net and torch's optimizers: AdamW on every param, or Muon on the routed
    matrices and AdamW on the rest (the lrs parallelize gets here)."""
    ref = (make_shaped_net if muon else make_net)()
    named = dict(ref.named_parameters())
    if not muon:
        return ref, [torch.optim.AdamW(ref.parameters(), lr=1e-2)]
    routing = route_params(ref)
    return ref, [
        torch.optim.Muon(
            [named[n] for n in routing.whole], lr=0.02, adjust_lr_fn="match_rms_adamw"
        ),
        torch.optim.AdamW([named[n] for n in routing.adamw], lr=1e-2),
    ]


def train_against_one_process(
    rank: int,
    ws: int,
    m: DeviceMesh,
    *,
    sharding: str,
    optimizer: str = "adamw",
    micro: int = 1,
    sync_each: bool = False,
    **kwargs,
) -> None:
    """STEPS steps on ``m`` against one process on the global batch, every step; replicas
    bit-identical after each. ``micro`` micro-batches per step, under ``no_sync()`` but the
    last, or each one reduced (``sync_each``: the later ones reopen the reduced grads)."""
    muon = optimizer == "muon"
    factory = make_shaped_net if muon else make_net
    model, opt = aligndp.parallelize(
        factory(),
        optimizer=optimizer,
        sharding=sharding,
        mesh=m,
        lr=0.02 if muon else 1e-2,
        bucket_numel=150,
        max_grad_norm=0.5,
        **({"adamw_lr": 1e-2} if muon else {}),
        **kwargs,
    )
    ref, ref_opts = one_process(muon)
    rel = order_tolerance(terms=ROWS * TOKENS, steps=STEPS, gain=MUON_GAIN if muon else ADAMW_GAIN)
    for step in range(STEPS):
        idx, tgt = batch(step, rank, ws, rows=ROWS)
        for i in range(micro):  # split every row's tokens; equal weights keep the mean exact
            cols = slice(i * TOKENS // micro, (i + 1) * TOKENS // micro)
            weight = (cols.stop - cols.start) / TOKENS
            last = i == micro - 1 or sync_each
            sync = contextlib.nullcontext() if last else model.no_sync()
            with sync:
                (weight * loss_of(model, idx[:, cols], tgt[:, cols])).backward()
        norm = opt.grad_norm()  # the one every shard group clips by
        opt.step()
        opt.zero_grad()
        loss_of(ref, *batch(step, rows=ROWS)).backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        assert_close(norm, ref_norm, f"{sharding} {optimizer} step {step}: global norm", rel)
        for o in ref_opts:
            o.step()
            o.zero_grad()
        what = f"{tuple(m.shape)} {sharding} {optimizer} step {step}"
        assert_replicas_identical(model.module, what)
        assert_params_match(model.module, ref, what, rel)


@case(4, 8)
def case_every_mode_matches_one_process_on_every_mesh(rank, ws):
    for shape in shapes(ws):
        m = mesh(*shape)
        train_against_one_process(rank, ws, m, sharding="none")
        train_against_one_process(rank, ws, m, sharding="zero1", micro=2)
        if ws == 4:  # reopening adds nothing that the shape changes
            train_against_one_process(rank, ws, m, sharding="zero1", micro=2, sync_each=True)
        with fp32_newton_schulz():
            train_against_one_process(
                rank, ws, m, sharding="zero1", optimizer="muon", overlap_param_gather=True
            )


@case(4)
def case_shard_dim_first_with_torchtitan_names(rank, ws):
    """Shard groups {0, 2} and {1, 3}: nothing assumes rank = replica * S + shard."""
    m = mesh(2, 2, names=("dp_shard", "dp_replicate"))
    assert dist.get_process_group_ranks(m.get_group("dp_shard")) == [rank % 2, rank % 2 + 2]
    train_against_one_process(rank, ws, m, sharding="zero1", micro=2)


@case(4)
def case_dropping_a_meshed_wrapper_frees_it(rank, ws):
    """[Note: dropped wrappers] on a 2 x 2 mesh (replica all-reduces, shard gathers still in
    flight when the wrapper goes), as tests/test_torch_habits.py checks on a flat group:
    dropped with its module, nothing of the wrapper outlives it; with the module kept, its
    buffers go too and no hook, sink or param class of it stays on the module."""

    def build():
        net = make_net()
        model, opt = aligndp.parallelize(
            net, sharding="zero1", mesh=mesh(2, 2), lr=1e-2, overlap_param_gather=True
        )
        loss_of(model, *batch(0, rank, ws, rows=ROWS)).backward()
        opt.step()  # leaves the gathers in flight
        return net, model, opt

    for keep in (False, True):
        dropped(build, keep, "2 x 2 mesh")


@case(4)
def case_replicas_only_mesh_matches_one_process(rank, ws):
    """4 x 1: no sharding left, every owned shard is the whole bucket, all-reduced across
    the replicas."""
    train_against_one_process(rank, ws, mesh(4, 1), sharding="zero1", sync_each=True, micro=2)


@case(4)
def case_one_dim_mesh_is_the_flat_group_bit_for_bit(rank, ws):
    for sharding, optimizer in (("none", "adamw"), ("zero1", "adamw"), ("zero1", "muon")):
        runs = []
        for where in (dict(mesh=mesh(4, names=("dp",))), dict(process_group=None)):
            factory = make_shaped_net if optimizer == "muon" else make_net
            model, opt = aligndp.parallelize(
                factory(), optimizer=optimizer, sharding=sharding, bucket_numel=150, **where
            )
            for step in range(2):
                loss_of(model, *batch(step, rank, ws, rows=ROWS)).backward()
                opt.step()
                opt.zero_grad()
            runs.append([p.detach().clone() for p in model.module.parameters()])
        for p, q in zip(*runs):
            assert torch.equal(p, q), f"{sharding} {optimizer}: a 1-D mesh trained otherwise"


@case(4)
def case_a_param_used_by_one_replica_only_is_stepped_by_every_rank(rank, ws):
    """Ranks 2 and 3 (the second replica) skip ``mix``: the ranks agree over the whole mesh
    that it was used, so every replica steps it alike, as one process on the global batch
    (rows of the second replica's half without ``mix``)."""
    import torch.nn.functional as F

    def loss(module, idx, tgt, skip):
        return F.cross_entropy(module(idx, skip_mix=skip).reshape(-1, VOCAB), tgt.reshape(-1))

    for sharding in ("none", "zero1"):
        model, opt = aligndp.parallelize(
            make_net(), sharding=sharding, mesh=mesh(2, 2), lr=1e-2, bucket_numel=150
        )
        ref = make_net()
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
        idx, tgt = batch(0, rank, ws, rows=ROWS)
        loss(model, idx, tgt, rank >= 2).backward()
        opt.step()
        for r in range(ws):  # the mean over ranks of each rank's loss
            (loss(ref, *batch(0, r, ws, rows=ROWS), r >= 2) / ws).backward()
        ref_opt.step()
        assert_replicas_identical(model.module, sharding)
        rel = order_tolerance(terms=ROWS * TOKENS, gain=ADAMW_GAIN)
        assert_params_match(model.module, ref, f"{sharding}, mix used by one replica", rel)


# ---- bytes across replicas ----


def owned_shard_bytes(model: DataParallel) -> int:
    """This rank's owned shard of every sharded and layer-wise bucket, in bytes: from the
    plan, not from the collectives."""
    total = 0
    for layout in model.layouts:
        if layout.mode is not Mode.REPLICATED:
            numel = sum(b.end - b.start for b in layout.buckets) // layout.dp_size
            total += numel * layout.grad_dtype.itemsize
    return total


@case(4)
def case_bytes_across_replicas_are_the_owned_shards_once_per_step(rank, ws):
    m = mesh(2, 2)
    replicate = m.get_group("replicate")
    sent: list[int] = []
    all_reduce = dist.all_reduce

    def counting(tensor, *args, group=None, **kwargs):
        if group is replicate:
            sent.append(tensor.numel() * tensor.element_size())
        return all_reduce(tensor, *args, group=group, **kwargs)

    for optimizer in ("adamw", "muon"):
        factory = make_shaped_net if optimizer == "muon" else make_net
        model, opt = aligndp.parallelize(
            factory(), optimizer=optimizer, sharding="zero1", mesh=m, bucket_numel=150
        )
        assert len(model.bucket_refs) > 2, "the test needs several buckets"
        for micro in (1, 4):
            with mock.patch.object(dist, "all_reduce", counting):
                sent.clear()
                idx, tgt = batch(0, rank, ws, rows=ROWS)
                for i in range(micro):
                    sync = contextlib.nullcontext() if i == micro - 1 else model.no_sync()
                    with sync:
                        loss_of(model, idx[i::micro], tgt[i::micro]).backward()
                opt.step()
                opt.zero_grad()
            buckets = sum(len(lo.buckets) for lo in model.layouts if lo.mode is not Mode.REPLICATED)
            assert len(sent) == buckets, f"{optimizer} {micro} micro-batches: {len(sent)} calls"
            assert sum(sent) == owned_shard_bytes(model), (optimizer, micro, sent)


# ---- checkpoints across mesh shapes ----

SAVED_AT, TOTAL = 1, 3
_SUBGROUPS: dict[tuple[int, ...], dist.ProcessGroup] = {}


def flat(*ranks: int) -> dict:
    """``process_group=`` a flat group of ``ranks`` (made once, collectively, on every rank)."""
    if ranks not in _SUBGROUPS:
        _SUBGROUPS[ranks] = dist.new_group(list(ranks))
    return {"process_group": _SUBGROUPS[ranks]}


def run_on(
    where: dict,
    kind: str,
    steps: range,
    *,
    load: str | None = None,
    saved: dict | None = None,
    save: str | None = None,
):
    """Build ``kind`` on ``where`` (``mesh=`` or ``process_group=``), load ``load`` (its params
    must be ``saved`` bit for bit), train ``steps`` on that group's share of the global batch,
    save to ``save``; the module, or None on a rank outside the group."""
    group = where.get("process_group")
    if group is not None and dist.get_rank(group) < 0:
        return None
    rank, ws = dist.get_rank(group), dist.get_world_size(group)
    sharding, optimizer = kind.split("-")
    muon = optimizer == "muon"
    model, opt = aligndp.parallelize(
        (make_shaped_net if muon else make_net)(),
        optimizer=optimizer,
        sharding=sharding,
        lr=0.02 if muon else 1e-2,
        bucket_numel=150,
        **({"adamw_lr": 1e-2} if muon else {}),
        **where,
    )
    if load is not None:
        assert aligndp.load(load, model, opt) == SAVED_AT
        for n, p in model.module.named_parameters():
            assert torch.equal(p.detach(), saved[n]), f"{load} -> {where}: {n} loaded otherwise"
    for step in steps:
        loss_of(model, *batch(step, rank, ws, rows=ROWS)).backward()
        opt.step()
        opt.zero_grad()
    if save is not None:
        aligndp.save(save, model, opt, step=SAVED_AT)
    model.wait_for_params()
    return model.module


def reference_run(kind: str, steps: int) -> torch.nn.Module:
    """One process on the global batch, ``steps`` steps: the uninterrupted run."""
    ref, opts = one_process(kind.endswith("muon"))
    for step in range(steps):
        loss_of(ref, *batch(step, rows=ROWS)).backward()
        for o in opts:
            o.step()
            o.zero_grad()
    return ref


def resume_everywhere(path: str, kind: str, saved: dict, targets: list[dict]) -> None:
    """Load ``path`` (holding ``saved``: the writer's params) on each of ``targets``: the
    params are the saved ones bit for bit, and ``TOTAL - SAVED_AT`` more steps land where one
    process's uninterrupted run does."""
    done = reference_run(kind, TOTAL)
    gain = MUON_GAIN if kind.endswith("muon") else ADAMW_GAIN
    rel = order_tolerance(terms=ROWS * TOKENS, steps=TOTAL, gain=gain)
    for where in targets:
        what = f"{kind} {path} -> {where}"
        resumed = run_on(where, kind, range(SAVED_AT, TOTAL), load=path, saved=saved)
        if resumed is not None:
            assert_params_match(resumed, done, f"{what} after {TOTAL - SAVED_AT} steps", rel)


KINDS = ("zero1-adamw", "zero1-muon", "none-adamw")


def save_on(where: dict, name: str, kind: str) -> dict:
    """Train ``SAVED_AT`` steps on ``where`` and save them as ``name``; the params saved (also
    written beside it for the 8-rank case)."""
    saved = snapshot(run_on(where, kind, range(SAVED_AT), save=ckpt(f"mesh-{name}-{kind}")))
    if dist.get_rank() == 0:
        torch.save(saved, ckpt(f"mesh-{name}-{kind}.params.pt"))
    dist.barrier()
    return saved


@case(4)
def case_checkpoints_reshard_from_and_to_a_mesh(rank, ws):
    """2x2 -> 1x4, 4x1, flat 4, flat 3; flat 4 and 4x1 -> 2x2."""
    with fp32_newton_schulz():
        for kind in KINDS:
            saved = save_on({"mesh": mesh(2, 2)}, "2x2", kind)
            meta = dcp.FileSystemReader(ckpt(f"mesh-2x2-{kind}")).read_metadata()
            for key, tensor in meta.state_dict_metadata.items():
                chunks = getattr(tensor, "chunks", None)
                if chunks is not None:  # replicas write the same chunks: DCP keeps one each
                    written = sum(math.prod(c.sizes) for c in chunks)
                    assert written == math.prod(tensor.size), f"{key}: {written} elements written"
            targets = [{"mesh": mesh(1, 4)}, {"mesh": mesh(4, 1)}, {}, flat(0, 1, 2)]
            resume_everywhere(ckpt(f"mesh-2x2-{kind}"), kind, saved, targets)
            for name, where in (("flat4", {}), ("4x1", {"mesh": mesh(4, 1)})):
                saved = save_on(where, name, kind)
                resume_everywhere(ckpt(f"mesh-{name}-{kind}"), kind, saved, [{"mesh": mesh(2, 2)}])


@case(8, after=(4,))
def case_checkpoints_of_a_2x2_mesh_resume_at_8_ranks(rank, ws):
    with fp32_newton_schulz():
        for kind, shape in zip(KINDS, [(2, 4), (4, 2), (4, 2)]):
            saved = torch.load(ckpt(f"mesh-2x2-{kind}.params.pt"))
            resume_everywhere(ckpt(f"mesh-2x2-{kind}"), kind, saved, [{"mesh": mesh(*shape)}])


# ---- faults ----


def die_on_rank3_of_a_mesh(config, recipe=None):
    """Entry point of the launched ranks (replaces train_loop.launched_worker): a 2x2 mesh
    trains ZeRO-1; rank 3 dies at its second step, leaving its shard peer (rank 2) in a
    reduce-scatter and its replica peer (rank 1) in an all-reduce."""
    import os

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model, opt = aligndp.parallelize(
        make_net(), sharding="zero1", mesh=mesh(2, 2), bucket_numel=150
    )
    for step in range(3):
        if step == 1 and rank == 3:
            os._exit(3)
        loss_of(model, *batch(step, rank, 4, rows=ROWS)).backward()
        opt.step()
        opt.zero_grad()
    return {}


def test_a_rank_dying_in_a_mesh_ends_every_rank_naming_it(tmp_path, capsys):
    import re
    import time

    from aligndp.app import cli

    with mock.patch("aligndp.app.train_loop.launched_worker", die_on_rank3_of_a_mesh):
        start = time.monotonic()
        args = ["train", "--steps", "2", "--nproc", "4", "--out", str(tmp_path / "run")]
        code = cli.main(args)
    assert code == 1, code
    err = capsys.readouterr().err
    assert re.search(r"rank(\(s\))? 3\b.*failed", err), err
    assert time.monotonic() - start < 90, "the other ranks must be stopped once rank 3 died"


make_tests(globals())
