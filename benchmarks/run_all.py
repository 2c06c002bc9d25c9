"""Every figure of issue 14 beside its peer, measured in one run, as one table.

GPU (2 GPUs; the figures we report; about 3-5 minutes with the 1b preset):
    PYTHONPATH=src torchrun --nproc-per-node 2 benchmarks/run_all.py --out DIR
CPU smoke run (gloo, the demo preset, seconds; starts its own 2 ranks when not under torchrun):
    python benchmarks/run_all.py --smoke --out DIR

Each row: figure, the peer measured in the same run, figure / peer, the issue's goal, met.
The measuring code is the single benchmarks' own (``ddp_step``, ``zero1_step``, ``muon_step``,
``mx_training``, ``mx_kernels``), imported; this script only orders the sections, runs the
one-GPU sections side by side (rank 0: MX training steps, the last rank: MX kernels) and
writes ``run_all.jsonl`` (an ``env`` object, then one object per row) and ``run_all.md`` to
``--out``, rewritten after every section so a run cut short still leaves what it measured.
A row that could not be measured is still printed, with the reason (``skipped: ...``).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import os
import platform
import shlex
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from _bench import Timing, build_gpt, init

from aligndp.models.gpt import PRESETS

# Every row of the table and what the issue says beside it, in print order; a key
# ending in "@" has one row per message size ("nccl.all_reduce@80MB").
ROWS: dict[str, str] = {
    "ddp.step": "DDP step / slowest rank's local fwd+bwd",
    "local.fwdbwd@": "local fwd+bwd of one rank (no communication)",
    "local.skew": "local fwd+bwd, slowest rank / fastest rank",
    "nccl.all_reduce@": "NCCL all-reduce bus bandwidth (nccl-tests busbw)",
    "nccl.reduce_scatter@": "NCCL reduce-scatter bus bandwidth (nccl-tests busbw)",
    "nccl.all_gather@": "NCCL all-gather bus bandwidth (nccl-tests busbw)",
    "zero1.vs_torch": "ZeRO-1 full step / (torch DDP + fused AdamW)",
    "zero1.vs_aligndp_ddp": "ZeRO-1 full step / aligndp DDP + fused AdamW",
    "ddp_adamw.vs_torch": "aligndp DDP + fused AdamW step / (torch DDP + fused AdamW)",
    "muon.step": "layer-wise Muon step + all-gather / one-GPU torch.optim.Muon",
    "mx.fp8_step": "--wgrad fp8 training step / bf16 step, one GPU",
    "mx.mxfp8_step": "--wgrad mxfp8 training step / bf16 step, one GPU",
    "mx.wgrad_mxfp8": "MXFP8 wgrad GEMM accumulating in place into fp32 main_grad",
    "mx.wgrad_fp8": "FP8 1x128 wgrad GEMM accumulating in place into fp32 main_grad",
    "mx.quantise_fp8": "FP8 1x128 quantise, rows + columns in one pass / device copy",
    "mx.quantise_mxfp8": "MXFP8 quantise, rows + columns in one pass / device copy",
}

# torch >= 2.13 renamed the tensor-in/tensor-out collectives; older releases keep the old names.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclasses.dataclass(frozen=True)
class Goal:
    """A goal of the issue: ``on`` (the figure or figure / peer) ``op`` ``value``."""

    op: str
    value: float
    on: str = "figure"

    def met(self, figure: float, ratio: float | None) -> bool:
        x = figure if self.on == "figure" else ratio
        return x <= self.value if self.op == "<=" else x >= self.value

    def __str__(self) -> str:
        return f"{'' if self.on == 'figure' else 'ratio '}{self.op} {self.value:g}"


@dataclasses.dataclass(frozen=True)
class Row:
    """One line of the table: a figure beside its peer, or the reason it is missing."""

    key: str
    figure: float | None = None
    unit: str = ""
    peer: float | None = None
    peer_what: str = ""
    goal: Goal | None = None
    note: str = ""
    skipped: str = ""
    what: str = ""

    @property
    def title(self) -> str:
        return self.what or ROWS.get(self.key, ROWS.get(self.key.split("@")[0] + "@", self.key))

    @property
    def ratio(self) -> float | None:
        return self.figure / self.peer if self.figure is not None and self.peer else None

    @property
    def met(self) -> bool | None:
        return (
            None
            if self.goal is None or self.figure is None
            else self.goal.met(self.figure, self.ratio)
        )

    def as_json(self) -> dict:
        return {
            "key": self.key,
            "what": self.title,
            "figure": self.figure,
            "unit": self.unit,
            "peer": self.peer,
            "peer_what": self.peer_what,
            "ratio": self.ratio,
            "goal": str(self.goal) if self.goal else None,
            "met": self.met,
            "note": self.note,
            "skipped": self.skipped or None,
        }

    def cells(self) -> list[str]:
        if self.skipped:
            return [self.title, f"skipped: {self.skipped}", "", "", str(self.goal or "—"), "—"]
        peer = (
            f"{fmt(self.peer)} ({self.peer_what})"
            if self.peer is not None
            else self.peer_what or "—"
        )
        met = "—" if self.met is None else ("yes" if self.met else "no")
        figure = f"{fmt(self.figure)} {self.unit}".strip() + (
            f" ({self.note})" if self.note else ""
        )
        return [
            self.title,
            figure,
            peer,
            fmt(self.ratio) if self.ratio is not None else "—",
            str(self.goal or "—"),
            met,
        ]


def fmt(x: float | None) -> str:
    return "—" if x is None else f"{x:.3f}" if abs(x) < 10 else f"{x:.1f}"


def matches(key: str, expected: str) -> bool:
    return (
        key.startswith(expected)
        if expected.endswith("@")
        else key == expected or key.startswith(expected + ".")
    )


# --- sections: each returns its rows (on rank 0; other ranks' rows are ignored) ---------------


@dataclasses.dataclass
class Context:
    """What every section shares."""

    args: argparse.Namespace
    device: torch.device
    dtype: torch.dtype
    timing: Timing
    bucket_numels: list[int] = dataclasses.field(default_factory=list)
    """The aligndp DDP run's bucket sizes in elements (set by the DDP section)."""


