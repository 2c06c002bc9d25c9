"""The rehearsal results file in one command: `aligndp rehearse` on one H200 for D = 8, 64,
512, 1024 and its checks against reality ([Note: rehearsal] in aligndp/app/rehearse.py).

    OUT=/some/dir python benchmarks/rehearse_table.py            # one H200, ~8 minutes
    OUT=/tmp/r python benchmarks/rehearse_table.py --smoke       # CPU, tiny shapes, seconds
    OUT=/some/dir python benchmarks/rehearse_table.py --stages calibrate,ns   # a few minutes
    OUT=/tmp/r python benchmarks/rehearse_table.py --stages ns --device cpu \
        --calibration benchmarks/results/rehearse_ns_2026-12-07/ns_calibrate_cpu.jsonl

``--stages`` picks what runs (default ``scale,8b,d1,gloo``, items 1-4 below; ``calibrate`` and
``ns`` are item 5). Writes ``$OUT/rehearse_<date>.md`` (tables; ``rehearse_ns_<date>.md`` when
only ``calibrate`` and ``ns`` run) and a ``.jsonl`` beside it (one JSON object per row):
1. the 1b preset rehearsed at D = 8, 64, 512, 1024 under DDP, ZeRO-1 (AdamW), layer-wise Muon
   and a 2-D mesh (ZeRO-1 over 8-rank shard groups, D / 8 replicas): fits, peak memory beside
   the plan's, step split, measured Newton–Schulz max / mean, predicted step and tokens/s per
   GPU with and without overlap;
2. the 8b preset, ZeRO-1 at D = 64, bf16 params + autocast, batch 1 x 4096: the peak beside
   the plan plus the activations (measured alone: one forward of the plain model);
3. D = 1: the rehearsed step time beside a real one-rank NCCL step;
4. D = 2 and 4 on one GPU over gloo (NCCL refuses two ranks per GPU): every rank's
   collectives and peak memory beside its rehearsal;
5. ``calibrate``: this device's Newton–Schulz cost fitted (benchmarks/ns_calibrate.py, raw
   timings in ``ns_calibrate_<device>.jsonl``); ``ns``: layer-wise Muon at D = 64 on 1b and
   gpt2-small, every rank's Newton–Schulz measured, with the plan balanced by the flops model,
   by the device's shipped cost and by the cost just fitted ("Recalibrated"), and the largest
   matrix's own time (the floor of the rank that owns it); on a GPU two ranks' steps also run
   (the optimizer's share of forward + backward).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import shutil
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from rehearse_ns import (
    NS_PRESETS,
    calibrate_stage,
    fitted_cost,
    load_calibration,
    ns_markdown,
    ns_rows,
)

from aligndp.app.rehearse import RehearsalOptions, rehearse, rehearse_rank
from aligndp.app.rehearse_probe import UNSTAGED, register_unstaged
from aligndp.app.rehearse_step import measure_step

STAMP = "2026-12-07"
STAGES = ("calibrate", "ns", "scale", "8b", "d1", "gloo")
NAME = {"value": f"rehearse_{STAMP}"}
"""The results' file name without extension (set in main from the stages)."""


def log(out, row: dict) -> None:
    print(json.dumps(row, default=str), flush=True)
    with open(os.path.join(out, f"{NAME['value']}.jsonl"), "a") as f:
        f.write(json.dumps(row, default=str) + "\n")


