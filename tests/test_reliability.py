"""Issue 13 on 2-3 gloo ranks: ranks that disagree, collectives some ranks skip, user files.

Each case pins a behaviour that was wrong before: different models on different ranks trained
silently (or aborted, or hung), ``aligndp.save`` on rank 0 only hung until the 30-minute
process-group timeout, ``aligndp.save`` onto a file renamed it, a full disk left
``<path>.partial`` behind with an "enforce fail" message, damaged checkpoints surfaced as raw
``UnpicklingError``/``JSONDecodeError``/``CheckpointException``, and DCP's deduplication could
store another rank's BatchNorm statistics. The hang cases run with
``ALIGNDP_COLLECTIVE_TIMEOUT=2`` and assert that they end within it.
"""

from __future__ import annotations

import atexit
import datetime
import errno
import gc
import os
import resource
import shutil
import sys
import tempfile
import time
import weakref

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn

import aligndp
from aligndp.plan.request import plan_buffers
from aligndp.plan.spec import ParamSpec
from aligndp.runtime import agreement
from aligndp.runtime.ddp import DataParallel
from aligndp.state.checkpoint import prune_checkpoints
from tests._dist import case, make_tests
from tests.models import zero_middle

TIMEOUT_S = 2.0
os.environ[agreement.TIMEOUT_ENV] = str(TIMEOUT_S)  # inherited by the spawned ranks
if "ALIGNDP_TEST_RELIABILITY_DIR" not in os.environ:  # the pytest process; ranks inherit it
    os.environ["ALIGNDP_TEST_RELIABILITY_DIR"] = tempfile.mkdtemp(prefix="aligndp-reliability-")
    atexit.register(shutil.rmtree, os.environ["ALIGNDP_TEST_RELIABILITY_DIR"], True)
ROOT = os.environ["ALIGNDP_TEST_RELIABILITY_DIR"]


def where(name: str, ws: int) -> str:
    return os.path.join(ROOT, f"ws{ws}-{name}")


def small(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))


def step(model, opt, rank: int, seed: int) -> None:
    g = torch.Generator().manual_seed(1000 * seed + rank)
    x = torch.randn(16, 6, generator=g) * (rank + 1)  # BatchNorm statistics differ per rank
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()


def on_rank0(fn) -> None:
    """File surgery done once, seen by every rank after the barrier."""
    if dist.get_rank() == 0:
        fn()
    dist.barrier()


def write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def one_line(e: BaseException) -> str:
    text = str(e)
    assert "\n" not in text, f"not one line: {text!r}"
    return text


# ---- ranks that disagree about the model ----


def expect_disagreement(module: nn.Module, *patterns: str, layouts=()) -> None:
    with pytest.raises(ValueError, match="ranks disagree") as info:
        agreement.check_ranks_agree(module.named_parameters(), layouts)
    text = one_line(info.value)
    for pattern in patterns:
        assert pattern in text, f"{pattern!r} not in {text!r}"


@case(2, 3)
def case_different_shapes_are_named_on_every_rank(rank, ws):
    """Linear(4,4) on rank 0 and Linear(4,5) elsewhere padded to one buffer size and 'trained'."""
    expect_disagreement(
        nn.Linear(4, 4 if rank == 0 else 5),
        "param 'weight' has shape (5, 4) on rank 1",
        "but (4, 4) on rank 0",
    )


@case(2, 3)
def case_different_param_counts_are_named(rank, ws):
    """A different param count hung until the process-group timeout."""
    layers = [nn.Linear(4, 4) for _ in range(2 if rank == ws - 1 else 1)]
    expect_disagreement(
        nn.Sequential(*layers),
        f"rank {ws - 1} has 4 params and rank 0 has 2",
        "'1.weight' exists only on rank",
    )


@case(2)
def case_different_dtypes_and_requires_grad_are_named(rank, ws):
    expect_disagreement(
        nn.Linear(4, 4).to(torch.float64 if rank else torch.float32),
        "dtype float64 on rank 1 but float32 on rank 0",
    )
    frozen = nn.Linear(4, 4)
    frozen.bias.requires_grad_(rank == 0)
    expect_disagreement(frozen, "param 'bias' has requires_grad False on rank 1 but True on rank 0")