def ddp_section(ctx: Context) -> list[Row]:
    from ddp_step import aligndp_ddp_step, local_fwdbwd, torch_ddp_step

    args, timing = ctx.args, ctx.timing
    cfg = PRESETS[args.preset]
    idx = torch.randint(0, cfg.vocab_size, (args.batch, cfg.seq_len), device=ctx.device)
    model = build_gpt(args.preset, ctx.device, ctx.dtype)
    per_rank = local_fwdbwd(model, idx, timing)
    local = max(per_rank)
    t_torch = torch_ddp_step(model, idx, timing, bucket_cap_mb=args.torch_bucket_mb)
    del model
    free_memory(ctx.device)
    ours = aligndp_ddp_step(
        build_gpt(args.preset, ctx.device, ctx.dtype), idx, timing, bucket_numel=args.bucket_numel
    )
    ctx.bucket_numels = ours.bucket_numels
    free_memory(ctx.device)
    rows = [
        Row(
            "ddp.step",
            ours.seconds / local,
            "x local",
            t_torch / local,
            f"torch DDP {args.torch_bucket_mb:g} MB buckets, same run",
            Goal("<=", 1.02),
            note=f"{ours.seconds * 1e3:.2f} ms vs {local * 1e3:.2f} ms local; {len(ours.bucket_numels)} buckets "
            f"of <= {args.bucket_numel:,} elements",
        )
    ]
    rows += [
        Row(
            f"local.fwdbwd@rank{r}",
            t * 1e3,
            "ms",
            what=f"local fwd+bwd, rank {r} (no communication)",
        )
        for r, t in enumerate(per_rank)
    ]
    rows.append(
        Row(
            "local.skew",
            max(per_rank) / min(per_rank),
            "x",
            note="slowest / fastest rank; the slowest sets a data-parallel step's pace",
        )
    )
    return rows


