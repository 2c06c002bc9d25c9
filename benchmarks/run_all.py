"""Every figure of issue 14 beside its peer, measured in one run, as one table.

GPU (2 GPUs; the figures we report; about 3-5 minutes with the 1b preset, plus 2-4 for issue
23's FP8 rows, which compile three 1b models on rank 0; --skip-fp8-step leaves them out):
    PYTHONPATH=src torchrun --nproc-per-node 2 benchmarks/run_all.py --out DIR
CPU smoke run (gloo, the demo preset, seconds; starts its own 2 ranks when not under torchrun):
    python benchmarks/run_all.py --smoke --out DIR

Each row: figure, the peer measured in the same run, figure / peer, the issue's goal, met.
The measuring code is the single benchmarks' own (``ddp_step``, ``zero1_step``, ``muon_step``,
``mx_training``, ``mx_kernels``, ``fp8_step``), imported; this script only orders the
sections, runs the one-GPU sections side by side (rank 0: MX training steps and issue 23's
FP8 steps against torchao and bf16, the last rank: MX kernels) and
writes ``run_all.jsonl`` (an ``env`` object, then one object per row) and ``run_all.md`` to
``--out``, rewritten after every section so a run cut short still leaves what it measured.
A row that could not be measured is still printed, with the reason (``skipped: ...``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from _bench import Timing, init
from compile_step import COMPILE_KEYS, compile_section
from run_all_sections import (
    Context,
    ddp_section,
    guarded,
    muon_section,
    nccl_section,
    one_gpu_sections,
    zero1_section,
)
from run_all_table import ROWS, Row, markdown, write

from aligndp.models.gpt import PRESETS


def environment(args: argparse.Namespace, device: torch.device) -> dict:
    names = [None] * dist.get_world_size()
    dist.all_gather_object(
        names,
        torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
    )
    env = {
        "what": "env",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command_line(),
        "world_size": dist.get_world_size(),
        "backend": dist.get_backend(),
        "devices": names,
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "preset": args.preset,
        "batch": args.batch,
        "seq_len": PRESETS[args.preset].seq_len,
        "iters": args.iters,
        "warmup": args.warmup,
    }
    if device.type == "cuda":
        version = torch.cuda.nccl.version()
        env["nccl"] = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
        env["cuda"] = torch.version.cuda
        env["nvidia_smi"] = shell(
            "nvidia-smi --query-gpu=index,name,driver_version,memory.total,power.limit,"
            "clocks.max.sm,pcie.link.gen.current --format=csv,noheader"
        )
        env["topology"] = shell("nvidia-smi topo -m")
        try:
            import triton

            env["triton"] = triton.__version__
        except ImportError:
            pass
    env["git"] = shell("git rev-parse --short HEAD") or None
    if env["git"] and shell("git status --porcelain --untracked-files=no"):
        env["git"] += " + uncommitted changes"  # the figures are not that commit's alone
    return env


def command_line() -> str:
    """This run's command as typed (torchrun's part rebuilt from its environment)."""
    here = [Path(sys.argv[0]).as_posix(), *sys.argv[1:]]
    if "TORCHELASTIC_RUN_ID" in os.environ:
        return shlex.join(
            ["torchrun", "--nproc-per-node", os.environ.get("LOCAL_WORLD_SIZE", "?"), *here]
        )
    return shlex.join(["python", *here])


def shell(command: str) -> str:
    try:
        out = subprocess.run(
            shlex.split(command),
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
            cwd=Path(__file__).resolve().parent,
        )
        return out.stdout.strip() if out.returncode == 0 else ""
    except (OSError, subprocess.TimeoutExpired):
        return ""


def run(args: argparse.Namespace) -> None:
    device, dtype = init(args.device, timeout=datetime.timedelta(seconds=args.timeout_s))
    if args.smoke:
        torch.set_num_threads(1)
    rank = dist.get_rank()
    ctx = Context(args, device, dtype, Timing(device, args.iters, args.warmup))
    solo = dist.new_group([0])  # rank 0's one-GPU training steps (every rank must create it)
    env = environment(args, device)
    out = Path(args.out)
    rows: list[Row] = []
    if rank == 0:
        print(json.dumps(env), flush=True)
    sections = [
        (lambda: ddp_section(ctx), ["ddp.step", "local.fwdbwd@", "local.skew"]),
        (
            lambda: nccl_section(ctx),
            ["nccl.all_reduce@", "nccl.reduce_scatter@", "nccl.all_gather@"],
        ),
        (
            lambda: zero1_section(ctx),
            [
                "zero1.vs_torch",
                "zero1.vs_aligndp_ddp",
                "zero1_bf16.vs_torch",
                "zero1_bf16.vs_aligndp_ddp",
                "ddp_adamw.vs_torch",
            ],
        ),
        (lambda: muon_section(ctx), ["muon.step"]),
        (lambda: compile_section(ctx), list(COMPILE_KEYS)),
    ]
    if args.skip_muon:
        sections[-2] = (lambda: [Row("muon.step", skipped="--skip-muon")], ["muon.step"])
    sections.append(
        (lambda: one_gpu_sections(ctx, solo), [k for k in ROWS if k.startswith(("mx.", "fp8."))])
    )
    for fn, keys in sections:
        t0 = time.perf_counter()
        new = guarded(fn, keys)
        dist.barrier()
        if rank == 0:
            for row in new:
                print(f"{row.key} | " + " | ".join(row.cells()), flush=True)
            print(f"(section took {time.perf_counter() - t0:.1f} s)", flush=True)
            rows += new
            write(out, env, rows)
    if rank == 0:
        print("\n" + markdown(env, rows), flush=True)
    dist.destroy_process_group()


def launch(nproc: int, *, smoke: bool) -> int:
    """Start ``nproc`` ranks of this script, as torchrun would (env:// rendezvous on a free
    local port); when one fails, stop the others. Returns the worst exit status."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(nproc):
        env = dict(
            os.environ,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(nproc),
            LOCAL_WORLD_SIZE=str(nproc),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        if smoke:
            env["OMP_NUM_THREADS"] = "1"
        procs.append(
            subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve()), *sys.argv[1:]], env=env
            )
        )
    worst = 0
    while procs:
        for p in list(procs):
            rc = p.poll()
            if rc is None:
                continue
            procs.remove(p)
            worst = worst or rc
            if rc:
                for other in procs:
                    other.terminate()
        time.sleep(0.05)
    return worst


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="out/run_all", help="folder for run_all.jsonl and run_all.md")
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="CPU smoke run: gloo, --preset demo, 2 timed calls per figure, GPU-only rows skipped",
    )
    ap.add_argument(
        "--preset",
        default=None,
        choices=sorted(PRESETS),
        help="model of the DP rows (default 1b; demo with --smoke)",
    )
    ap.add_argument(
        "--device", default=None, choices=["cuda", "cpu"], help="default cuda; cpu with --smoke"
    )
    ap.add_argument("--nproc", type=int, default=2, help="ranks to start when not under torchrun")
    ap.add_argument(
        "--batch", type=int, default=None, help="sequences per rank (default 8; 2 with --smoke)"
    )
    ap.add_argument(
        "--iters",
        type=int,
        default=None,
        help="back-to-back calls per timing (default 10; 2 with --smoke)",
    )
    ap.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="warm-up calls per timing (default 3; 1 with --smoke)",
    )
    ap.add_argument(
        "--bucket-numel", type=int, default=40_000_000, help="aligndp bucket size in elements"
    )
    ap.add_argument("--torch-bucket-mb", type=float, default=25.0, help="torch DDP bucket_cap_mb")
    ap.add_argument(
        "--mx-preset",
        default=None,
        help="model of the MX step rows (default 1b; demo with --smoke)",
    )
    ap.add_argument(
        "--mx-rounds",
        type=int,
        default=None,
        help="interleaved rounds of MX steps (default 4; 1 with --smoke)",
    )
    ap.add_argument(
        "--mx-steps",
        type=int,
        default=None,
        help="timed steps per round (default 8; 2 with --smoke)",
    )
    ap.add_argument("--kernel-size", type=int, default=8192, help="M = N = K of the MX kernel rows")
    ap.add_argument("--skip-muon", action="store_true", help="leave out the layer-wise Muon row")
    ap.add_argument(
        "--skip-fp8-step",
        action="store_true",
        help="leave out issue 23's FP8 rows (three compiled 1b models on rank 0: minutes; "
        "benchmarks/fp8_step.py runs them alone)",
    )
    ap.add_argument(
        "--timeout-s", type=int, default=420, help="collective timeout: a hung rank ends the run"
    )
    args = ap.parse_args(argv)
    smoke = args.smoke
    defaults = dict(
        preset="demo" if smoke else "1b",
        device="cpu" if smoke else "cuda",
        batch=2 if smoke else 8,
        iters=2 if smoke else 10,
        warmup=1 if smoke else 3,
        mx_preset="demo" if smoke else "1b",
        mx_rounds=1 if smoke else 4,
        mx_steps=2 if smoke else 8,
    )
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda but torch sees no CUDA device; use --smoke (CPU) or --device cpu")
    return args


def main() -> None:
    args = parse_args()
    if "RANK" not in os.environ:
        sys.exit(launch(args.nproc, smoke=args.smoke))
    run(args)


if __name__ == "__main__":
    main()
