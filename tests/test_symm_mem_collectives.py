"""The copy-engine collectives experiment (benchmarks/symm_mem_collectives.py), registered the
way a script registers a backend (``aligndp.register_collectives``).

It is not a library backend (its docstring says why), but the benchmarks' A/B against NCCL
means something only if it reduces correctly. On CPU (gloo): it refuses a group it cannot
serve, naming the fix, and imports neither symmetric memory nor Triton at import time. On two
CUDA GPUs (NCCL, spawned here): its three bucket collectives match torch.distributed's on raw
symmetric buckets (fp32 and bf16, buckets at odd offsets, uneven all-reduce chunks, several in
flight at once, the bytes around them untouched), and training with it matches training with
``collectives="torch"`` step by step, replicated and ZeRO-1.
"""

from __future__ import annotations

import ast
import datetime
import os
import pathlib
import pickle
import sys
import tempfile
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import aligndp
from aligndp.plan.spec import Mode
from aligndp.runtime.collective_backends import make_collectives
from aligndp.runtime.collectives import shard_of
from tests._dist import case, make_tests
from tests.models import (
    ADAMW_GAIN,
    GLOBAL_BATCH,
    TOKENS,
    assert_close,
    batch,
    loss_of,
    make_net,
    order_tolerance,
)

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))  # as when a benchmark script runs: its folder is importable
from symm_mem_collectives import SymmMemCollectives  # noqa: E402

aligndp.register_collectives(SymmMemCollectives.name, SymmMemCollectives)

STEPS = 3
GPU_WORLD = 2
GPU_DEADLINE_S = 300
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


# ---- CPU ----
@case(2)
def case_refused_on_gloo_naming_the_torch_backend(rank, ws):
    fix = r"needs an NCCL process group with CUDA; this group's backend is 'gloo'.*'torch'"
    with pytest.raises(ValueError, match=fix):
        SymmMemCollectives(None)
    with pytest.raises(ValueError, match=fix):
        make_collectives("symm-mem", group=None)
    with pytest.raises(ValueError, match="collectives='torch'"):
        aligndp.parallelize(make_net(), collectives="symm-mem")


def test_imports_symmetric_memory_and_triton_lazily():
    tree = ast.parse((BENCHMARKS / "symm_mem_collectives.py").read_text())
    top = [n for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom)]
    names = [a.name for n in top if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in top if isinstance(n, ast.ImportFrom)]
    assert names and not [
        n for n in names if "symmetric_memory" in n or "triton" in n or "symm_mem_kernels" in n
    ], "import them inside the methods"


# ---- two GPUs ----
def gpu_ops_match_torch_distributed(rank: int, ws: int) -> None:
    dev = torch.device("cuda", rank)
    backend = SymmMemCollectives(None)
    plain = torch.zeros(4 * ws, device=dev)  # not symmetric: torch.distributed does it
    plain.fill_(rank + 1.0)
    backend.all_reduce_mean(plain).wait()
    assert backend._region_of(plain) is None and torch.all(plain == (ws + 1) / 2)
    for dtype in (torch.float32, torch.bfloat16):
        # NCCL's AVG and our pre-divided sum add the ws values in other orders
        tol = order_tolerance(dtype, terms=ws)
        buf = backend.allocate(8000, dtype=dtype, device=dev, align_bytes=256)
        assert buf.data_ptr() % 256 == 0 and buf.numel() == 8000 and not buf.any()
        # [64, 64+ws*733): reduce-scatter; [3100, 4101): all-reduce with uneven chunks;
        # [4200, 4200+ws*555): all-gather (ws <= 4); everything else must stay as it was
        spans = {"rs": (64, 64 + ws * 733), "ar": (3100, 4101), "ag": (4200, 4200 + ws * 555)}
        for it in range(3):  # several rounds: the barriers' signals must be consumed each time
            g = torch.Generator(device=dev).manual_seed(1000 * it + rank)
            buf.copy_(torch.randn(8000, generator=g, device=dev).to(dtype))
            before = buf.clone()
            rs, ar, ag = (buf[lo:hi] for lo, hi in spans.values())
            want_rs = torch.empty_like(shard_of(rs, rank=rank, dp_size=ws))
            _reduce_scatter(want_rs, rs.clone(), op=dist.ReduceOp.AVG)
            want_ar = ar.clone()
            dist.all_reduce(want_ar, op=dist.ReduceOp.AVG)
            want_ag = torch.empty_like(ag)
            _all_gather(want_ag, shard_of(ag, rank=rank, dp_size=ws).clone())
            works = [
                backend.reduce_scatter_mean(rs),
                backend.all_reduce_mean(ar),
                backend.all_gather_shards(ag),
            ]  # all in flight before the first wait
            assert all(not isinstance(w, dist.Work) for w in works), "fell back to NCCL"
            for w in works:
                w.wait()
            got_rs = shard_of(rs, rank=rank, dp_size=ws)
            assert_close(got_rs, want_rs, f"{dtype} reduce-scatter round {it}", tol)
            assert_close(ar, want_ar, f"{dtype} all-reduce round {it}", tol)
            assert torch.equal(ag, want_ag), "all-gather copies bytes: exact"
            outside = torch.ones(8000, dtype=torch.bool, device=dev)
            for lo, hi in spans.values():
                outside[lo:hi] = False
            assert torch.equal(buf[outside], before[outside]), "bytes outside a bucket changed"
        torch.cuda.synchronize()