def nccl_section(ctx: Context) -> list[Row]:
    """Bus bandwidth of each collective at the message sizes of this run's buckets: torch DDP's
    bucket cap and aligndp's median and largest bucket (gradient dtype = the model's)."""
    esize = torch.empty((), dtype=ctx.dtype).element_size()
    ws = dist.get_world_size()
    grad_bytes = (
        sum(p.numel() for p in build_gpt(ctx.args.preset, "meta", ctx.dtype).parameters()) * esize
    )
    sizes = {min(int(ctx.args.torch_bucket_mb * 2**20), grad_bytes)}
    if ctx.bucket_numels:
        ordered = sorted(ctx.bucket_numels)
        sizes |= {ordered[len(ordered) // 2] * esize, ordered[-1] * esize}
    rows = []
    for nbytes in sorted(sizes):
        numel = max(nbytes // esize // ws, 1) * ws
        x = torch.zeros(numel, device=ctx.device, dtype=ctx.dtype)
        shard = torch.zeros(numel // ws, device=ctx.device, dtype=ctx.dtype)
        full = torch.zeros_like(x)
        size = (
            numel * esize
        )  # nccl-tests' S: the full message (reduce-scatter's input, all-gather's output)
        seconds = {
            "all_reduce": ctx.timing(lambda: dist.all_reduce(x)),  # noqa: B023
            "reduce_scatter": ctx.timing(lambda: _reduce_scatter(shard, x)),  # noqa: B023
            "all_gather": ctx.timing(lambda: _all_gather(full, shard)),
        }  # noqa: B023
        factor = {
            "all_reduce": 2 * (ws - 1) / ws,
            "reduce_scatter": (ws - 1) / ws,
            "all_gather": (ws - 1) / ws,
        }
        label = f"{size / 2**20:.3g}MB"
        for name, t in seconds.items():
            rows.append(
                Row(
                    f"nccl.{name}@{label}",
                    size / t * factor[name] / 1e9,
                    "GB/s",
                    note=f"{label}, {t * 1e6:.0f} us, {dist.get_backend()}",
                    what=f"{ROWS[f'nccl.{name}@']}, {label}",
                )
            )
    return rows


def zero1_section(ctx: Context) -> list[Row]:
    from zero1_step import aligndp_adamw_step, torch_ddp_adamw_step

    args, timing = ctx.args, ctx.timing
    cfg = PRESETS[args.preset]
    gen = torch.Generator(device=ctx.device).manual_seed(1 + dist.get_rank())
    idx = torch.randint(
        0, cfg.vocab_size, (args.batch, cfg.seq_len), device=ctx.device, generator=gen
    )

    def make():
        free_memory(ctx.device)
        return build_gpt(args.preset, ctx.device, ctx.dtype)

    t_torch, _ = torch_ddp_adamw_step(make(), idx, timing)
    t_ddp, _ = aligndp_adamw_step(
        make(), idx, timing, sharding="none", bucket_numel=args.bucket_numel
    )
    zero1 = {
        overlap: aligndp_adamw_step(
            make(),
            idx,
            timing,
            sharding="zero1",
            bucket_numel=args.bucket_numel,
            overlap_param_gather=overlap,
        )[0]
        for overlap in (False, True)
    }
    free_memory(ctx.device)
    best = min(zero1.values())
    note = (
        f"param gather overlapped with the next forward {zero1[True] * 1e3:.2f} ms, "
        f"after the step {zero1[False] * 1e3:.2f} ms"
    )
    return [
        Row(
            "zero1.vs_torch",
            best * 1e3,
            "ms",
            t_torch * 1e3,
            "torch DDP + fused AdamW, ms",
            Goal("<=", 0.95, "ratio"),
            note=note,
        ),
        Row(
            "zero1.vs_aligndp_ddp",
            best * 1e3,
            "ms",
            t_ddp * 1e3,
            "aligndp DDP + fused AdamW, ms",
            Goal("<=", 1.0, "ratio"),
            note="the issue: never slower than aligndp's own DDP",
        ),
        Row("ddp_adamw.vs_torch", t_ddp * 1e3, "ms", t_torch * 1e3, "torch DDP + fused AdamW, ms"),
    ]


def muon_section(ctx: Context) -> list[Row]:
    from muon_step import aligndp_muon_step, hidden_matrices, torch_muon_1gpu

    matrices = hidden_matrices(ctx.args.preset, ctx.device, ctx.dtype)
    t_torch = torch_muon_1gpu(matrices, ctx.timing)
    free_memory(ctx.device)
    ours = aligndp_muon_step(matrices, ctx.timing, bucket_numel=ctx.args.bucket_numel)
    free_memory(ctx.device)
    return [
        Row(
            "muon.step",
            ours.seconds * 1e3,
            "ms",
            t_torch * 1e3,
            "torch.optim.Muon on one GPU, ms",
            Goal("<=", 0.55, "ratio"),
            note=f"{len(matrices)} matrices, dp {dist.get_world_size()}, imbalance {ours.imbalance:.3f}; "
            "goal from benchmarks/muon_step.py",
        )
    ]


def hopper(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)


def mx_training_section(ctx: Context, group: dist.ProcessGroup) -> list[Row]:
    """One GPU (rank 0 alone, on a one-rank group): bf16 against ``--wgrad fp8`` / ``mxfp8``.
    On CPU only the mxfp8 reference backend runs (a smoke test of the code path, no figure)."""
    from mx_training import step_times

    args = ctx.args
    if ctx.device.type == "cuda" and not hopper(ctx.device):
        return [
            Row(k, skipped=f"needs a Hopper GPU, not {torch.cuda.get_device_name()}")
            for k in ("mx.fp8_step", "mx.mxfp8_step")
        ]
    modes = ["none", "fp8", "mxfp8"] if ctx.device.type == "cuda" else ["none", "mxfp8"]
    res = step_times(
        args.mx_preset,
        modes,
        ctx.device,
        batch_size=args.batch,
        rounds=args.mx_rounds,
        steps=args.mx_steps,
        process_group=group,
    )
    base = res["none"]
    rows = (
        []
        if "fp8" in res
        else [Row("mx.fp8_step", skipped="needs CUDA (a Hopper GPU): FP8 1x128 has no CPU backend")]
    )
    for mode, goal in (("fp8", Goal("<=", 0.85, "ratio")), ("mxfp8", None)):
        if mode in res:
            r = res[mode]
            rows.append(
                Row(
                    f"mx.{mode}_step",
                    r.median_ms,
                    "ms",
                    base.median_ms,
                    "bf16 step, ms",
                    goal,
                    note=f"{args.mx_preset}, rounds {min(r.ms):.1f}-{max(r.ms):.1f} ms, loss {r.loss:.3f} "
                    f"(bf16 {base.loss:.3f}); loss parity is not measured here"
                    + ("" if ctx.device.type == "cuda" else "; CPU reference backend"),
                )
            )
    return rows


def mx_kernels_section(ctx: Context) -> list[Row]:
    """One GPU (the last rank): the MX kernels at 8192^3 against cuBLAS and a device copy."""
    keys = ("mx.wgrad_mxfp8", "mx.wgrad_fp8", "mx.quantise_fp8", "mx.quantise_mxfp8")
    if ctx.device.type != "cuda":
        return [Row(k, skipped="needs CUDA") for k in keys]
    if not hopper(ctx.device):
        return [
            Row(k, skipped=f"needs a Hopper GPU, not {torch.cuda.get_device_name()}") for k in keys
        ]
    return mx_kernel_rows(ctx.args.kernel_size, ctx.device)


def mx_kernel_rows(n: int, dev: torch.device) -> list[Row]:
    import mx_kernels as mk

    copy_numel = 4 * n * n
    copy_tbs = max(
        4 * copy_numel / mk.copy_ms(copy_numel, dev, graph=g) / 1e9 for g in (False, True)
    )
    torch.manual_seed(0)
    x = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    dy = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    main_grad = torch.zeros(n, n, device=dev, dtype=torch.float32)
    rows = []
    for key, block, mx, goal in (
        ("mx.quantise_fp8", 128, False, Goal(">=", 0.90, "ratio")),
        ("mx.quantise_mxfp8", 32, True, None),
    ):
        ms = mk.quantise_ms(x, block=block, mx=mx, rowwise=True, colwise=True)
        tbs = mk.quantise_bytes(n, block=block, mx=mx, rowwise=True, colwise=True) / ms / 1e9
        rows.append(
            Row(
                key,
                tbs,
                "TB/s",
                copy_tbs,
                "device copy, faster of do_bench / graphed, TB/s",
                goal,
                note=f"{n}x{n} bf16, {ms * 1e3:.1f} us graphed",
            )
        )
    ms_alone, ms_add = mk.bf16_wgrad_peer_ms(x, dy, main_grad)
    for key, block, mx, goal in (
        ("mx.wgrad_mxfp8", 32, True, Goal(">=", 700)),
        ("mx.wgrad_fp8", 128, False, None),
    ):
        a, b = mk.wgrad_operands(dy, x, block=block, mx=mx)
        err = mk.wgrad_rel_err(a, b, block=block, mx=mx)
        if not err < 1e-3:
            rows.append(Row(key, skipped=f"wrong result: relative error {err:.1e} against float64"))
            continue
        ms = mk.wgrad_ms(a, b, main_grad, block=block, mx=mx)
        rows.append(
            Row(
                key,
                mk.tflops(n, n, n, ms),
                "TFLOP/s",
                mk.tflops(n, n, n, ms_add),
                "cuBLAS bf16 + add_, TFLOP/s",
                goal,
                note=f"{n}^3, rel err {err:.1e}; cuBLAS bf16 alone {mk.tflops(n, n, n, ms_alone):.0f} TFLOP/s",
            )
        )
        del a, b
    return rows


def one_gpu_sections(ctx: Context, group: dist.ProcessGroup) -> list[Row]:
    """Rank 0 times the MX training steps while the last rank times the kernels (on another GPU,
    so neither waits for the other); every rank's rows are gathered to rank 0."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    mine: list[Row] = []
    for runs_here, fn, keys in (
        (rank == 0, lambda: mx_training_section(ctx, group), ("mx.fp8_step", "mx.mxfp8_step")),
        (
            rank == ws - 1,
            lambda: mx_kernels_section(ctx),
            ("mx.wgrad_mxfp8", "mx.wgrad_fp8", "mx.quantise_fp8", "mx.quantise_mxfp8"),
        ),
    ):
        if runs_here:
            mine += guarded(fn, keys)
            free_memory(ctx.device)
    everyone: list[list[Row] | None] = [None] * ws
    dist.all_gather_object(everyone, mine)
    return [row for rows in everyone for row in rows]


# --- running, printing, writing ----------------------------------------------------------------


def guarded(fn: Callable[[], list[Row]], keys) -> list[Row]:
    """``fn()``'s rows, plus a skip row for every expected key it did not produce (its error
    when it raised) so that no row silently disappears."""
    try:
        rows, reason = fn(), "not measured"
    except Exception as err:  # noqa: BLE001 -- a failed section must not cost the other rows
        traceback.print_exc()
        rows, reason = (
            [],
            f"error: {type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}",
        )
    return rows + [
        Row(k.rstrip("@"), skipped=reason) for k in keys if not any(matches(r.key, k) for r in rows)
    ]


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


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


def markdown(env: dict, rows: list[Row]) -> str:
    lines = [
        f"# run_all {env['date']}",
        "",
        f"- command: `{env['command']}` ({env['world_size']} ranks, {env['backend']})",
        f"- hardware: {', '.join(map(str, env['devices']))}; host {env['host']}, {env['cpus']} CPUs",
        f"- software: torch {env['torch']}"
        + "".join(f", {k} {env[k]}" for k in ("nccl", "cuda", "triton") if k in env)
        + f", python {env['python']}, aligndp {env['git']}",
        f"- model: `--preset {env['preset']}`, {env['batch']} x {env['seq_len']} tokens per rank; "
        f"each timing: median of 3 runs of {env['iters']} back-to-back calls after {env['warmup']} warm-ups",
    ]
    if env.get("nvidia_smi"):
        lines += ["", "```", env["nvidia_smi"], env.get("topology", ""), "```"]
    lines += [
        "",
        "| row | figure | peer (same run) | figure / peer | goal | met |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    lines += ["| " + " | ".join(c.replace("|", "/") for c in row.cells()) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def write(out: Path, env: dict, rows: list[Row]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "run_all.jsonl", "w") as f:
        for obj in [env] + [r.as_json() for r in rows]:
            f.write(json.dumps(obj) + "\n")
    (out / "run_all.md").write_text(markdown(env, rows))


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
            ["zero1.vs_torch", "zero1.vs_aligndp_ddp", "ddp_adamw.vs_torch"],
        ),
        (lambda: muon_section(ctx), ["muon.step"]),
    ]
    if args.skip_muon:
        sections[-1] = (lambda: [Row("muon.step", skipped="--skip-muon")], ["muon.step"])
    sections.append((lambda: one_gpu_sections(ctx, solo), [k for k in ROWS if k.startswith("mx.")]))
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