@case(2)
def case_same_params_other_layout_is_named(rank, ws):
    """Same model, a different bucket_numel on one rank: the buckets (collectives) would not
    match."""
    module = nn.Sequential(*(nn.Linear(8, 8) for _ in range(4)))
    specs = [ParamSpec(n, tuple(p.shape), p.dtype) for n, p in module.named_parameters()]
    layouts = plan_buffers(specs, dp_size=ws, bucket_numel=80 if rank else 10_000)
    expect_disagreement(module, "gradient buffer 0 differs in 'buckets'", layouts=layouts)


@case(2)
def case_agreeing_ranks_pass(rank, ws):
    module = small()
    specs = [ParamSpec(n, tuple(p.shape), p.dtype) for n, p in module.named_parameters()]
    agreement.check_ranks_agree(
        module.named_parameters(), plan_buffers(specs, dp_size=ws, bucket_numel=50)
    )


@case(2)
def case_parallelize_and_data_parallel_refuse_different_models(rank, ws):
    """Through the public doors, on every rank: parallelize (each sharding) and DataParallel
    itself. (This used to grep DataParallel.__init__'s source for the call instead.)"""
    for sharding in ("none", "zero1"):
        with pytest.raises(ValueError, match="ranks disagree.*'weight'"):
            aligndp.parallelize(nn.Linear(4, 4 if rank == 0 else 5), sharding=sharding, lr=0.1)
    with pytest.raises(ValueError, match="ranks disagree.*'weight'"):
        DataParallel(nn.Linear(4, 4 if rank == 0 else 5))


# ---- collectives that some ranks do not call ([Note: collective timeout]) ----


def expect_out_of_step(fn, *patterns: str) -> None:
    started = time.monotonic()
    with pytest.raises(agreement.RanksOutOfStepError) as info:
        fn()
    took = time.monotonic() - started
    assert took < TIMEOUT_S + 3, f"took {took:.1f} s with a {TIMEOUT_S} s timeout"
    text = one_line(info.value)
    for pattern in patterns:
        assert pattern in text, f"{pattern!r} not in {text!r}"


@case(2)
def case_save_on_rank0_only_fails_within_the_timeout(rank, ws):
    """The torch.save habit (`if rank == 0: aligndp.save(...)`) blocked every rank, silently."""
    model, opt = aligndp.parallelize(small(), lr=0.1)
    agreement.prepare_side_group(renew=True)
    if rank == 0:
        expect_out_of_step(
            lambda: aligndp.save(where("rank0-only", ws), model, opt),
            "rank(s) 1 did not reach it within 2 s",
            "aligndp.save(",
            "not under `if rank == 0:`",
        )
        expect_out_of_step(lambda: aligndp.save(where("rank0-only", ws), model, opt), "end the job")
    dist.barrier()
    agreement.prepare_side_group(renew=True)  # gloo closed the timed-out group's connections
    assert not os.path.exists(where("rank0-only", ws) + ".partial")


@case(2)
def case_load_on_rank0_only_fails_within_the_timeout(rank, ws):
    model, opt = aligndp.parallelize(small(), lr=0.1)
    agreement.prepare_side_group(renew=True)
    aligndp.save(where("load-rank0", ws), model, opt, step=3)
    agreement.prepare_side_group(renew=True)
    if rank == 0:
        expect_out_of_step(
            lambda: aligndp.load(where("load-rank0", ws), model, opt),
            "rank(s) 1 did not reach it",
            "aligndp.load(",
        )
    dist.barrier()
    agreement.prepare_side_group(renew=True)


@case(2)
def case_a_rank_left_behind_fails_on_both_ranks(rank, ws):
    """Rank 1 still evaluates while rank 0 saves: both end with a message, not at 30 minutes."""
    model, opt = aligndp.parallelize(small(), lr=0.1)
    agreement.prepare_side_group(renew=True)
    if rank == 1:
        time.sleep(TIMEOUT_S + 0.5)
        expect_out_of_step(
            lambda: aligndp.save(where("behind", ws), model, opt), "rank 0 did not reach it"
        )
    else:
        expect_out_of_step(
            lambda: aligndp.save(where("behind", ws), model, opt), "rank(s) 1 did not reach it"
        )
    dist.barrier()
    agreement.prepare_side_group(renew=True)  # the next cases get working connections