def _train(sharding: str, collectives: str, rank: int, ws: int, **kwargs):
    """``STEPS`` clipped AdamW steps on the GPU. Per step the params the forward saw (read
    after backward: an overlapped gather has been waited for by then) and the reduced grads
    (this rank's shard of sharded buckets, whole buckets otherwise); then the final params."""
    dev = torch.device("cuda", rank)
    model, opt = aligndp.parallelize(
        make_net().to(dev),
        sharding=sharding,
        lr=1e-2,
        max_grad_norm=0.5,
        bucket_numel=200,
        collectives=collectives,
        **kwargs,
    )
    history = []
    for step in range(STEPS):
        idx, tgt = batch(step, rank, ws)
        loss_of(model, idx.to(dev), tgt.to(dev)).backward()
        grads = []
        for buf in model.flat_buffers:
            for b in range(len(buf.layout.buckets)):
                g = buf.bucket_grad(b)
                if buf.layout.mode is not Mode.REPLICATED:
                    g = shard_of(g, rank=rank, dp_size=ws)
                grads.append(g.clone())
        history.append((grads, [p.detach().clone() for p in model.module.parameters()]))
        opt.step()
        opt.zero_grad()
    if getattr(opt, "gather", None) is not None:
        opt.gather.wait_all()
    history.append(([], [p.detach().clone() for p in model.module.parameters()]))
    torch.cuda.synchronize()
    return history, model


def _close(got: torch.Tensor, want: torch.Tensor, where: str) -> None:
    """fp32: NCCL's AVG and our sum / dp_size round differently, and the steps after carry it
    through the GEMMs (60 token rows) and AdamW (tests/models.py [Tolerances])."""
    rel = order_tolerance(terms=GLOBAL_BATCH * TOKENS, steps=STEPS, gain=ADAMW_GAIN)
    assert_close(got, want, where, rel)


def gpu_training_matches_the_torch_backend(rank: int, ws: int) -> None:
    runs = (("none", {}), ("zero1", {}), ("zero1", {"overlap_param_gather": True}))
    for sharding, kwargs in runs:
        expected, _ = _train(sharding, "torch", rank, ws, **kwargs)
        got, model = _train(sharding, "symm-mem", rank, ws, **kwargs)
        backend = model.collectives
        assert isinstance(backend, SymmMemCollectives)
        assert len(model.bucket_refs) > 2, "the test needs several buckets"
        for buf in model.flat_buffers:
            for data in (buf.grad_data, buf.param_data):
                if data is not None:
                    assert backend._region_of(data) is not None, "not in symmetric memory"
        names = [n for n, _ in model.module.named_parameters()]
        for step, ((g1, p1), (g0, p0)) in enumerate(zip(got, expected)):
            where = f"{sharding} {kwargs} step {step}"
            for k, (a, b) in enumerate(zip(g1, g0)):
                _close(a, b, f"{where} grad bucket {k}")
            for name, a, b in zip(names, p1, p0):
                _close(a, b, f"{where} param {name}")


GPU_CASES = ["gpu_ops_match_torch_distributed", "gpu_training_matches_the_torch_backend"]


def _gpu_worker(rank: int, ws: int, init_file: str, out_dir: str, names: list[str]) -> None:
    # NVLink multicast stays off (it is never used here, and shared hosts forbid it)
    os.environ.update(
        TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NCCL_NVLS_ENABLE="0", NVSHMEM_DISABLE_NVLS="1"
    )
    torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=ws,
        timeout=datetime.timedelta(seconds=120),
        device_id=torch.device("cuda", rank),
    )
    results: dict[str, str | None] = {}
    for name in names:
        try:
            globals()[name](rank, ws)
            results[name] = None
        except Exception:  # noqa: BLE001  reported to the parent, which fails the test
            results[name] = f"rank {rank}: " + traceback.format_exc()
        with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump(results, f)
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no interpreter teardown (as tests/_dist.py)


_GPU_RESULTS: dict[str, str | None] = {}


def _gpu_results() -> dict[str, str | None]:
    """Run every GPU case once, in one NCCL group of two spawned processes; a rank stuck (a
    barrier waits for a peer that failed) is killed at the deadline."""
    if _GPU_RESULTS:
        return _GPU_RESULTS
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.spawn(
            _gpu_worker,
            args=(GPU_WORLD, os.path.join(tmp, "rendezvous"), tmp, GPU_CASES),
            nprocs=GPU_WORLD,
            join=False,
        )
        died, deadline = None, time.monotonic() + GPU_DEADLINE_S
        try:
            while not ctx.join(timeout=5):
                if time.monotonic() > deadline:
                    for p in ctx.processes:
                        if p.is_alive():
                            p.kill()
                    died = f"killed after {GPU_DEADLINE_S} s (a rank hung)"
                    break
        except Exception as e:  # noqa: BLE001  a rank process died: report it per case
            died = f"{type(e).__name__}: {e}"
        for r in range(GPU_WORLD):
            try:
                with open(os.path.join(tmp, f"rank{r}.pkl"), "rb") as f:
                    done = pickle.load(f)
            except FileNotFoundError:
                done = {}
            for name in GPU_CASES:
                err = done.get(name, f"rank {r} did not finish it: {died}")
                if err is not None and _GPU_RESULTS.get(name) is None:
                    _GPU_RESULTS[name] = err
                _GPU_RESULTS.setdefault(name, None)
    return _GPU_RESULTS


needs_two_gpus = pytest.mark.skipif(
    torch.cuda.device_count() < GPU_WORLD, reason="needs 2 CUDA GPUs (NCCL, symmetric memory)"
)


@needs_two_gpus
@pytest.mark.parametrize("name", GPU_CASES)
def test_on_two_gpus(name):
    err = _gpu_results()[name]
    if err is not None:
        pytest.fail(err, pytrace=False)


make_tests(globals())
