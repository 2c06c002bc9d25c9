r"""DDP step time against torch DDP, each as step / local fwd+bwd, measured in one run.

GPU (the figure we report):
    torchrun --nproc-per-node 2 benchmarks/ddp_step.py --preset 1b --batch 8
A/B of aligndp's collectives backends (NCCL kernels vs copy engines on symmetric memory):
    torchrun --nproc-per-node 2 benchmarks/ddp_step.py --preset 1b --collectives symm-mem
CPU smoke run (gloo):
    torchrun --nproc-per-node 2 benchmarks/ddp_step.py \
        --preset demo --device cpu --batch 4 --iters 2

Prints one JSON object per measurement on rank 0. "step" is forward + backward + every
gradient collective finished (torch DDP finishes inside backward; aligndp in
``finish_grad_sync``), so both numbers cover the same work. The baseline "local" is the
slowest rank's median fwd+bwd: ranks meet in every collective, so no data-parallel step can
beat it, and rank 0's own figure would count a slower peer GPU as communication overhead.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch
import torch.distributed as dist
import torch.nn as nn
from _bench import (
    Timing,
    add_common_arguments,
    build_gpt,
    device_label,
    every_rank,
    init,
    log,
)

import aligndp
from aligndp.models.gpt import PRESETS
from aligndp.runtime.ddp import DataParallel, DDPConfig


def fwdbwd(model: nn.Module, idx: torch.Tensor) -> None:
    """One local forward + backward on ``idx`` (tokens as their own targets)."""
    model(idx, idx).backward()


def local_fwdbwd(model: nn.Module, idx: torch.Tensor, timing: Timing) -> list[float]:
    """Every rank's seconds of one local fwd+bwd, no communication (a DP step's lower bound
    is the slowest of them: ranks meet in every collective)."""
    return every_rank(timing(lambda: fwdbwd(model, idx)), timing.device)


def torch_ddp_step(
    model: nn.Module, idx: torch.Tensor, timing: Timing, *, bucket_cap_mb: float
) -> float:
    """Seconds per torch DDP fwd+bwd (its all-reduces finish inside backward)."""
    ddp = nn.parallel.DistributedDataParallel(
        model, bucket_cap_mb=bucket_cap_mb, gradient_as_bucket_view=True
    )
    return timing(lambda: fwdbwd(ddp, idx))


@dataclasses.dataclass(frozen=True)
class AligndpStep:
    """One aligndp DDP measurement."""

    seconds: float
    bucket_numels: list[int]
    """Elements of every bucket of the first gradient buffer (one collective each)."""
    padding_fraction: float


def aligndp_ddp_step(
    model: nn.Module,
    idx: torch.Tensor,
    timing: Timing,
    *,
    bucket_numel: int,
    overlap: bool = True,
    process_group: dist.ProcessGroup | None = None,
    no_comm: bool = False,
    collectives: str = "torch",
) -> AligndpStep:
    """Seconds per aligndp step: zero_grad_buffer + fwd+bwd + finish_grad_sync. ``model`` is
    wrapped here and unwrapped (hooks removed) before returning."""
    ours = DataParallel(
        model,
        process_group=process_group,
        config=DDPConfig(bucket_numel=bucket_numel, overlap=overlap, collectives=collectives),
    )
    if no_comm:
        ours.dp_size = 1  # benchmark-only: skip the collectives, keep hooks and copies

    def step() -> None:
        ours.zero_grad_buffer()
        fwdbwd(ours, idx)
        ours.finish_grad_sync()

    try:
        seconds = timing(step)
        layout = ours.layouts[0]
        return AligndpStep(seconds, [b.numel for b in layout.buckets], layout.padding_fraction)
    finally:
        ours.remove_hooks()


def main() -> None:
    ap = argparse.ArgumentParser()
    add_common_arguments(ap)
    ap.add_argument("--batch", type=int, default=8, help="sequences per GPU")
    ap.add_argument(
        "--buckets",
        default="10000000,40000000,100000000",
        help="aligndp bucket_numel values to try",
    )
    ap.add_argument("--torch-bucket-mb", default="25,100")
    ap.add_argument(
        "--max-ctas",
        default="",
        help="also try NCCL communicators capped at these CTA counts, e.g. 4,8",
    )
    ap.add_argument(
        "--high-priority",
        action="store_true",
        help="also try NCCL communicators on a high-priority stream "
        "(with each --max-ctas and uncapped)",
    )
    ap.add_argument(
        "--no-comm",
        action="store_true",
        help="also time aligndp with collectives skipped (hook cost)",
    )
    ap.add_argument(
        "--collectives",
        default="torch",
        help="aligndp's collectives backend for every aligndp run: torch (NCCL), or symm-mem "
        "(the copy-engine experiment of symm_mem_collectives.py; NCCL on CUDA only)",
    )
    args = ap.parse_args()

    if args.collectives == "symm-mem":  # the copy-engine experiment, registered as a script does
        from symm_mem_collectives import SymmMemCollectives

        aligndp.register_collectives(SymmMemCollectives.name, SymmMemCollectives)
    device, dtype = init(args.device)
    cuda = device.type == "cuda"
    timing = Timing(device, args.iters, args.warmup)
    cfg = PRESETS[args.preset]
    log(
        what="env",
        torch=torch.__version__,
        world_size=dist.get_world_size(),
        device=device_label(device),
        preset=args.preset,
        batch=args.batch,
        collectives=args.collectives,
        seq_len=cfg.seq_len,
    )

    idx = torch.randint(0, cfg.vocab_size, (args.batch, cfg.seq_len), device=device)
    model = build_gpt(args.preset, device, dtype)
    nparams = sum(p.numel() for p in model.parameters())
    per_rank = local_fwdbwd(model, idx, timing)
    t_local = max(per_rank)
    log(
        what="local",
        params=nparams,
        fwdbwd_ms=t_local * 1e3,
        per_rank_ms=[x * 1e3 for x in per_rank],
    )

    for mb in [float(x) for x in args.torch_bucket_mb.split(",")]:
        t = torch_ddp_step(model, idx, timing, bucket_cap_mb=mb)
        log(what="torch_ddp", bucket_cap_mb=mb, step_ms=t * 1e3, overhead=t / t_local)
    del model

    groups: list[tuple[str, dist.ProcessGroup | None]] = [("default", None)]
    for high_priority in (False, True) if args.high_priority else (False,):
        for ctas in [0] + [int(x) for x in args.max_ctas.split(",") if x]:
            if not (ctas or high_priority):
                continue
            opts = dist.ProcessGroupNCCL.Options(is_high_priority_stream=high_priority)
            if ctas:
                opts.config.max_ctas = ctas
            name = f"high_priority={high_priority},max_ctas={ctas or 'default'}"
            groups.append((name, dist.new_group(backend="nccl", pg_options=opts)))
    sizes = [int(x) for x in args.buckets.split(",")]
    variants = [(sizes[0], overlap, "default", None, False) for overlap in (True, False)]
    variants += [(numel, True, name, group, False) for name, group in groups[1:] for numel in sizes]
    if args.no_comm:
        variants.append((int(args.buckets.split(",")[0]), True, "default", None, True))
    for numel, overlap, name, group, no_comm in variants:
        r = aligndp_ddp_step(
            build_gpt(args.preset, device, dtype),
            idx,
            timing,
            bucket_numel=numel,
            overlap=overlap,
            process_group=group,
            no_comm=no_comm,
            collectives=args.collectives,
        )
        log(
            what="aligndp_ddp",
            bucket_numel=numel,
            overlap=overlap,
            group=name,
            collectives=args.collectives,
            no_comm=no_comm,
            buckets=len(r.bucket_numels),
            padding_fraction=r.padding_fraction,
            step_ms=r.seconds * 1e3,
            overhead=r.seconds / t_local,
        )
        if cuda:
            torch.cuda.empty_cache()
    model = build_gpt(args.preset, device, dtype)
    again = local_fwdbwd(model, idx, timing)
    log(what="local_again", per_rank_ms=[x * 1e3 for x in again])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
