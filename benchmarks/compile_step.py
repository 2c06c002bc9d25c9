r"""Training step time, eager and ``torch.compile``d, against plain torch and torch DDP (issue 22).

One GPU (the figures of the issue's table; the default stays well inside 5 minutes):
    python benchmarks/compile_step.py --preset gpt2-small
    python benchmarks/compile_step.py --preset 1b
Two GPUs (DDP + compile at dp 2; plain torch stays the one-rank limit on each rank):
    torchrun --nproc-per-node 2 benchmarks/compile_step.py --preset gpt2-small
CPU smoke run (gloo, the demo preset, aot_eager, seconds; CI runs it):
    python benchmarks/compile_step.py --smoke

Every variant is built once in this one process (GPT preset, fp32 params, bf16 autocast on CUDA,
AdamW, fused on CUDA) and stepped in interleaved rounds, so drift of the machine hits all alike:

- ``torch``: no wrapper, the limit (on each rank: no communication);
- ``torch_ddp``: ``DistributedDataParallel(gradient_as_bucket_view=True)``;
- ``aligndp_none`` / ``aligndp_zero1``: ``aligndp.parallelize(optimizer="adamw", sharding=...)``;
- ``aligndp_bf16``: aligndp none with the Linears the layer rule picks (every unshared one in
  the CPU smoke run) converted to the ``bf16`` wgrad recipe (the wgrad GEMM writes float32 into
  the grad buffer: [Note: fused bf16 wgrad]);
- ``aligndp_none_blocks``: aligndp none with each block compiled (torchtitan style), compiled
  rows only.

Each variant is timed eager and with ``torch.compile(model)`` (one model and optimizer serve
both, so memory holds one copy per variant). After the rounds every variant is profiled
for a few steps and the host time in gradient accumulation and its hooks is reported
(benchmarks/hook_cost.py). Prints one JSON line per figure and a table of ratios against plain
torch and torch DDP of the same run and mode.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from hook_cost import hook_host_ms
from run_all_table import Goal, Row
from torch.profiler import ProfilerActivity, profile

import aligndp
from aligndp.lowp import convert_to_mxfp8
from aligndp.models.gpt import GPT, PRESETS

VARIANTS = (
    "torch",
    "torch_ddp",
    "aligndp_none",
    "aligndp_zero1",
    "aligndp_bf16",
    "aligndp_none_blocks",
)


def init(device_name: str) -> torch.device:
    """torchrun's process group when launched by it, else a one-rank group in this process."""
    cuda = device_name == "cuda"
    backend = "nccl" if cuda else "gloo"
    if "RANK" in os.environ:
        if cuda:
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group(backend)
    else:
        if cuda:
            torch.cuda.set_device(0)
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return torch.device(device_name, torch.cuda.current_device()) if cuda else torch.device("cpu")


def build(variant: str, preset: str, device: torch.device):
    """(module as called, optimizer, the GPT inside) of one variant."""
    torch.manual_seed(0)
    with device:
        gpt = GPT(PRESETS[preset])
    fused = device.type == "cuda"
    if variant == "torch":
        return gpt, torch.optim.AdamW(gpt.parameters(), lr=1e-4, fused=fused), gpt
    if variant == "torch_ddp":
        ddp = nn.parallel.DistributedDataParallel(gpt, gradient_as_bucket_view=True)
        return ddp, torch.optim.AdamW(gpt.parameters(), lr=1e-4, fused=fused), gpt
    sharding = "zero1" if variant == "aligndp_zero1" else "none"
    wgrad = "bf16" if variant == "aligndp_bf16" else None
    if wgrad:  # the layer rule; on a CPU (the smoke run) it converts none, so every layer
        convert_to_mxfp8(gpt, backend=wgrad, layers="pays" if fused else "all")
    model, opt = aligndp.parallelize(
        gpt, optimizer="adamw", lr=1e-4, sharding=sharding, wgrad=wgrad
    )
    return model, opt, gpt


def step_fn(model, opt, idx: torch.Tensor, device: torch.device):
    autocast = device.type == "cuda"

    def step() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = model(idx, idx)
        loss.backward()
        opt.step()
        opt.zero_grad()

    return step


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(step, steps: int, device: torch.device) -> float:
    sync(device)
    dist.barrier()
    t = time.perf_counter()
    for _ in range(steps):
        step()
    sync(device)
    return (time.perf_counter() - t) / steps


def profiled_hook_ms(step, steps: int, device: torch.device) -> float:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
        sync(device)
    return hook_host_ms(prof, steps)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="CPU, demo preset, aot_eager, 1 round")
    ap.add_argument("--preset", default=None, choices=sorted(PRESETS), help="default gpt2-small")
    ap.add_argument("--device", default=None, choices=["cuda", "cpu"])
    ap.add_argument("--batch", type=int, default=None, help="sequences per rank (default 8)")
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 3)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per round (default 8)")
    ap.add_argument("--warmup", type=int, default=None, help="steps before timing (default 3)")
    ap.add_argument("--profile-steps", type=int, default=None, help="profiled steps (default 5)")
    ap.add_argument("--backend", default=None, help="torch.compile backend (default inductor)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset")
    args = ap.parse_args(argv)
    smoke = args.smoke
    for name, full, quick in (
        ("preset", "gpt2-small", "demo"),
        ("device", "cuda", "cpu"),
        ("batch", 8, 2),
        ("rounds", 3, 1),
        ("steps", 8, 2),
        ("warmup", 3, 1),
        ("profile_steps", 5, 1),
        ("backend", "inductor", "aot_eager"),
    ):
        if getattr(args, name) is None:
            setattr(args, name, quick if smoke else full)
    args.variants = [v for v in args.variants.split(",") if v]
    unknown = set(args.variants) - set(VARIANTS)
    if unknown:
        ap.error(f"unknown variants {sorted(unknown)}: choose from {', '.join(VARIANTS)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda but torch sees no CUDA device; use --smoke (CPU)")
    return args


