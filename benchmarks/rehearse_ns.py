"""The ``calibrate`` and ``ns`` stages of benchmarks/rehearse_table.py: Newton–Schulz balance of
layer-wise Muon measured on this device, with the plan balanced by each cost model
([Note: Newton–Schulz device cost] in aligndp/optim/ns_cost.py)."""

from __future__ import annotations

import dataclasses
import os
import time

import torch

from aligndp.app.rehearse import RehearsalOptions, plan_layouts, rehearse
from aligndp.app.rehearse_cost import ns_part_seconds, rank_ns_parts
from aligndp.optim.ns_cost import FLOPS_NS_COST, NewtonSchulzCost, ns_cost_for
from aligndp.plan.spec import Mode, max_over_mean

NS_PRESETS = ("1b", "gpt2-small")
GOALS = {"1b": 1.05, "gpt2-small": 1.10}
"""Issue 41's goals of the measured max / mean at D = 64."""


def calibrate_stage(args, log) -> dict:
    """Fit this device's cost on the presets' part shapes (benchmarks/ns_calibrate.py)."""
    from ns_calibrate import calibrate

    path = os.path.join(args.out, f"ns_calibrate_{args.device}.jsonl")
    with open(path, "w") as out:
        cost, rows = calibrate(
            args.device, list(args.ns_presets), [8, 16, 32, 64, 128, 256, 512, 1024],
            repeats=args.ns_repeats, max_madds=None, out=out,
        )  # fmt: skip
    ratios = [r["fit_over_measured"] for r in rows]
    row = {
        "table": "calibrate", "device": args.device_name, "fit": dataclasses.asdict(cost),
        "tflops": 2 / cost.s_per_madd / 1e12, "shapes": len(rows),
        "fit_over_measured": [min(ratios), max(ratios)],
    }  # fmt: skip
    log(args.out, row)
    return row


def load_calibration(path: str) -> dict:
    """The fit line of a benchmarks/ns_calibrate.py JSONL file, as :func:`calibrate_stage`
    returns it."""
    import json

    with open(path) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    fit = next(x for x in reversed(lines) if "fit" in x)
    shapes = [x for x in lines if "m" in x]
    return {
        "table": "calibrate", "fit": fit["fit"], "tflops": fit["tflops"], "shapes": len(shapes),
        "fit_over_measured": fit["fit_over_measured"], "file": path,
    }  # fmt: skip


def fitted_cost(calibrated: dict | None) -> NewtonSchulzCost | None:
    return NewtonSchulzCost(**calibrated["fit"]) if calibrated else None


def _modelled(layouts, cost: NewtonSchulzCost) -> float:
    loads = None
    for lo in layouts:
        if lo.mode is Mode.LAYERWISE:
            mine = [sum(cost.seconds(*p) for p in parts) for parts in rank_ns_parts(lo)]
            loads = mine if loads is None else [a + b for a, b in zip(loads, mine)]
    return max_over_mean(loads or [])


def ns_rows(args, log, fitted: NewtonSchulzCost | None) -> list[dict]:
    """Layer-wise Muon at D = 64 on each preset, every rank's Newton–Schulz measured, the plan
    balanced by the flops model, the device's shipped cost and (when given) the fitted one."""
    costs = {"flops": FLOPS_NS_COST, "shipped": ns_cost_for(args.device)}
    if fitted is not None:
        costs["recalibrated"] = fitted
    judge = fitted or ns_cost_for(args.device)
    rows = []
    for preset in args.ns_presets:
        for name, cost in costs.items():
            options = RehearsalOptions(
                preset=preset, dp_size=64, ranks=None, sharding="zero1", optimizer="muon",
                sample=args.ns_sample, batch_size=args.batch, autocast=args.device == "cuda",
                device=args.device, steps=args.steps, ns_repeats=args.ns_repeats, ns_cost=cost,
            )  # fmt: skip
            t0 = time.perf_counter()
            layouts = plan_layouts(options)
            wise = [lo for lo in layouts if lo.mode is Mode.LAYERWISE]
            result = rehearse(options)
            ns = [r.ns_seconds or 0.0 for r in result.ranks]
            slow = max(result.ranks, key=lambda r: r.ns_seconds or 0.0)
            ran = {r.rank: r.seconds for r in result.ranks if r.ran}
            step = ran.get(slow.rank)
            largest = max(
                (p for lo in wise for p in lo.params if len(p.shape) == 2),
                key=lambda p: FLOPS_NS_COST.whole_cost(p.shape),
            )
            m, n = sorted(largest.shape)
            row = {
                "table": "ns", "preset": preset, "dp": 64, "plan_cost": name,
                "cost": dataclasses.asdict(cost),
                "splits": sum(len(lo.splits) for lo in wise),
                "parts": sum(len(parts) for lo in wise for parts in rank_ns_parts(lo)),
                "planned": _planned(wise),
                "modelled_by_fit": _modelled(layouts, judge),
                "measured": result.ns_max_over_mean, "ns_max_ms": max(ns) * 1e3,
                "ns_mean_ms": sum(ns) / len(ns) * 1e3, "slowest_rank": slow.rank,
                "largest": [m, n], "largest_ms": ns_part_seconds(
                    m, n, m, device=torch.device(args.device), repeats=args.ns_repeats
                ) * 1e3,
                "slowest_step": step, "goal": GOALS.get(preset),
                "wall_s": time.perf_counter() - t0, "sampled": result.sampled,
            }  # fmt: skip
            rows.append(row)
            log(args.out, row)
    return rows


def _planned(layouts) -> float:
    """The plan's own max / mean (in the units of the cost it was balanced by)."""
    loads = [1.0]
    first = True
    for lo in layouts:
        mine = lo.rank_costs()
        loads = mine if first else [a + b for a, b in zip(loads, mine)]
        first = False
    return max_over_mean(loads)


def ns_markdown(calibrated: dict | None, rows: list[dict], args) -> list[str]:
    lines = [f"## Recalibrated: Newton-Schulz balance at D = 64 on {args.device_name}", ""]
    if calibrated is not None:
        fit = calibrated["fit"]
        lines += [
            f"Fitted on {calibrated['shapes']} part shapes (`ns_calibrate_{args.device}.jsonl`):"
            f" `NewtonSchulzCost(fixed_s={fit['fixed_s']:.3e}, s_per_madd="
            f"{fit['s_per_madd']:.4e})` ({fit['fixed_s'] * 1e6:.1f} us per part per iteration,"
            f" {calibrated['tflops']:.3f} TFLOP/s); fitted / measured "
            f"{calibrated['fit_over_measured'][0]:.2f}-{calibrated['fit_over_measured'][1]:.2f}.",
            "",
        ]
    lines += [
        "| preset | plan balanced by | splits | parts | planned max/mean | by the fit "
        "| **measured max/mean** | goal | NS max ms | NS mean ms | largest matrix ms "
        "| slowest rank opt / (fwd + bwd) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        step = r["slowest_step"]
        share = "-"
        if step:
            share = f"{step['optimizer'] / (step['forward'] + step['backward']):.3f}"
        m, n = r["largest"]
        lines.append(
            f"| {r['preset']} | {r['plan_cost']} | {r['splits']} | {r['parts']} "
            f"| {r['planned']:.3f} | {r['modelled_by_fit']:.3f} | **{r['measured']:.3f}** "
            f"| {r['goal'] or '-'} | {r['ns_max_ms']:.2f} | {r['ns_mean_ms']:.2f} "
            f"| {r['largest_ms']:.2f} ({m}x{n}) | {share} |"
        )
    return lines
