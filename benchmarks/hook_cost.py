r"""Host time of the gradient hooks per step: plain torch, torch DDP and aligndp, one rank.

    python benchmarks/hook_cost.py                      # CPU, gloo, 1 rank (seconds)
    python benchmarks/hook_cost.py --device cuda --preset gpt2-small --batch 8

Issue 22: under ``torch.compile`` the GPU finishes the backward before the host has issued the
per-param gradient hooks, so their host cost is the step. What counts here is the host (CPU)
time torch.profiler books under ``autograd::engine::evaluate_function: ...AccumulateGrad``:
autograd's accumulation into ``param.grad`` plus every hook that runs on it (aligndp's
post-accumulate hooks, torch DDP's C++ reducer hooks). Plain torch (no wrapper) is the floor.

On CPU the default model has gpt2-small's 148 params at tiny widths, so the numbers are the
per-param host work, not arithmetic. Prints one JSON line per variant and the ratios against
torch DDP measured in the same run.

``--timeit`` times aligndp's registered hooks alone instead ([Note: one closure per param] in
aligndp/runtime/reducer.py): inside a backward, in steady state (readiness learned, every
bucket launched as it fills at dp 1), microseconds per hook call; see
:func:`hook_us_per_call`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import timeit

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.profiler import ProfilerActivity, profile

import aligndp
from aligndp.models.gpt import GPT, PRESETS, GPTConfig

HOOK_EVENT = "AccumulateGrad"
"""Substring of the profiler event that holds autograd's accumulation and the hooks on it."""

# gpt2-small's structure (12 blocks, tied head: 148 params) at widths a CPU steps in ms
NARROW = GPTConfig(vocab_size=256, seq_len=64, dim=64, num_layers=12, head_dim=16, tied=True)

VARIANTS = ("torch", "torch_ddp", "aligndp_none", "aligndp_zero1")


def hook_host_ms(prof, steps: int) -> float:
    """Host ms per step in autograd's gradient accumulation and the hooks on it."""
    return (
        sum(
            e.cpu_time_total
            for e in prof.key_averages()
            if e.key.startswith("autograd::engine::evaluate_function") and HOOK_EVENT in e.key
        )
        / steps
        / 1e3
    )


def build(variant: str, cfg: GPTConfig, device: torch.device):
    """(model, optimizer) of one variant, fp32 params, AdamW."""
    torch.manual_seed(0)
    with torch.device(device):
        m = GPT(cfg)
    fused = device.type == "cuda"
    if variant == "torch":
        return m, torch.optim.AdamW(m.parameters(), lr=1e-4, fused=fused)
    if variant == "torch_ddp":
        ddp = nn.parallel.DistributedDataParallel(m, gradient_as_bucket_view=True)
        return ddp, torch.optim.AdamW(m.parameters(), lr=1e-4, fused=fused)
    sharding = variant.removeprefix("aligndp_")
    return aligndp.parallelize(m, optimizer="adamw", lr=1e-4, sharding=sharding)


def measure(model, opt, idx: torch.Tensor, *, steps: int, warmup: int, device) -> float:
    def step() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = model(idx, idx)
        loss.backward()
        opt.step()
        opt.zero_grad()

    for _ in range(warmup):
        step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    return hook_host_ms(prof, steps)


def hook_us_per_call(model, opt, idx: torch.Tensor, *, number: int = 100) -> float:
    """Microseconds per call of aligndp's post-accumulate hooks in a steady-state step.

    Each timed pass is one step's hook work as autograd would drive it: ``zero_grad``, arm
    (what the wrapper's forward does), then every param in backward order gets its gradient
    (the armed view already holds it; a deferring bucket's param gets a fresh tensor, as
    autograd steals it: [Note: one copy per bucket]) and its hook runs, launching each bucket
    as it fills. The same pass without the hook calls is subtracted."""
    for _ in range(3):  # readiness learned from the last synchronised backward
        model(idx, idx).backward()
        opt.step()
        opt.zero_grad()
    reducer = model.reducer
    order = list(range(len(reducer.params)))[::-1]  # ≈ backward order
    params = [reducer.params[k] for k in order]
    hooks = [reducer.hooks[k] for k in order]
    defers = [getattr(reducer._bucket_of[k], "defer", False) for k in order]
    stolen = [torch.zeros_like(p) for p in params]
    timed: list[float] = []

    def inside_backward(grad: torch.Tensor) -> torch.Tensor:
        def step_pass(run_hooks: bool) -> None:
            reducer.zero_grad_buffer()
            reducer.landing.arm()
            for hook, p, defer, g in zip(hooks, params, defers, stolen):
                if defer:
                    p.grad = g
                if run_hooks:
                    hook(p)

        def best(run_hooks: bool) -> float:  # thread CPU time: other jobs do not count
            runs = timeit.repeat(
                lambda: step_pass(run_hooks), number=number, repeat=7, timer=time.thread_time
            )
            return min(runs) / number

        timed.append((best(True) - best(False)) / len(params) * 1e6)
        return grad

    x = torch.ones(1, requires_grad=True)
    y = x * 2
    y.register_hook(inside_backward)  # the hooks queue the end-of-backward callback: in backward
    y.sum().backward()
    opt.zero_grad()
    return timed[0]


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--preset", default=None, help="a GPT preset (default: 148 narrow params)")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds; median reported")
    ap.add_argument("--timeit", action="store_true", help="us per aligndp hook call instead")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if not dist.is_initialized():
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo",
            store=dist.HashStore(),
            rank=0,
            world_size=1,
        )
    cfg = PRESETS[args.preset] if args.preset else NARROW
    idx = torch.randint(cfg.vocab_size, (args.batch, cfg.seq_len), device=device)
    if args.timeit:
        torch.set_num_threads(1)
        us = {v: hook_us_per_call(*build(v, cfg, device), idx) for v in VARIANTS[2:]}
        for v, x in us.items():
            print(json.dumps({"variant": v, "hook_us_per_call": round(x, 3)}), flush=True)
        return us
    built = {v: build(v, cfg, device) for v in VARIANTS}
    ms: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for _ in range(args.rounds):
        for v in VARIANTS:
            ms[v].append(
                measure(*built[v], idx, steps=args.steps, warmup=args.warmup, device=device)
            )
    result = {v: statistics.median(x) for v, x in ms.items()}
    params = sum(1 for p in built["torch"][0].parameters() if p.requires_grad)
    for v in VARIANTS:
        row = {"variant": v, "hook_host_ms_per_step": round(result[v], 3), "params": params}
        row["vs_torch_ddp"] = round(result[v] / result["torch_ddp"], 3)
        print(json.dumps(row), flush=True)
    return result


if __name__ == "__main__":
    main()