def table_rows(args) -> list[dict]:
    rows = []
    jobs = {
        "DDP": dict(sharding="none"),
        "ZeRO-1": dict(sharding="zero1"),
        "layer-wise Muon": dict(sharding="zero1", optimizer="muon"),
        "2-D mesh ZeRO-1": dict(sharding="zero1", mesh=True),
    }
    for dp in args.dps:
        for name, kw in jobs.items():
            kw = dict(kw)
            replicas = dp // 8 if kw.pop("mesh", False) and dp >= 16 else 1
            if "mesh" in name and replicas == 1:
                continue
            options = RehearsalOptions(
                preset=args.preset, dp_size=dp, replicas=replicas, ranks=None, sample=2,
                batch_size=args.batch, autocast=args.device == "cuda", device=args.device,
                steps=args.steps, ns_repeats=3, **kw,
            )  # fmt: skip
            t0 = time.perf_counter()
            try:
                result = rehearse(options)
            except torch.OutOfMemoryError as e:  # reported as a row; the table goes on
                row = {"table": "scale", "preset": args.preset, "dp": dp, "job": name}
                rows.append({**row, "error": str(e).splitlines()[0]})
                log(args.out, rows[-1])
                gc.collect()
                torch.cuda.empty_cache()
                continue
            ran = [r for r in result.ranks if r.ran]
            first = ran[0] if ran else result.ranks[0]
            slow = max(result.ranks, key=lambda r: r.predicted.get("overlap_s", 0))
            tokens = args.batch * (options.seq_len or _seq(args.preset))
            row = {
                "table": "scale", "preset": args.preset, "dp": dp, "job": name,
                "replicas": replicas, "fits": all(r.fits for r in result.ranks),
                "peak_gib": (first.peak_allocated or 0) / 2**30,
                "plan_gib": sum(first.analytic.values()) / 2**30,
                "seconds": first.seconds, "ns_max_over_mean": result.ns_max_over_mean,
                "ns_max_ms": max((r.ns_seconds or 0) for r in result.ranks) * 1e3,
                "slowest_rank": slow.rank, "predicted": slow.predicted,
                "tokens_per_s_gpu": (
                    tokens / slow.predicted["overlap_s"] if slow.predicted else None
                ),
                "collectives": len(first.collectives),
                "comm_bytes": sum(c.bytes for c in first.collectives),
                "sampled": result.sampled, "wall_s": time.perf_counter() - t0,
            }  # fmt: skip
            rows.append(row)
            log(args.out, row)
    return rows


def _seq(preset: str) -> int:
    from aligndp.models.gpt import PRESETS

    return PRESETS[preset].seq_len


def activation_bytes(options: RehearsalOptions) -> int:
    """Peak bytes one forward of the plain model adds (the graph kept for backward)."""
    model = options.model(options.device)
    cfg = model.cfg
    x = torch.randint(cfg.vocab_size, (options.batch_size, cfg.seq_len), device=options.device)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(x, x)
    peak = torch.cuda.max_memory_allocated() - base
    del loss, model
    torch.cuda.empty_cache()
    return peak


def big_row(args) -> dict:
    options = RehearsalOptions(
        preset=args.big, dp_size=64, ranks=(0,), sharding="zero1", dtype="bf16",
        autocast=True, batch_size=1, device=args.device, steps=args.steps,
    )  # fmt: skip
    acts = activation_bytes(options) if args.device == "cuda" else 0
    r = rehearse(options).ranks[0]
    plan = sum(r.analytic.values())
    row = {
        "table": "8b", "fits": r.fits, "peak_gib": (r.peak_allocated or 0) / 2**30,
        "reserved_gib": (r.peak_reserved or 0) / 2**30, "plan_gib": plan / 2**30,
        "activations_gib": acts / 2**30,
        "peak_over_plan_plus_acts": (r.peak_allocated or 0) / (plan + acts) if r.ran else None,
        "analytic": r.analytic, "seconds": r.seconds, "predicted": r.predicted,
    }  # fmt: skip
    log(args.out, row)
    return row


def d1_row(args) -> dict:
    """A real one-rank step (NCCL on cuda) beside its rehearsal on the fake group."""
    options = RehearsalOptions(
        preset=args.preset, dp_size=1, sharding="none", batch_size=args.batch,
        autocast=args.device == "cuda", device=args.device, steps=max(args.steps, 5),
    )  # fmt: skip
    backend = "nccl" if args.device == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        real = measure_step(options)
    finally:
        dist.destroy_process_group()
    fake = rehearse_rank(options, 0)
    total = lambda s: s["forward"] + s["backward"] + s["optimizer"]  # noqa: E731
    row = {
        "table": "d1", "real_s": real.seconds, "rehearsed_s": fake.seconds,
        "rehearsed_over_real": total(fake.seconds) / total(real.seconds),
    }  # fmt: skip
    log(args.out, row)
    return row


def _gloo_worker(rank: int, ws: int, init_file: str, options, out: str) -> None:
    if options.device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=ws)
    register_unstaged()  # gloo's staging copies in Work.wait, which NCCL lacks, not counted
    got = measure_step(dataclasses.replace(options, collectives=UNSTAGED))
    with open(os.path.join(out, f"gloo{ws}_{rank}.json"), "w") as f:
        keys = [c.key() for c in got.collectives]
        json.dump({"keys": keys, "peak": got.peak_allocated, "probe": got.probe_peak}, f)
    dist.destroy_process_group()


