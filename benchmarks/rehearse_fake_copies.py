"""What torch's fake process group's copies added to a rehearsed step, against D.

The fake backend copies an all-gather's (and a gather's) input into every rank's slot of the
output: D copies per bucket, which a rehearsal timed as its own optimizer phase (where the
param gather launches) until the timed steps ran inside ``moving_nothing()``
([Note: rehearsal on the fake process group], runtime/fake_world.py). This times rank 0's
step at each D both ways: as the rehearsal runs it now, and with the copies put back.

    PYTHONPATH=src python benchmarks/rehearse_fake_copies.py --device cpu \
        --preset gpt2-small --batch 1 --seq-len 128 --dps 8,64,512,1024
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys

from aligndp.app import rehearse_step
from aligndp.app.rehearse import RehearsalOptions, rehearse_rank

JOBS = {"ZeRO-1": {}, "layer-wise Muon": {"optimizer": "muon"}}


def run(args) -> list[dict]:
    rows = []
    moving_nothing = rehearse_step.moving_nothing
    for dp in args.dps:
        for job, kw in JOBS.items():
            if job not in args.jobs:
                continue
            options = RehearsalOptions(
                preset=args.preset, dp_size=dp, sharding="zero1", batch_size=args.batch,
                seq_len=args.seq_len, device=args.device, autocast=args.device == "cuda",
                steps=args.steps, **kw,
            )  # fmt: skip
            for mode in ("moving nothing", "fake copies"):
                rehearse_step.moving_nothing = (
                    moving_nothing if mode == "moving nothing" else contextlib.nullcontext
                )
                try:
                    got = rehearse_rank(options, 0)
                finally:
                    rehearse_step.moving_nothing = moving_nothing
                row = {"dp": dp, "job": job, "mode": mode, "collectives": len(got.collectives)}
                row.update({f"{k}_ms": v * 1e3 for k, v in got.seconds.items()})
                print(json.dumps(row), flush=True)
                rows.append(row)
    return rows


def markdown(rows: list[dict]) -> str:
    lines = [
        "| D | job | timed steps | fwd ms | bwd ms | opt ms | param gather launches + waits ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['dp']} | {r['job']} | {r['mode']} | {r['forward_ms']:.1f} "
            f"| {r['backward_ms']:.1f} | {r['optimizer_ms']:.1f} | {r['gather_ms']:.1f} |"
        )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--preset", default="gpt2-small")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=None, help="default: the preset's")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--dps", default="8,64,512,1024")
    ap.add_argument("--jobs", default="ZeRO-1", help=f"comma-separated, of {', '.join(JOBS)}")
    args = ap.parse_args()
    args.dps = [int(x) for x in args.dps.split(",")]
    args.jobs = [x.strip() for x in args.jobs.split(",")]
    unknown = sorted(set(args.jobs) - set(JOBS))
    if unknown:
        ap.error(f"--jobs: unknown {', '.join(unknown)}; choose from {', '.join(JOBS)}")
    print(markdown(run(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
