"""Where does the DDP overhead go? Per-kernel GPU time of aligndp steps with and without
communication, on every rank.

    torchrun --nproc-per-node 2 benchmarks/profile_ddp.py --out DIR [--preset 1b --batch 8]

The same model is wrapped once per variant and stepped back to back (zero_grad_buffer, forward,
backward, finish_grad_sync), as ``ddp_step.py`` times it; ``--steps`` steps are profiled after
warm-up, on every rank at once:

- ``no_comm``: collectives skipped (``dp_size`` forced to 1, benchmark-only): the compute alone.
- ``torch``: NCCL kernels reduce the buckets beside backward (the default backend).
- ``symm-mem``: the copy engines move the bytes; SMs run only the mean and the barriers (the
  experiment of symm_mem_collectives.py).
- ``half-bytes`` (a diagnostic with wrong numerics, never a result): NCCL reduces the first
  half of every bucket only. If the slowdown of compute kernels halves too, it is the bytes
  moved (HBM and NVLink traffic), not the collective's SMs or its launches.

Rank 0 writes ``DIR/summary.json`` with every rank's figures (wall ms per step, kernel ms per
step by class, and per kernel name) and prints, per rank and variant, what grew against
``no_comm``: the kernel classes and the kernels with the largest growth.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import time

import torch
import torch.distributed as dist
from _bench import build_gpt, init
from symm_mem_collectives import SymmMemCollectives
from torch.profiler import ProfilerActivity, profile

import aligndp
from aligndp.models.gpt import PRESETS
from aligndp.runtime.collectives import TorchCollectives
from aligndp.runtime.ddp import DataParallel, DDPConfig

VARIANTS = ("no_comm", "torch", "symm-mem", "half-bytes")


class HalfBytes(TorchCollectives):
    """Diagnostic only: all-reduces the first half of each bucket (the rest stays local)."""

    name = "half-bytes"

    def all_reduce_mean(self, bucket: torch.Tensor):
        return super().all_reduce_mean(bucket[: bucket.numel() // 2])


def classify(name: str) -> str:
    n = name.lower()
    if "nccl" in n:
        return "nccl"
    if "memcpy" in n or "memset" in n:
        return "memcpy"
    if "adam" in n or "multi_tensor" in n:
        return "optimizer"
    if "gemm" in n or "cutlass" in n or "sm90" in n or "nvjet" in n or "xmma" in n:
        return "gemm"
    if "flash" in n or "attention" in n or "fmha" in n:
        return "attention"
    return "other"


def kernel_ms(prof, steps: int) -> dict[str, float]:
    """GPU ms per step of every kernel (and memcpy) name, summed over its launches."""
    per_name: dict[str, float] = collections.defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per_name[e.name[:90]] += (e.time_range.end - e.time_range.start) / 1e3 / steps
    return dict(per_name)


def by_class(kernels: dict[str, float]) -> dict[str, float]:
    out: dict[str, float] = collections.defaultdict(float)
    for name, ms in kernels.items():
        out[classify(name)] += ms
    return {k: round(v, 3) for k, v in sorted(out.items())}


def profile_steps(step, *, steps: int, warmup: int) -> dict:
    """``step()`` ``warmup`` times, then ``steps`` times back to back under the CUDA profiler
    (every rank starts together): wall ms per step, and kernel ms per step by class and by
    kernel name."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t) / steps * 1e3
    kernels = kernel_ms(prof, steps)
    return {"wall_ms": round(wall, 2), "by_class": by_class(kernels), "kernels": kernels}


def print_growth(what: str, g: dict, top: int) -> None:
    """One :func:`growth` result: the wall and class deltas, then the top kernels."""
    print(f"    {what}: wall {g['wall_ms']:+} ms, by class {g['by_class']}")
    for k in g["top_compute_kernels"][:top]:
        print(f"      {k['delta_ms']:+.3f} ms (of {k['base_ms']}) {k['kernel']}")