def deep(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(*(nn.Linear(12, 12) for _ in range(4)))


@case(2)
def case_a_failed_param_gather_is_named_and_never_waited_again(rank, ws):
    """Rank 1 skips the step that launches the overlapped param gathers, so rank 0's gathers
    time out: its next forward names the failed gather and the way back, every later read,
    forward or checkpoint raises that at once instead of reading values the gather never
    wrote, and dropping the wrapper waits for nothing (its finaliser waited for every other
    bucket's gather in turn, the timeout each time)."""
    group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=TIMEOUT_S))
    model, opt = aligndp.parallelize(
        deep(), lr=0.1, sharding="zero1", overlap_param_gather=True, process_group=group,
        bucket_numel=160,
    )  # fmt: skip
    buckets = len(opt.gather.order)
    assert buckets >= 3, f"{buckets} gathered buckets: the case needs several in flight"
    x = torch.randn(8, 12, generator=torch.Generator().manual_seed(rank))
    model(x).square().mean().backward()
    if rank == 0:
        opt.step()
        assert opt.gather.in_flight == buckets
        started = time.monotonic()
        with pytest.raises(RuntimeError, match="param all-gather of bucket") as info:
            model(x)
        took = time.monotonic() - started
        assert took < TIMEOUT_S + 3, f"took {took:.1f} s with a {TIMEOUT_S} s timeout"
        assert opt.gather.in_flight == 0, "the gathers in flight at the failure were kept"
        text = one_line(info.value)
        for pattern in ("on rank 0 of its group", "out of step", "aligndp.load"):
            assert pattern in text, f"{pattern!r} not in {text!r}"
        weight = model.module[0].weight
        for what, again in {
            "forward": lambda: model(x),
            "a read of a param": lambda: weight.sum(),
            "state_dict()": lambda: model.state_dict(),
            "opt.step()": opt.step,
        }.items():
            started = time.monotonic()
            with pytest.raises(RuntimeError, match="param all-gather of bucket"):
                again()
            took = time.monotonic() - started
            assert took < TIMEOUT_S / 4, f"{what} waited {took:.1f} s after the failure"
        module, wrapper = model.module, weakref.ref(model)
        unraisable = []
        hook, sys.unraisablehook = sys.unraisablehook, unraisable.append
        started = time.monotonic()
        try:
            del model, opt, weight, again, info  # the traceback holds the wrapper too
            gc.collect()
        finally:
            sys.unraisablehook = hook
        took = time.monotonic() - started
        assert wrapper() is None, "the wrapper outlived its last reference"
        assert took < TIMEOUT_S / 4, f"dropping the wrapper waited {took:.1f} s"
        assert not unraisable, f"the wrapper's finaliser raised: {unraisable[0].exc_value!r}"
        kinds = {type(p).__name__ for p in module.parameters()}
        assert kinds == {"Parameter"}, f"the dropped wrapper left params of classes {kinds}"
        module(x).sum().backward()  # the module trains on in plain torch
    dist.barrier()  # rank 1 never uses the timed-out group again


# ---- files: never lose a user's file ----


@case(2)
def case_save_onto_a_file_refuses_and_keeps_it(rank, ws):
    """aligndp.save onto an existing regular file renamed it to <file>.old."""
    model, opt = aligndp.parallelize(small(), lr=0.1)
    path = where("notes.txt", ws)
    on_rank0(lambda: write(path, "my notes"))
    with pytest.raises(
        ValueError, match="which is a file; aligndp never deletes or renames your files"
    ):
        aligndp.save(path, model, opt)
    with open(path) as f:
        assert f.read() == "my notes" and not os.path.exists(path + ".old")
    folder = where("photos", ws)

    def user_dir():
        os.makedirs(folder)
        write(os.path.join(folder, "cat.jpg"), "meow")

    on_rank0(user_dir)
    with pytest.raises(ValueError, match="a directory that is not an aligndp checkpoint"):
        aligndp.save(folder, model, opt)
    assert os.listdir(folder) == ["cat.jpg"]
    aligndp.save(where("ckpt", ws), model, opt, step=1)
    aligndp.save(where("ckpt", ws), model, opt, step=2)  # a previous checkpoint is replaced
    assert aligndp.load(where("ckpt", ws), model, opt) == 2


