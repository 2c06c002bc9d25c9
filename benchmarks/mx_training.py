"""Training step time with MX GEMMs (``--wgrad fp8`` / ``mxfp8``) against plain bf16, one GPU.

The three variants of one model (a key of ``aligndp.models.gpt.PRESETS``) are built side by
side with the public API (``convert_to_mxfp8`` + ``aligndp.parallelize(wgrad=...)``, bf16
autocast, fp32 params and grad buffers, AdamW) and timed in interleaved rounds in one process,
so the host's speed, which matters where Python launches dominate, is the same for all three.
Each round: 2 warm-up steps, then ``--steps`` timed steps on random tokens.
Usage: ``python benchmarks/mx_training.py [--presets gpt2-small,1b] [--batch-size 8] [--out f.md]``;
``--device cpu --wgrad none,mxfp8 --presets demo`` runs the reference backend (a smoke test).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import statistics
import time

import torch
import torch.distributed as dist
from _bench import build_gpt

import aligndp
from aligndp.app.train import TrainConfig
from aligndp.app.train_loop import wgrad_backend
from aligndp.lowp import convert_to_mxfp8
from aligndp.models.gpt import PRESETS


def build(
    preset: str,
    wgrad: str,
    device: torch.device,
    seed: int = 0,
    process_group: dist.ProcessGroup | None = None,
):
    module = build_gpt(preset, device, torch.float32, seed=seed)
    backend = wgrad_backend(TrainConfig(wgrad=wgrad, device=device.type))
    if backend is not None:  # the recipe converts layers (not "none"): every one it can run,
        # whether or not it pays (benchmarks/fp8_step.py measures the default layer rule)
        convert_to_mxfp8(module, backend=backend, layers="all")
    return aligndp.parallelize(
        module,
        optimizer="adamw",
        lr=3e-4,
        wgrad=wgrad,
        process_group=process_group,
    )


def train_step(model, optimizer, x, y, device_type: str) -> torch.Tensor:
    with torch.autocast(device_type, dtype=torch.bfloat16):
        loss = model(x, y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclasses.dataclass(frozen=True)
class StepTimes:
    """Step times of one ``--wgrad`` mode over the interleaved rounds."""

    ms: list[float]
    """Mean ms per step of each round."""
    loss: float
    """Loss of the last step."""

    @property
    def median_ms(self) -> float:
        return statistics.median(self.ms)


def step_times(
    preset: str,
    modes: list[str],
    device: torch.device,
    *,
    batch_size: int,
    rounds: int,
    steps: int,
    process_group: dist.ProcessGroup | None = None,
) -> dict[str, StepTimes]:
    """The ``modes`` of one preset built side by side (on ``process_group``, one rank) and timed in
    ``rounds`` interleaved rounds of 2 warm-up + ``steps`` timed steps each."""
    cfg = PRESETS[preset]
    runs = {m: build(preset, m, device, process_group=process_group) for m in modes}
    gen = torch.Generator().manual_seed(0)
    times, losses = {m: [] for m in modes}, {}
    for _ in range(rounds):
        for m, (model, optimizer) in runs.items():
            batches = [
                torch.randint(cfg.vocab_size, (2, batch_size, cfg.seq_len), generator=gen).to(
                    device
                )
                for _ in range(steps + 2)
            ]
            for x, y in batches[:2]:
                train_step(model, optimizer, x, y, device.type)
            sync(device)
            t0 = time.perf_counter()
            for x, y in batches[2:]:
                losses[m] = train_step(model, optimizer, x, y, device.type)
            sync(device)
            times[m].append((time.perf_counter() - t0) / steps * 1e3)
    return {m: StepTimes(times[m], losses[m].item()) for m in modes}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--presets", default="gpt2-small,1b")
    parser.add_argument("--wgrad", default="none,fp8,mxfp8")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    device = torch.device(args.device)
    modes = args.wgrad.split(",")
    if "none" not in modes:
        raise SystemExit("--wgrad must include none: it is the peer every ratio is taken against")
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1
    )
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    rows = [
        f"# mx_training {datetime.date.today()} on {name}, torch {torch.__version__}",
        "",
        f"batch {args.batch_size} sequences, bf16 autocast, AdamW, 1 rank; median step time of "
        f"{args.rounds} interleaved rounds of {args.steps} steps",
        "",
        "| model | --wgrad | ms/step (min-max) | k tokens/s | step time / bf16 "
        "| loss after the run |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for preset in args.presets.split(","):
        cfg = PRESETS[preset]
        results = step_times(
            preset, modes, device, batch_size=args.batch_size, rounds=args.rounds, steps=args.steps
        )
        base = results["none"].median_ms
        for m, r in results.items():
            rows.append(
                f"| {preset} | {m} | {r.median_ms:.1f} ({min(r.ms):.1f}-{max(r.ms):.1f}) | "
                f"{args.batch_size * cfg.seq_len / r.median_ms:.0f} | {r.median_ms / base:.2f} "
                f"| {r.loss:.3f} |"
            )
            print(rows[-1], flush=True)
        del results
        if device.type == "cuda":
            torch.cuda.empty_cache()
    dist.destroy_process_group()
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