def write_summary(out_dir: str, summary: dict) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)


def profile_variant(model, idx, variant: str, *, bucket_numel: int, steps: int) -> dict:
    collectives = {"no_comm": "torch", "torch": "torch"}.get(variant, variant)
    ours = DataParallel(model, config=DDPConfig(bucket_numel=bucket_numel, collectives=collectives))
    if variant == "no_comm":
        ours.dp_size = 1  # benchmark-only: skip the collectives, keep hooks and copies

    def step() -> None:
        ours.zero_grad_buffer()
        ours(idx, idx).backward()
        ours.finish_grad_sync()

    try:
        return profile_steps(step, steps=steps, warmup=4)
    finally:
        ours.remove_hooks()


def growth(result: dict, base: dict, top: int) -> dict:
    """What grew against ``base``: per class, and the ``top`` kernels with most growth."""
    classes = set(result["by_class"]) | set(base["by_class"])
    delta_class = {
        c: round(result["by_class"].get(c, 0.0) - base["by_class"].get(c, 0.0), 3)
        for c in sorted(classes)
    }
    names = set(result["kernels"]) | set(base["kernels"])
    deltas = {n: result["kernels"].get(n, 0.0) - base["kernels"].get(n, 0.0) for n in names}
    grown = sorted(
        (n for n in deltas if classify(n) not in ("nccl", "memcpy")),
        key=lambda n: -deltas[n],
    )
    return {
        "wall_ms": round(result["wall_ms"] - base["wall_ms"], 2),
        "by_class": delta_class,
        "top_compute_kernels": [
            {
                "kernel": n,
                "base_ms": round(base["kernels"].get(n, 0.0), 3),
                "delta_ms": round(deltas[n], 3),
            }
            for n in grown[:top]
        ],
    }


def report(rank: int, entry: dict) -> None:
    print(f"== rank {rank}")
    for v, r in entry.items():
        if not (isinstance(r, dict) and "wall_ms" in r):
            continue
        print(f"  {v}: wall {r['wall_ms']} ms/step, kernel ms by class {r['by_class']}")
        if "growth_vs_no_comm" in r:
            print_growth("vs no_comm", r["growth_vs_no_comm"], top=5)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="1b")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--bucket-numel", type=int, default=40_000_000)
    ap.add_argument("--steps", type=int, default=5, help="profiled steps per variant")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    device, dtype = init("cuda")
    aligndp.register_collectives(HalfBytes.name, HalfBytes)
    aligndp.register_collectives(SymmMemCollectives.name, SymmMemCollectives)
    cfg = PRESETS[args.preset]
    model = build_gpt(args.preset, device, dtype)
    idx = torch.randint(0, cfg.vocab_size, (args.batch, cfg.seq_len), device=device)
    mine: dict[str, dict] = {}
    for variant in args.variants.split(","):
        mine[variant] = profile_variant(
            model, idx, variant, bucket_numel=args.bucket_numel, steps=args.steps
        )
    ranks: list = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    if dist.get_rank() == 0:
        summary: dict = {
            "preset": args.preset,
            "batch": args.batch,
            "bucket_numel": args.bucket_numel,
            "steps": args.steps,
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "ranks": [],
        }
        for rank, res in enumerate(ranks):
            entry = {v: {k: r[k] for k in ("wall_ms", "by_class")} for v, r in res.items()}
            if "no_comm" in res:
                for v in res:
                    if v != "no_comm":
                        entry[v]["growth_vs_no_comm"] = growth(res[v], res["no_comm"], top=8)
            entry["kernels_no_comm_top"] = dict(
                sorted(res.get("no_comm", {}).get("kernels", {}).items(), key=lambda kv: -kv[1])[
                    :25
                ]
            )
            summary["ranks"].append(entry)
            report(rank, entry)
        write_summary(args.out, summary)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