def inject_write_error(error: OSError, on_rank: int):
    original = dcp.FileSystemWriter.write_data

    def broken(self, plan, planner):
        if dist.get_rank() == on_rank:
            raise error
        return original(self, plan, planner)

    dcp.FileSystemWriter.write_data = broken
    return original


@case(2)
def case_disk_full_and_permission_errors_are_one_line_and_leave_nothing(rank, ws):
    """A full disk said 'enforce fail ... unexpected pos' and left <path>.partial filling the
    disk."""
    model, opt = aligndp.parallelize(small(), lr=0.1)
    path = where("full", ws)
    aligndp.save(path, model, opt, step=1)
    for error, reason in (
        (
            OSError(errno.ENOSPC, "No space left on device", "x/__1_0.distcp"),
            "no space left on the device (x/__1_0.distcp)",
        ),
        (PermissionError(errno.EACCES, "Permission denied", "x/__1_0.distcp"), "permission denied"),
    ):
        original = inject_write_error(error, on_rank=1)
        try:
            with pytest.raises(OSError) as info:
                aligndp.save(path, model, opt, step=2)
        finally:
            dcp.FileSystemWriter.write_data = original
        text = one_line(info.value)
        assert (
            reason in text and "failed on rank(s) [1]" in text and "nothing was left behind" in text
        ), text
        dist.barrier()
        assert not os.path.exists(path + ".partial"), "the partial checkpoint was left on the disk"
        assert aligndp.load(path, model, opt) == 1


DAMAGES = {
    "truncated shard": (
        lambda p: _truncate(os.path.join(p, "__1_0.distcp")),
        r"__1_0.distcp' is truncated: \d+ bytes",
    ),
    "missing shard": (
        lambda p: os.remove(os.path.join(p, "__0_0.distcp")),
        "__0_0.distcp' is missing",
    ),
    "truncated .metadata": (
        lambda p: _truncate(os.path.join(p, ".metadata")),
        r"\.metadata' is damaged",
    ),
    "missing .metadata": (
        lambda p: os.remove(os.path.join(p, ".metadata")),
        r"\.metadata' is missing",
    ),
    "empty aligndp.json": (
        lambda p: write(os.path.join(p, "aligndp.json"), ""),
        "aligndp.json' is damaged: empty",
    ),
    "corrupt aligndp.json": (
        lambda p: write(os.path.join(p, "aligndp.json"), '{"step": 3,'),
        "aligndp.json' is damaged: not valid JSON",
    ),
    "aligndp.json without shapes": (
        lambda p: write(os.path.join(p, "aligndp.json"), '{"step": 3}'),
        r"lacks \['shapes', 'checksums'\]",
    ),
    "4 KiB zeroed inside a shard, size unchanged": (
        lambda p: zero_middle(os.path.join(p, "__1_0.distcp")),
        r"__1_0.distcp' is damaged: its CRC-32 is [0-9a-f]{8}, aligndp.json recorded [0-9a-f]{8}",
    ),
    "path is a file": (
        lambda p: (shutil.rmtree(p), write(p, "")),
        "is a file, not an aligndp checkpoint",
    ),
    "missing directory": (lambda p: shutil.rmtree(p), "the path does not exist"),
}


def _truncate(path: str) -> None:
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size // 2)


@case(2)
def case_every_damaged_checkpoint_is_one_line_naming_the_file(rank, ws):
    model, opt = aligndp.parallelize(small(), sharding="zero1", lr=0.1)
    step(model, opt, rank, seed=0)
    good = where("good", ws)
    aligndp.save(good, model, opt, step=1)
    for index, (label, (damage, pattern)) in enumerate(DAMAGES.items()):
        path = where(f"damaged-{index}", ws)
        on_rank0(lambda path=path, damage=damage: (shutil.copytree(good, path), damage(path)))
        with pytest.raises(ValueError, match=pattern) as info:
            aligndp.load(path, model, opt)
        one_line(info.value)
        assert label and "Traceback" not in str(info.value)