def measure(args: argparse.Namespace, device: torch.device) -> dict[str, dict]:
    """Every variant of ``args.variants``, eager and compiled, in interleaved rounds on the
    process group that is up; one row per (variant, mode), keyed ``"variant.mode"``."""
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = PRESETS[args.preset]
    g = torch.Generator().manual_seed(rank)
    idx = torch.randint(cfg.vocab_size, (args.batch, cfg.seq_len), generator=g).to(device)
    steps: dict[tuple[str, str], object] = {}
    for v in args.variants:
        model, opt, gpt = build(v, args.preset, device)
        if v == "aligndp_none_blocks":
            for name, block in list(gpt.blocks.named_children()):
                gpt.blocks.register_module(name, torch.compile(block, backend=args.backend))
            steps[(v, "compiled")] = step_fn(model, opt, idx, device)
            continue
        steps[(v, "eager")] = step_fn(model, opt, idx, device)
        compiled = torch.compile(model, backend=args.backend)
        steps[(v, "compiled")] = step_fn(compiled, opt, idx, device)
    t0 = time.perf_counter()
    for step in steps.values():  # compiles here, outside the timing
        for _ in range(args.warmup):
            step()
    sync(device)
    args.warmup_s = time.perf_counter() - t0
    times: dict[tuple[str, str], list[float]] = {k: [] for k in steps}
    for r in range(args.rounds):
        order = list(steps) if r % 2 == 0 else list(reversed(steps))
        for key in order:
            times[key].append(timed(steps[key], args.steps, device))
    hooks = {key: profiled_hook_ms(step, args.profile_steps, device) for key, step in steps.items()}
    ms = {key: statistics.median(t) * 1e3 for key, t in times.items()}
    result = {}
    for (v, mode), value in ms.items():
        row = {
            "preset": args.preset,
            "dp": world,
            "variant": v,
            "mode": mode,
            "ms_per_step": round(value, 3),
            "rounds_ms": [round(t * 1e3, 3) for t in times[(v, mode)]],
            "hook_host_ms_per_step": round(hooks[(v, mode)], 3),
        }
        for peer in ("torch", "torch_ddp"):
            if (peer, mode) in ms:
                row[f"vs_{peer}"] = round(value / ms[(peer, mode)], 4)
        result[f"{v}.{mode}"] = row
    return result


def print_table(args: argparse.Namespace, result: dict[str, dict], world: int) -> None:
    cfg = PRESETS[args.preset]
    print(
        f"\n{args.preset}, dp {world}, batch {args.batch}x{cfg.seq_len}, {args.device}, "
        f"backend {args.backend}; warm-up with compiles {args.warmup_s:.1f} s"
    )
    print("| variant | mode | ms/step | / plain torch | / torch DDP | hook host ms/step |")
    print("|---|---|---|---|---|---|")
    for row in result.values():
        print(
            f"| {row['variant']} | {row['mode']} | {row['ms_per_step']:.2f} | "
            f"{row.get('vs_torch', float('nan')):.3f} | "
            f"{row.get('vs_torch_ddp', float('nan')):.3f} | "
            f"{row['hook_host_ms_per_step']:.2f} |",
            flush=True,
        )


# ---- benchmarks/run_all.py's rows ----

COMPILE_KEYS = ("compile.vs_torch_ddp", "compile.blocks_vs_torch_ddp", "compile.hooks_ms")


def compile_section(ctx) -> list[Row]:
    """compile_step.py at gpt2-small on every rank (inductor; its CPU check is
    ``compile_step.py --smoke``, run by tests/test_compile_step_smoke.py)."""
    if ctx.device.type != "cuda":
        why = "needs CUDA (inductor); the CPU check is compile_step.py --smoke"
        return [Row(k, skipped=why) for k in COMPILE_KEYS]
    args = parse_args(
        ["--preset", "gpt2-small", "--variants", "torch,torch_ddp,aligndp_none,aligndp_none_blocks"]
    )
    result = measure(args, ctx.device)
    gc.collect()
    torch.cuda.empty_cache()  # the variants' models and optimizers are gone
    peer = result["torch_ddp.compiled"]
    note = (
        f"dp {dist.get_world_size()}, plain torch compiled "
        f"{result['torch.compiled']['ms_per_step']:.2f} ms"
    )
    # key -> (aligndp variant, figure, what the peer is)
    rows = {
        "compile.vs_torch_ddp": ("aligndp_none", "ms_per_step", "torch DDP + compile, ms"),
        "compile.blocks_vs_torch_ddp": (
            "aligndp_none_blocks",
            "ms_per_step",
            "torch DDP + compile, ms",
        ),
        "compile.hooks_ms": ("aligndp_none", "hook_host_ms_per_step", "torch DDP's reducer, ms"),
    }
    return [
        Row(
            key,
            result[f"{variant}.compiled"][figure],
            "ms",
            peer[figure],
            peer_what,
            Goal("<=", 1.0, "ratio"),
            note=note,
        )
        for key, (variant, figure, peer_what) in rows.items()
    ]


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    device = init(args.device)
    if args.device == "cpu":
        torch.set_num_threads(1)
    result = measure(args, device)
    if dist.get_rank() == 0:
        for row in result.values():
            print(json.dumps(row), flush=True)
        print_table(args, result, dist.get_world_size())
    dist.destroy_process_group()
    return result


if __name__ == "__main__":
    main()
