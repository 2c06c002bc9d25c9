"""What every benchmark here shares: process-group start, JSON logging, steady-state timing.

Benchmarks run as scripts (``torchrun ... benchmarks/NAME.py``), so ``benchmarks/`` is
``sys.path[0]`` and they import this module as ``_bench``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

from aligndp.models.gpt import GPT, PRESETS


def add_common_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--preset", default="1b", choices=sorted(PRESETS))
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)


def init(device_name: str, **init_kwargs) -> tuple[torch.device, torch.dtype]:
    """NCCL + this rank's GPU and bf16 on ``cuda``; gloo and fp32 on ``cpu`` (smoke runs).
    ``init_kwargs`` go to ``init_process_group`` (e.g. ``timeout``)."""
    cuda = device_name == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if cuda else "gloo", **init_kwargs)
    return torch.device(device_name), torch.bfloat16 if cuda else torch.float32


def build_gpt(preset: str, device: torch.device, dtype: torch.dtype, *, seed: int = 0) -> GPT:
    """``GPT(PRESETS[preset])`` initialised directly on ``device`` (a 1b model built on the
    host and then moved costs seconds per build), in ``dtype``."""
    torch.manual_seed(seed)
    with torch.device(device):
        return GPT(PRESETS[preset]).to(dtype)


def device_label(device: torch.device) -> str:
    return torch.cuda.get_device_name() if device.type == "cuda" else "cpu"


def log(**kw) -> None:
    """One JSON object per line, rank 0 only."""
    if dist.get_rank() == 0:
        print(json.dumps(kw), flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def every_rank(seconds: float, device: torch.device) -> list[float]:
    """Every rank's figure (a data-parallel step can be no faster than its slowest rank)."""
    t = torch.tensor([seconds], dtype=torch.float64, device=device)
    out = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return [x.item() for x in out]


@dataclasses.dataclass(frozen=True)
class Timing:
    """How every figure of one run is timed: ``Timing(...)(fn)`` is :func:`timed` with these."""

    device: torch.device
    iters: int
    warmup: int

    def __call__(self, fn) -> float:
        return timed(fn, device=self.device, iters=self.iters, warmup=self.warmup)


def timed(fn, *, device: torch.device, iters: int, warmup: int, repeats: int = 3) -> float:
    """Seconds per call of ``fn`` in steady state: ``iters`` calls back to back (as in training,
    no barrier between steps), the median of ``repeats`` such runs."""
    for _ in range(warmup):
        fn()
    runs = []
    for _ in range(repeats):
        sync(device)
        dist.barrier()
        sync(device)
        t = time.perf_counter()
        for _ in range(iters):
            fn()
        sync(device)
        runs.append((time.perf_counter() - t) / iters)
    return statistics.median(runs)