@case(2)
def case_checkpoint_holds_rank0_buffers(rank, ws):
    """BatchNorm running stats differ per rank; DCP's dedup could keep rank 1's copy."""
    model, opt = aligndp.parallelize(small(), lr=0.1)
    for seed in range(3):
        step(model, opt, rank, seed)
    mine = {n: b.clone() for n, b in model.module.named_buffers()}
    rank0 = [mine]
    dist.broadcast_object_list(rank0, src=0)
    path = where("batchnorm", ws)
    aligndp.save(path, model, opt, step=3)
    fresh, fresh_opt = aligndp.parallelize(small(seed=1), lr=0.1)
    aligndp.load(path, fresh, fresh_opt)
    for name, value in fresh.module.named_buffers():
        assert torch.equal(value, rank0[0][name]), f"{name}: not rank 0's copy on rank {rank}"


# ---- a long run: memory flat, replicas bit-identical ----


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


@case(2)
def case_thousand_steps_memory_flat_and_replicas_identical(rank, ws):
    torch.manual_seed(0)
    model, opt = aligndp.parallelize(
        nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4)),
        sharding="zero1",
        lr=1e-3,
        bucket_numel=64,
    )
    g = torch.Generator().manual_seed(rank)
    data = [torch.randn(8, 16, generator=g) for _ in range(10)]
    warm = None
    for i in range(1000):
        model(data[i % 10]).square().mean().backward()
        opt.step()
        opt.zero_grad()
        if i == 399:
            warm = rss_bytes()  # the allocator settles over the first few hundred steps (~1 MiB)
    growth = rss_bytes() - warm
    # measured: 0.1-0.2 MiB over these 600 steps; a leak of 2 KB a step would pass 1 MiB
    assert growth < 2**20, f"resident memory grew by {growth / 2**20:.2f} MiB over 600 steps"
    flat = torch.cat([p.detach().reshape(-1) for p in model.module.parameters()])
    everyone = [torch.empty_like(flat) for _ in range(ws)]
    dist.all_gather(everyone, flat)
    assert all(torch.equal(everyone[0], other) for other in everyone), (
        "replicas differ after 1,000 steps"
    )


make_tests(globals())


# ---- one process ----


def test_collective_timeout_reads_argument_env_and_default(monkeypatch):
    monkeypatch.setenv(agreement.TIMEOUT_ENV, "7.5")
    assert agreement.collective_timeout().total_seconds() == 7.5
    assert agreement.collective_timeout(3).total_seconds() == 3
    monkeypatch.delenv(agreement.TIMEOUT_ENV)
    assert agreement.collective_timeout().total_seconds() == agreement.DEFAULT_COLLECTIVE_TIMEOUT_S
    monkeypatch.setenv(agreement.TIMEOUT_ENV, "soon")
    with pytest.raises(ValueError, match="ALIGNDP_COLLECTIVE_TIMEOUT='soon' is not a number"):
        agreement.collective_timeout()
    with pytest.raises(ValueError, match="positive number of seconds"):
        agreement.collective_timeout(0)


def test_prune_checkpoints_keeps_the_newest_and_never_touches_other_files(tmp_path):
    for n in (100, 200, 300, 400):
        (tmp_path / f"step-{n:06d}").mkdir()
        (tmp_path / f"step-{n:06d}" / "aligndp.json").write_text("{}")
    (tmp_path / "step-000050").mkdir()  # not a checkpoint: no aligndp.json
    (tmp_path / "notes.txt").write_text("keep me")
    deleted = prune_checkpoints(tmp_path, keep_last=2)
    assert sorted(os.path.basename(p) for p in deleted) == ["step-000100", "step-000200"]
    assert sorted(os.listdir(tmp_path)) == [
        "notes.txt",
        "step-000050",
        "step-000300",
        "step-000400",
    ]
    with pytest.raises(ValueError, match="keep_last must be an integer >= 1, got 0"):
        prune_checkpoints(tmp_path, keep_last=0)
