"""Where does the DDP overhead go? Kernel timelines of one aligndp step, with and without comm.

    torchrun --nproc-per-node 2 benchmarks/profile_ddp.py --out DIR

Writes, on rank 0, ``DIR/summary.json``: per variant, the step's wall span, summed kernel time
by class (GEMM, NCCL, elementwise/other), and when the last NCCL kernel ends relative to the
last compute kernel — which separates "comm exposed after backward" from "compute slowed by
comm running beside it".
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from aligndp.models.gpt import GPT, PRESETS
from aligndp.runtime.ddp import DataParallel, DDPConfig


def classify(name: str) -> str:
    n = name.lower()
    if "nccl" in n:
        return "nccl"
    if "gemm" in n or "cutlass" in n or "sm90" in n or "nvjet" in n or "xmma" in n:
        return "gemm"
    if "flash" in n or "attention" in n or "fmha" in n:
        return "attention"
    return "other"


def summarize(prof) -> dict:
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    spans = [(e.time_range.start, e.time_range.end, classify(e.name)) for e in kernels]
    if not spans:
        return {}
    start = min(s for s, _, _ in spans)
    by_class: dict[str, float] = {}
    for s, e, c in spans:
        by_class[c] = by_class.get(c, 0.0) + (e - s) / 1e3
    compute_end = max(e for s, e, c in spans if c != "nccl")
    nccl = [(s, e) for s, e, c in spans if c == "nccl"]
    out = {
        "span_ms": (max(e for _, e, _ in spans) - start) / 1e3,
        "kernel_ms_by_class": by_class,
        "compute_end_ms": (compute_end - start) / 1e3,
    }
    if nccl:
        out["nccl_first_start_ms"] = (min(s for s, _ in nccl) - start) / 1e3
        out["nccl_last_end_ms"] = (max(e for _, e in nccl) - start) / 1e3
        out["nccl_after_compute_ms"] = (max(e for _, e in nccl) - compute_end) / 1e3
        out["nccl_kernels"] = len(nccl)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="1b")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dist.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    cfg = PRESETS[args.preset]
    torch.manual_seed(0)
    model = GPT(cfg).cuda().to(torch.bfloat16)
    idx = torch.randint(0, cfg.vocab_size, (args.batch, cfg.seq_len), device="cuda")
    ours = DataParallel(model, config=DDPConfig(bucket_numel=40_000_000))
    results = {}
    for variant in ("overlap", "no_comm", "no_overlap"):
        ours.dp_size = 1 if variant == "no_comm" else dist.get_world_size()  # benchmark-only switch
        ours.config = DDPConfig(bucket_numel=40_000_000, overlap=variant != "no_overlap")

        def step() -> None:
            ours.zero_grad_buffer()
            ours(idx, idx).backward()
            ours.finish_grad_sync()

        for _ in range(3):
            step()
        torch.cuda.synchronize()
        dist.barrier()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        results[variant] = summarize(prof)
        if variant == "overlap" and dist.get_rank() == 0:
            os.makedirs(args.out, exist_ok=True)
            prof.export_chrome_trace(os.path.join(args.out, "trace_overlap.json"))
    if dist.get_rank() == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "summary.json"), "w") as f:
            json.dump(results, f, indent=1)
        print(json.dumps(results, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
