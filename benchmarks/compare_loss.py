"""Compare the loss curves of two or more `aligndp train` runs (e.g. bf16 vs --wgrad mxfp8).

Reads each run's ``metrics.jsonl`` and prints, against the first run (the baseline): the mean
and largest per-step relative difference of the train loss, the mean train loss over the last
``--tail`` steps, and every eval loss; with ``--plot`` it draws the curves with matplotlib.
Usage: ``python benchmarks/compare_loss.py RUN_A/metrics.jsonl RUN_B/metrics.jsonl
--labels bf16 mxfp8 [--plot out.png]``.
"""

from __future__ import annotations

import argparse
import json
import statistics


def load(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("metrics", nargs="+", help="metrics.jsonl files; the first is the baseline")
    parser.add_argument("--labels", nargs="+", default=None)
    parser.add_argument(
        "--tail", type=int, default=50, help="steps averaged for the final train loss"
    )
    parser.add_argument("--plot", default="", help="write a PNG of the curves here")
    args = parser.parse_args()
    labels = args.labels or args.metrics
    if len(labels) != len(args.metrics):
        raise SystemExit(f"got {len(args.metrics)} metrics files but {len(labels)} labels")
    runs = [load(p) for p in args.metrics]
    base = {r["step"]: r["loss"] for r in runs[0]}
    lines = []
    for label, run in zip(labels, runs, strict=True):
        losses = {r["step"]: r["loss"] for r in run}
        common = sorted(set(base) & set(losses))
        diffs = [abs(losses[s] - base[s]) / base[s] for s in common]
        tail = [losses[s] for s in common[-args.tail :]]
        evals = ", ".join(f"{r['step'] + 1}: {r['eval_loss']:.4f}" for r in run if "eval_loss" in r)
        lines.append(
            f"{label}: {len(common)} steps, train loss mean of last {len(tail)} "
            f"{statistics.mean(tail):.4f}; "
            f"|rel diff| to {labels[0]}: mean {statistics.mean(diffs):.2%}, max {max(diffs):.2%}; "
            f"eval {evals}"
        )
    print("\n".join(lines))
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for label, run in zip(labels, runs, strict=True):
            ax.plot(
                [r["step"] + 1 for r in run], [r["loss"] for r in run], label=label, linewidth=1
            )
        ax.set_xlabel("step")
        ax.set_ylabel("train loss")
        ax.set_yscale("log")
        ax.legend()
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
