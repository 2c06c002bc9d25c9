"""DDP step time against torch DDP, each as step / local fwd+bwd, measured in one run.

GPU (the figure we report):
    torchrun --nproc-per-node 2 benchmarks/ddp_step.py --preset 1b --batch 8
CPU smoke run (gloo):
    torchrun --nproc-per-node 2 benchmarks/ddp_step.py --preset demo --device cpu --batch 4 --iters 2

Prints one JSON object per measurement on rank 0. "step" is forward + backward + every
gradient collective finished (torch DDP finishes inside backward; aligndp in
``finish_grad_sync``), so both numbers cover the same work. The baseline "local" is the
slowest rank's median fwd+bwd: ranks meet in every collective, so no data-parallel step can
beat it, and rank 0's own figure would count a slower peer GPU as communication overhead.
"""
from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn as nn

from _bench import add_common_arguments, device_label, every_rank, init, log, timed
from aligndp.ddp import DataParallel, DDPConfig
from aligndp.models.gpt import GPT, PRESETS


def main() -> None:
    ap = argparse.ArgumentParser()
    add_common_arguments(ap)
    ap.add_argument("--batch", type=int, default=8, help="sequences per GPU")
    ap.add_argument("--buckets", default="10000000,40000000,100000000", help="aligndp bucket_numel values to try")
    ap.add_argument("--torch-bucket-mb", default="25,100")
    ap.add_argument("--max-ctas", default="", help="also try NCCL communicators capped at these CTA counts, e.g. 4,8")
    ap.add_argument("--high-priority", action="store_true",
                    help="also try NCCL communicators on a high-priority stream (with each --max-ctas and uncapped)")
    ap.add_argument("--no-comm", action="store_true", help="also time aligndp with collectives skipped (hook cost)")
    args = ap.parse_args()

    device, dtype = init(args.device)
    cuda = device.type == "cuda"
    cfg = PRESETS[args.preset]
    log(what="env", torch=torch.__version__, world_size=dist.get_world_size(), device=device_label(device),
        preset=args.preset, batch=args.batch, seq_len=cfg.seq_len)

    def make() -> nn.Module:
        torch.manual_seed(0)
        return GPT(cfg).to(device=device, dtype=dtype)

    idx = torch.randint(0, cfg.vocab_size, (args.batch, cfg.seq_len), device=device)

    def fwdbwd(m: nn.Module) -> None:
        m(idx, idx).backward()

    model = make()
    nparams = sum(p.numel() for p in model.parameters())
    per_rank = every_rank(timed(lambda: fwdbwd(model), device=device, iters=args.iters, warmup=args.warmup), device)
    # the baseline is the slowest rank's local fwd+bwd: ranks meet in every collective
    t_local = max(per_rank)
    log(what="local", params=nparams, fwdbwd_ms=t_local * 1e3, per_rank_ms=[x * 1e3 for x in per_rank])

    for mb in [float(x) for x in args.torch_bucket_mb.split(",")]:
        ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=mb, gradient_as_bucket_view=True)
        t = timed(lambda: fwdbwd(ddp), device=device, iters=args.iters, warmup=args.warmup)
        log(what="torch_ddp", bucket_cap_mb=mb, step_ms=t * 1e3, overhead=t / t_local)
        del ddp
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
        ours = DataParallel(make(), process_group=group, config=DDPConfig(bucket_numel=numel, overlap=overlap))
        if no_comm:
            ours.dp_size = 1  # benchmark-only: skip the collectives, keep hooks and copies

        def step() -> None:
            ours.zero_grad_buffer()
            fwdbwd(ours)
            ours.finish_grad_sync()

        t = timed(step, device=device, iters=args.iters, warmup=args.warmup)
        layout = ours.layouts[0]
        log(what="aligndp_ddp", bucket_numel=numel, overlap=overlap, group=name, no_comm=no_comm,
            buckets=len(layout.buckets), padding_fraction=layout.padding_fraction, step_ms=t * 1e3,
            overhead=t / t_local)
        ours.remove_hooks()
        del ours
        if cuda:
            torch.cuda.empty_cache()
    model = make()
    again = every_rank(timed(lambda: fwdbwd(model), device=device, iters=args.iters, warmup=args.warmup), device)
    log(what="local_again", per_rank_ms=[x * 1e3 for x in again])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
