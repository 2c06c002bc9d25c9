"""Where does the ZeRO-1 step's time go? Per-kernel GPU time of full training steps (forward,
backward, reduction, AdamW, param all-gather) on every rank, against DDP + fused AdamW.

    torchrun --nproc-per-node 2 benchmarks/profile_zero1.py --out DIR [--preset 1b --batch 8]

Variants (each on a freshly built model, stepped back to back as ``zero1_step.py`` times them,
``--steps`` steps profiled after warm-up):

- ``torch_adamw``: torch DDP (bf16 grads, gradient_as_bucket_view) + ``AdamW(fused=True)``,
  the issue's peer;
- ``ddp_adamw``: aligndp ``parallelize(sharding="none", fused=True)``;
- ``zero1``: aligndp ``parallelize(sharding="zero1", overlap_param_gather=True, fused=True)``.

Rank 0 writes ``DIR/summary.json`` (every rank: wall ms per step, kernel ms per step by class
— GEMM, attention, optimizer, NCCL, memcpy, other — and per kernel) and prints, per rank, how
``zero1`` differs from each of the other two by class, and the compute kernels that grew most.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
from _bench import build_gpt, init
from profile_ddp import growth, print_growth, profile_steps, write_summary
from zero1_step import torch_ddp_adamw

import aligndp
from aligndp.models.gpt import PRESETS

VARIANTS = ("torch_adamw", "ddp_adamw", "zero1")


def make_step(variant: str, model: nn.Module, idx: torch.Tensor, bucket_numel: int):
    """``(step, cleanup)`` for one variant on ``model``."""
    if variant == "torch_adamw":
        return torch_ddp_adamw(model, idx)[0], lambda: None
    ours, opt = aligndp.parallelize(
        model,
        sharding="zero1" if variant == "zero1" else "none",
        lr=1e-4,
        bucket_numel=bucket_numel,
        overlap_param_gather=variant == "zero1",
        fused=True,
    )

    def step() -> None:
        ours(idx, idx).backward()
        opt.step()
        opt.zero_grad()

    def cleanup() -> None:
        opt.gather.wait_all()
        ours.remove_hooks()
        opt.gather.remove_hooks()

    return step, cleanup


def profile_variant(variant: str, args, device, dtype) -> dict:
    cfg = PRESETS[args.preset]
    gen = torch.Generator(device=device).manual_seed(1 + dist.get_rank())
    idx = torch.randint(0, cfg.vocab_size, (args.batch, cfg.seq_len), device=device, generator=gen)
    model = build_gpt(args.preset, device, dtype)
    step, cleanup = make_step(variant, model, idx, args.bucket_numel)
    try:
        return profile_steps(step, steps=args.steps, warmup=3)
    finally:
        cleanup()
        del model, step
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="1b")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--bucket-numel", type=int, default=40_000_000)
    ap.add_argument("--steps", type=int, default=4, help="profiled steps per variant")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    device, dtype = init("cuda")
    mine = {v: profile_variant(v, args, device, dtype) for v in VARIANTS}
    ranks: list = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    if dist.get_rank() == 0:
        summary: dict = {"preset": args.preset, "batch": args.batch, "steps": args.steps,
                         "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                         "ranks": []}  # fmt: skip
        for rank, res in enumerate(ranks):
            entry = {v: {k: r[k] for k in ("wall_ms", "by_class")} for v, r in res.items()}
            for peer in ("torch_adamw", "ddp_adamw"):
                entry["zero1"][f"vs_{peer}"] = growth(res["zero1"], res[peer], top=8)
            summary["ranks"].append(entry)
            print(f"== rank {rank}")
            for v in VARIANTS:
                print(f"  {v}: wall {entry[v]['wall_ms']} ms/step, by class {entry[v]['by_class']}")
            for peer in ("torch_adamw", "ddp_adamw"):
                print_growth(f"zero1 - {peer}", entry["zero1"][f"vs_{peer}"], top=4)
        write_summary(args.out, summary)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
