"""Fit a device's Newton–Schulz cost ([Note: Newton–Schulz device cost] in
aligndp/optim/ns_cost.py) from timings of the part shapes the planner makes.

    OMP_NUM_THREADS=1 python benchmarks/ns_calibrate.py --device cpu --out ns_cpu.jsonl
    python benchmarks/ns_calibrate.py --device cuda --out ns_h200.jsonl

Times one Newton–Schulz part (``aligndp.app.rehearse_cost.ns_part_seconds``, what a rehearsal
measures) for every distinct part shape of the presets' layer-wise Muon plans at the given D
(planned by the flops model and by the device's current cost, so narrow parts and whole
matrices are both in the grid), fits ``fixed_s`` and ``s_per_madd`` by least squares on
relative errors (``fit_ns_cost``), prints the fitted ``NewtonSchulzCost(...)`` literal to paste
into ns_cost.py with each shape's measured / modelled ratio, and writes one JSON line per
shape and one for the fit to ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time

import torch

from aligndp.app.rehearse import RehearsalOptions, plan_layouts
from aligndp.app.rehearse_cost import ns_part_seconds, rank_ns_parts
from aligndp.optim.ns_cost import FLOPS_NS_COST, fit_ns_cost, ns_cost_for, part_madds
from aligndp.plan.spec import Mode

NS_STEPS = 5


def part_shapes(presets, dps, costs) -> list[tuple[int, int, int]]:
    """Distinct ``(m, cols, rows)`` of every rank's parts in the presets' layer-wise Muon
    plans at each D, planned with each cost; smallest first."""
    shapes: set[tuple[int, int, int]] = set()
    for preset in presets:
        for dp in dps:
            for cost in costs:
                options = RehearsalOptions(
                    preset=preset, dp_size=dp, ranks=None, sharding="zero1", optimizer="muon",
                    ns_cost=cost,
                )  # fmt: skip
                for lo in plan_layouts(options):
                    if lo.mode is Mode.LAYERWISE:
                        shapes.update(p for mine in rank_ns_parts(lo) for p in mine)
    return sorted(shapes, key=lambda s: (part_madds(*s), s))


def calibrate(device: str, presets, dps, *, repeats: int, max_madds: float | None, out=None):
    """Time the grid, fit, and return ``(cost, rows)``; rows also go to ``out`` (JSONL)."""
    shapes = part_shapes(presets, dps, [FLOPS_NS_COST, ns_cost_for(device)])
    if max_madds is not None:
        shapes = [s for s in shapes if part_madds(*s) <= max_madds]
    dev = torch.device(device)
    rows = []
    for m, cols, rows_b in shapes:
        seconds = (
            ns_part_seconds(m, cols, rows_b, device=dev, ns_steps=NS_STEPS, repeats=repeats)
            / NS_STEPS
        )
        row = dict(m=m, cols=cols, rows=rows_b, madds=part_madds(m, cols, rows_b), seconds=seconds)
        rows.append(row)
        print(json.dumps(row), flush=True)
        if out:
            out.write(json.dumps(row) + "\n")
    name = torch.cuda.get_device_name() if device == "cuda" else f"CPU ({platform.machine()})"
    threads = os.environ.get("OMP_NUM_THREADS", str(torch.get_num_threads()))
    source = (
        f"{name}, bf16, {'' if device == 'cuda' else f'OMP_NUM_THREADS={threads}, '}torch "
        f"{torch.__version__}: benchmarks/ns_calibrate.py --device {device}, "
        f"{time.strftime('%Y-%m-%d')}, {len(rows)} part shapes of {'/'.join(presets)}"
    )
    cost = fit_ns_cost([(r["madds"], r["seconds"]) for r in rows], source=source)
    for r in rows:
        r["fit_over_measured"] = cost.seconds(r["m"], r["cols"], r["rows"]) / r["seconds"]
    fit = {"fit": dataclasses.asdict(cost), "tflops": 2 / cost.s_per_madd / 1e12}
    ratios = [r["fit_over_measured"] for r in rows]
    fit["fit_over_measured"] = [min(ratios), max(ratios)]
    if out:
        out.write(json.dumps(fit) + "\n")
    return cost, rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--out", required=True, help="JSONL file for the raw timings and the fit")
    ap.add_argument("--presets", default="gpt2-small,1b")
    ap.add_argument("--dps", default="8,16,32,64,128,256,512,1024")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--max-madds", type=float, default=None,
        help="skip parts above this many multiply-adds per iteration (a slow CPU)",
    )  # fmt: skip
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is visible; use --device cpu")
    presets = [p.strip() for p in args.presets.split(",") if p.strip()]
    dps = [int(d) for d in args.dps.split(",")]
    with open(args.out, "w") as out:
        cost, rows = calibrate(
            args.device, presets, dps, repeats=args.repeats, max_madds=args.max_madds, out=out
        )
    ratios = [r["fit_over_measured"] for r in rows]
    print(
        f"\n{len(rows)} shapes; fitted / measured {min(ratios):.2f}-{max(ratios):.2f}; "
        f"{2 / cost.s_per_madd / 1e12:.2f} TFLOP/s, {cost.fixed_s * 1e6:.1f} us per part per "
        "iteration. Paste into aligndp/optim/ns_cost.py:\n"
    )
    print(
        f"NewtonSchulzCost(\n    fixed_s={cost.fixed_s:.3e},\n    s_per_madd={cost.s_per_madd:.4e},"
        f"\n    source={cost.source!r},\n)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