def gloo_rows(args) -> list[dict]:
    """The workers' files go to a scratch folder, not ``$OUT``: the device tool brings back
    at most 8 files, and the rows below carry what they hold."""
    rows = []
    scratch = tempfile.mkdtemp(prefix="rehearse_gloo_")
    for ws in (2, 4):
        options = RehearsalOptions(
            preset=args.gloo_preset, dp_size=ws, sharding="zero1", batch_size=args.batch,
            autocast=args.device == "cuda", device=args.device, steps=1,
        )  # fmt: skip
        init = os.path.join(scratch, f"rdv{ws}")
        mp.spawn(_gloo_worker, args=(ws, init, options, scratch), nprocs=ws)
        for rank in range(ws):
            with open(os.path.join(scratch, f"gloo{ws}_{rank}.json")) as f:
                real = json.load(f)
            fake = rehearse_rank(options, rank)
            keys = [list(json.loads(json.dumps(c.key()))) for c in fake.collectives]
            row = {
                "table": "gloo", "ws": ws, "rank": rank,
                "collectives_equal": keys == real["keys"], "collectives": len(keys),
                "real_peak_gib": real["peak"] / 2**30,
                "rehearsed_peak_gib": fake.peak_allocated / 2**30,
                "peak_ratio": fake.peak_allocated / real["peak"],
                "probe_peak_ratio": fake.probe_peak / real["probe"],
            }  # fmt: skip
            rows.append(row)
            log(args.out, row)
    shutil.rmtree(scratch, ignore_errors=True)
    return rows


PEERS = """
Published figures for the same model sizes (tokens/s per GPU, measured on real jobs; ours
above are predicted for a job rehearsed on one GPU):

| source | model | GPUs | setting | tokens/s/GPU |
|---|---|---|---|---|
| torchtitan [1], Table 1 | Llama 3.1 8B | 8 H100 | FSDP, bf16, batch 2 x 8192, sel. AC | 5,762 |
| same | Llama 3.1 8B | 8 H100 | FSDP + torch.compile | 6,667 |
| same | Llama 3.1 8B | 8 H100 | FSDP + torch.compile + Float8 | 8,532 |
| NeMo 24.12 (Megatron-core) [2] | Llama 3 8B | 8 H100 | FP8, MBS 1, seq 8192, CP 2 | 12,273 |
| same | GPT3-5B | 64 H100 | FP8, MBS 4, seq 2048 | 23,406 |

No published Megatron-LM or torchtitan figure for a ~1 B model was found; the nearest is
NeMo's GPT3-5B. [1] github.com/pytorch/torchtitan/blob/main/docs/performance.md (Grand Teton:
8 H100 per host over NVLink, 400 Gb/s RDMA per GPU); [2] docs.nvidia.com/nemo-framework/
user-guide/24.12/nemotoolkit/performance/performance_summary.html (pre-training table).
"""


