r"""The ``fp8-tensor`` ZeRO-1 step with bf16 param all-gathers against FP8 ones ([Note: FP8 param
gather] in aligndp/runtime/gather_codec.py), the two models side by side in one process.

GPU (goal, at dp >= 2: the step with FP8 gathers <= 0.97 of the same step with bf16 gathers):
    torchrun --nproc-per-node 2 benchmarks/fp8_gather_step.py --preset 1b --batch 8 \
        [--wgrad-layers all] [--overlap-param-gather] [--profile FILE]
At dp 1 nothing crosses GPUs, so the figure is only the GPU and host work each variant adds or
saves (encode, decode, the layers' own weight quantise). CPU smoke run (gloo):
    torchrun --nproc-per-node 2 benchmarks/fp8_gather_step.py --preset demo --device cpu \
        --batch 2 --iters 2 --rounds 2

JSON lines on rank 0:
  fp8_gather  per variant: all-gather bytes of one step by dtype (uint8: the FP8 payload,
              float32: the amaxes and every other param); then step_ms of both, ratio = fp8 /
              bf16 gathers (goal 0.97), and host_ms (steps issued back to back, to the return
              of the last)
  fp8_gather_profile  --profile: wall ms and GPU ms per kernel class of each variant
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from _bench import (
    Timing,
    add_common_arguments,
    build_gpt,
    device_label,
    every_rank,
    init,
    log,
    sync,
)

import aligndp
from aligndp.lowp import convert_to_mxfp8
from aligndp.models.gpt import PRESETS


def arguments() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    add_common_arguments(ap)
    ap.add_argument(
        "--batch", type=int, default=8, help="sequences per GPU (of the preset's seq_len)"
    )
    ap.add_argument("--bucket-numel", type=int, default=40_000_000)
    ap.add_argument("--wgrad-layers", default="pays", choices=["pays", "all"])
    ap.add_argument("--overlap-param-gather", action="store_true")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    ap.add_argument(
        "--profile",
        metavar="FILE",
        help="CUDA: also profile 3 steps of each variant and write wall ms and per-kernel GPU "
        "ms per step to FILE (JSON)",
    )
    return ap.parse_args()


def gather_bytes(model, step: Callable[[], None]) -> dict[str, int]:
    """Bytes this rank's param all-gathers move in one ``step``, by dtype."""
    moved: dict[str, int] = {}
    collectives = model.param_gather.collectives
    original = collectives.all_gather_shards

    def counting(bucket):
        key = str(bucket.dtype).removeprefix("torch.")
        moved[key] = moved.get(key, 0) + bucket.numel() * bucket.element_size()
        return original(bucket)

    collectives.all_gather_shards = counting
    try:
        step()
    finally:
        del collectives.all_gather_shards
    return moved


def main() -> None:
    """The fp8-tensor ZeRO-1 step with bf16 param gathers against FP8 ones ([Note: FP8 param
    gather]), the two models side by side, timed in ``--rounds`` interleaved rounds."""
    args = arguments()
    device, dtype = init(args.device)
    ws = dist.get_world_size()
    cfg = PRESETS[args.preset]
    gen = torch.Generator(device=device).manual_seed(1 + dist.get_rank())
    idx = torch.randint(0, cfg.vocab_size, (args.batch, cfg.seq_len), device=device, generator=gen)
    timing = Timing(device, args.iters, args.warmup)
    steps, converted = {}, 0
    for fp8 in (False, True):
        module = convert_to_mxfp8(
            build_gpt(args.preset, device, dtype), backend="fp8-tensor", layers=args.wgrad_layers
        )
        ours, opt = aligndp.parallelize(
            module,
            sharding="zero1",
            lr=1e-4,
            bucket_numel=args.bucket_numel,
            wgrad="fp8-tensor",
            fp8_param_gather=fp8,
            overlap_param_gather=args.overlap_param_gather,
            fused=True,
        )

        def step(ours=ours, opt=opt) -> None:
            ours(idx, idx).backward()
            opt.step()
            opt.zero_grad()

        steps[fp8] = step
        moved = gather_bytes(ours, step)
        if fp8:
            converted = sum(b.layout.numel for b in ours.flat_buffers if b.gather_data is not None)
        log(what="fp8_gather", fp8_param_gather=fp8, gather_bytes=moved, bytes=sum(moved.values()))
    log(
        what="env",
        preset=args.preset,
        ws=ws,
        device=device_label(device),
        param_dtype=str(dtype),
        fp8_gathered_elements=converted,
        note=None if ws > 1 else ONE_RANK,
    )
    times: dict[bool, list[float]] = {False: [], True: []}
    issued: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(args.rounds):
        for fp8 in (False, True):
            times[fp8].append(max(every_rank(timing(steps[fp8]), device)))
            issued[fp8].append(issue_ms(steps[fp8], args.iters, device))
    plain_ms, fp8_ms = (statistics.median(times[k]) * 1e3 for k in (False, True))
    log(
        what="fp8_gather",
        param_dtype_gather_ms=plain_ms,
        fp8_gather_ms=fp8_ms,
        ratio=fp8_ms / plain_ms,
        host_ms={str(k): statistics.median(v) for k, v in issued.items()},
        goal=0.97,
        met=fp8_ms / plain_ms <= 0.97 if ws > 1 else None,
        rounds=times,
    )
    if args.profile and device.type == "cuda":
        from profile_ddp import profile_steps

        profiles = {
            f"fp8_param_gather={k}": profile_steps(steps[k], steps=3, warmup=1)
            for k in (False, True)
        }
        for k, prof in profiles.items():
            log(
                what="fp8_gather_profile",
                variant=k,
                wall_ms=prof["wall_ms"],
                by_class=prof["by_class"],
            )
        if dist.get_rank() == 0:
            with open(args.profile, "w") as f:
                json.dump(profiles, f, indent=1)
    dist.destroy_process_group()


ONE_RANK = (
    "dp=1: the gathers move no bytes between GPUs, so this measures only the work each "
    "variant adds or saves on the GPU (encode, decode, the layers' weight quantise); "
    "the goal is for dp >= 2"
)


def issue_ms(step: Callable[[], None], iters: int, device: torch.device) -> float:
    """Host ms per step: ``iters`` steps issued back to back, timed to the return of the last
    (the GPU is synchronised before, not after)."""
    sync(device)
    t = time.perf_counter()
    for _ in range(iters):
        step()
    ms = (time.perf_counter() - t) / iters * 1e3
    sync(device)
    return ms


if __name__ == "__main__":
    main()
