"""The table of benchmarks/run_all.py: its rows, the goals beside them, markdown."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

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
    "zero1_bf16.vs_torch": "ZeRO-1, master_weights=False (torch's bf16 numerics), full step / "
    "(torch DDP + fused AdamW)",
    "zero1_bf16.vs_aligndp_ddp": "ZeRO-1, master_weights=False, full step / aligndp DDP + "
    "fused AdamW (same numerics)",
    "ddp_adamw.vs_torch": "aligndp DDP + fused AdamW step / (torch DDP + fused AdamW)",
    "muon.step": "layer-wise Muon step + all-gather / one-GPU torch.optim.Muon",
    "compile.vs_torch_ddp": "aligndp + torch.compile(model) step / torch DDP + torch.compile, "
    "gpt2-small at dp = ranks (compile_step.py)",
    "compile.blocks_vs_torch_ddp": "aligndp + per-block torch.compile step / torch DDP + "
    "torch.compile, gpt2-small at dp = ranks",
    "compile.hooks_ms": "host ms per compiled step in AccumulateGrad + gradient hooks (profiler) "
    "/ torch DDP's",
    "mx.fp8_step": "--wgrad fp8 training step / bf16 step, one GPU",
    "mx.fp8_tensor_step": "--wgrad fp8-tensor (per-tensor scales) step / bf16 step, one GPU",
    "mx.mxfp8_step": "--wgrad mxfp8 training step / bf16 step, one GPU",
    "fp8.tensor_compile.vs_torchao": "fp8-tensor + torch.compile step / torchao float8 + "
    "torch.compile step, default layer rules, one GPU",
    "fp8.tensor_compile.vs_bf16": "fp8-tensor + torch.compile step / torch bf16 eager step",
    "fp8.blockwise_compile.vs_bf16": "fp8 1x128 (every block Linear) + torch.compile step / "
    "torch bf16 eager step",
    "fp8.small_compile.vs_bf16_compile": "gpt2-small, every recipe under its default layer "
    "rule + torch.compile step / torch bf16 + torch.compile step",
    "fp8.small_eager.vs_bf16": "gpt2-small, every recipe under its default layer rule, eager "
    "step / torch bf16 eager step",
    "mx.wgrad_mxfp8": "MXFP8 wgrad GEMM accumulating in place into fp32 main_grad",
    "mx.wgrad_fp8": "FP8 1x128 wgrad GEMM accumulating in place into fp32 main_grad",
    "mx.quantise_fp8": "FP8 1x128 quantise, rows + columns in one pass / device copy",
    "mx.quantise_mxfp8": "MXFP8 quantise, rows + columns in one pass / device copy",
}
FP8_ROWS = tuple(k for k in ROWS if k.startswith("fp8."))
"""Issue 23's rows (benchmarks/fp8_step.py, on rank 0's GPU)."""


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


def markdown(env: dict, rows: list[Row]) -> str:
    lines = [
        f"# run_all {env['date']}",
        "",
        f"- command: `{env['command']}` ({env['world_size']} ranks, {env['backend']})",
        f"- hardware: {', '.join(map(str, env['devices']))}; "
        f"host {env['host']}, {env['cpus']} CPUs",
        f"- software: torch {env['torch']}"
        + "".join(f", {k} {env[k]}" for k in ("nccl", "cuda", "triton") if k in env)
        + f", python {env['python']}, aligndp {env['git']}",
        f"- model: `--preset {env['preset']}`, {env['batch']} x {env['seq_len']} tokens per rank; "
        f"each timing: median of 3 runs of {env['iters']} back-to-back calls "
        f"after {env['warmup']} warm-ups",
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