def markdown(scale, big, d1, gloo, args) -> str:
    lines = [
        f"# Rehearsal of a 1,024-GPU job on one {args.device_name} ({STAMP})",
        "",
        f"`python benchmarks/rehearse_table.py` (preset {args.preset}, batch {args.batch} x "
        f"{_seq(args.preset)}, {'bf16 autocast' if args.device == 'cuda' else 'fp32'}); "
        "predicted figures use the default communication model (NVLink 360 GB/s + 10 us "
        "within 8-GPU nodes, InfiniBand 40 GB/s + 25 us across; aligndp/app/rehearse_cost.py).",
        "",
        "| D | job | fits | peak GiB | plan GiB | fwd ms | bwd ms | opt ms | NS max/mean "
        "| NS max ms | opt / (fwd + bwd) | step ms (overlap / none) | tokens/s/GPU |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in scale:
        if "error" in r:
            lines.append(f"| {r['dp']} | {r['job']} | error: {r['error']} |" + " |" * 10)
            continue
        s, p = r["seconds"], r["predicted"]

        def ms(k: str, s: dict = s) -> str:
            return f"{s[k] * 1e3:.1f}" if k in s else "-"

        step = f"{p['overlap_s'] * 1e3:.1f} / {p['no_overlap_s'] * 1e3:.1f}" if p else "-"
        ns = f"{r['ns_max_over_mean']:.3f}" if r["ns_max_over_mean"] else "-"
        tps = f"{r['tokens_per_s_gpu']:,.0f}" if r["tokens_per_s_gpu"] else "-"
        fb = s.get("forward", 0) + s.get("backward", 0)
        share = f"{s['optimizer'] / fb:.3f}" if fb else "-"
        lines.append(
            f"| {r['dp']} | {r['job']} | {'yes' if r['fits'] else 'NO'} | {r['peak_gib']:.2f} "
            f"| {r['plan_gib']:.2f} | {ms('forward')} | {ms('backward')} | {ms('optimizer')} "
            f"| {ns} | {r['ns_max_ms']:.2f} | {share} | {step} | {tps} |"
        )
    if big is not None:
        lines += ["", f"8b preset, ZeRO-1 at D = 64, bf16 params + autocast, batch 1 x 4096: "
              f"fits {big['fits']}, peak {big['peak_gib']:.2f} GiB (reserved "
              f"{big['reserved_gib']:.2f}), plan {big['plan_gib']:.2f} GiB + activations "
              f"{big['activations_gib']:.2f} GiB; peak / (plan + activations) "
              f"{big['peak_over_plan_plus_acts']}"]  # fmt: skip
    if d1 is not None:
        lines += ["", f"D = 1: rehearsed / real step time {d1['rehearsed_over_real']:.4f}"]
    for r in gloo:
        lines.append(
            f"gloo, {r['ws']} ranks on one device, rank {r['rank']}: collectives equal "
            f"{r['collectives_equal']} ({r['collectives']}), peak rehearsed / real "
            f"{r['peak_ratio']:.4f} (device allocator), {r['probe_peak_ratio']:.4f} (live "
            "storage, gloo's staging in Work.wait not counted)"
        )
    return "\n".join(lines) + "\n" + PEERS


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--smoke", action="store_true", help="CPU, tiny presets (a check of the script)"
    )
    ap.add_argument(
        "--stages", default="scale,8b,d1,gloo",
        help=f"comma-separated, any of {', '.join(STAGES)} (default: scale,8b,d1,gloo)",
    )  # fmt: skip
    ap.add_argument(
        "--calibration", default=None,
        help="ns: a benchmarks/ns_calibrate.py JSONL to use as the recalibrated cost "
        "(instead of the calibrate stage)",
    )  # fmt: skip
    ap.add_argument(
        "--ns-presets", default=None,
        help=f"calibrate and ns: presets (default {','.join(NS_PRESETS)}; demo with --smoke)",
    )  # fmt: skip
    ap.add_argument(
        "--ns-sample", type=int, default=None,
        help="ns: ranks whose step runs (default: 2 on cuda, 0 on cpu)",
    )  # fmt: skip
    ap.add_argument("--ns-repeats", type=int, default=3)
    ap.add_argument(
        "--device", dest="device_flag", choices=("cpu", "cuda"), default=None,
        help="default: cuda (cpu with --smoke)",
    )  # fmt: skip
    args = ap.parse_args()
    stages = [x.strip() for x in args.stages.split(",") if x.strip()]
    unknown = sorted(set(stages) - set(STAGES))
    if unknown:
        ap.error(f"--stages: unknown {', '.join(unknown)}; choose from {', '.join(STAGES)}")
    args.out = os.environ.get("OUT", ".")
    os.makedirs(args.out, exist_ok=True)
    if args.smoke:
        args.device, args.preset, args.big, args.gloo_preset = "cpu", "demo", "demo", "demo"
        args.dps, args.batch, args.steps = (8, 64), 1, 1
    else:
        args.device, args.preset, args.big, args.gloo_preset = "cuda", "1b", "8b", "gpt2-small"
        args.dps, args.batch, args.steps = (8, 64, 512, 1024), 4, 3
    if args.device_flag:  # e.g. the calibrate and ns stages on a CPU
        args.device = args.device_flag
    presets = args.ns_presets or ("demo" if args.smoke else ",".join(NS_PRESETS))
    args.ns_presets = [p.strip() for p in presets.split(",") if p.strip()]
    if args.ns_sample is None:
        args.ns_sample = 2 if args.device == "cuda" else 0
    args.device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    only_ns = set(stages) <= {"calibrate", "ns"}
    NAME["value"] = f"rehearse_ns_{STAMP}" if only_ns else f"rehearse_{STAMP}"
    calibrated = load_calibration(args.calibration) if args.calibration else None
    if "calibrate" in stages:
        calibrated = calibrate_stage(args, log)
    ns = ns_rows(args, log, fitted_cost(calibrated)) if "ns" in stages else []
    lines = []
    if not only_ns:
        scale = table_rows(args) if "scale" in stages else []
        big = big_row(args) if "8b" in stages else None
        d1 = d1_row(args) if "d1" in stages else None
        gloo = gloo_rows(args) if "gloo" in stages else []
        lines.append(markdown(scale, big, d1, gloo, args))
    if ns or calibrated:
        lines.append("\n".join(ns_markdown(calibrated, ns, args)) + "\n")
    path = os.path.join(args.out, f"{NAME['value']}.md")
    with open(path, "w") as f:
        f.write("\n".join(lines))
    print(open(path).read())
    return 0


if __name__ == "__main__":
    sys.exit(main())
