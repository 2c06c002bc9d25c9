r"""Host time of ``opt.step()`` and ``opt.zero_grad()`` under ZeRO-1: what the optimizer side of a
step costs the CPU, the figure a change of its structure must not raise.

    torchrun --nproc-per-node 2 benchmarks/optimizer_step_host.py --preset gpt2-small
    torchrun --nproc-per-node 2 benchmarks/optimizer_step_host.py --device cpu --preset demo

Each timed iteration runs forward and backward, waits for the device, then times
``opt.step()`` (on CUDA its kernels are queued, so the figure is the host's share; the
overlapped param gathers are launched, not waited for) and ``opt.zero_grad()``; the median
over ``--iters`` after ``--warmup``, every rank's, the slowest reported. One JSON line per
``overlap_param_gather`` setting. To compare two trees, run it with ``PYTHONPATH`` at each.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from _bench import add_common_arguments, build_gpt, device_label, every_rank, init, log, sync

import aligndp


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_arguments(ap)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--bucket-numel", type=int, default=40_000_000)
    ap.add_argument("--label", default="", help="named in the output (e.g. the tree measured)")
    args = ap.parse_args()
    device, dtype = init(args.device)
    for overlap in (False, True):
        model, opt = aligndp.parallelize(
            build_gpt(args.preset, device, dtype),
            sharding="zero1",
            lr=1e-4,
            bucket_numel=args.bucket_numel,
            overlap_param_gather=overlap,
        )
        cfg = model.module.cfg
        gen = torch.Generator().manual_seed(dist.get_rank())
        shape = (args.batch, min(args.seq, cfg.seq_len))
        idx = torch.randint(cfg.vocab_size, shape, generator=gen).to(device)
        step_ms, zero_ms = [], []
        for i in range(args.warmup + args.iters):
            logits = model(idx)
            logits.float().square().mean().backward()
            sync(device)
            t0 = time.perf_counter()
            opt.step()
            t1 = time.perf_counter()
            opt.zero_grad()
            t2 = time.perf_counter()
            sync(device)
            if i >= args.warmup:
                step_ms.append((t1 - t0) * 1e3)
                zero_ms.append((t2 - t1) * 1e3)
        steps = every_rank(statistics.median(step_ms), device)
        zeros = every_rank(statistics.median(zero_ms), device)
        log(
            label=args.label,
            preset=args.preset,
            device=device_label(device),
            ranks=dist.get_world_size(),
            overlap_param_gather=overlap,
            step_host_ms=round(max(steps), 3),
            zero_grad_host_ms=round(max(zeros), 3),
        )
        del model, opt
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
