"""What ``aligndp train`` shows and writes: progress bar, metrics.jsonl, loss.png, layout.png,
summary.json and the summary printed at the end. Rank 0 writes; other ranks pass
``enabled=False`` and these objects do nothing."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import resource
import sys
import time

import torch

from aligndp.app.train_config import describe_mesh

__all__ = [
    "MetricsLog",
    "strict",
    "Progress",
    "Summary",
    "finish_report",
    "params_hash",
    "peak_memory_bytes",
    "plot_loss",
]


def strict(value: object) -> object:
    """``value`` with every NaN or infinite float replaced by None (JSON's null): what the project
    writes is strict JSON (``json.dump(..., allow_nan=False)``), which every parser reads."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict(v) for v in value]
    return value


def dumps(value: object, **kwargs) -> str:
    """Strict JSON of ``value`` (see :func:`strict`)."""
    return json.dumps(strict(value), allow_nan=False, **kwargs)


class MetricsLog:
    """``metrics.jsonl``: one JSON object per step with ``step``, ``loss``, ``lr``, ``tokens_per_s``
    (and ``eval_loss`` on evaluation steps); each record also goes to ``sinks`` (``--log-with``).

    A resumed run (``start_step`` > 0) keeps the records of the steps before ``start_step`` and
    drops any later ones the interrupted run wrote, so the file reads as one uninterrupted run.
    """

    def __init__(self, path: str, *, start_step: int = 0, enabled: bool = True, sinks=None):
        self.path = path
        self.enabled = enabled
        self.sinks = sinks
        self.records: list[dict] = []
        if not enabled:
            return
        if start_step > 0 and os.path.exists(path):
            self.records = [r for r in read_metrics(path) if r["step"] < start_step]
        with open(path, "w") as f:
            f.writelines(dumps(r) + "\n" for r in self.records)

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        self.records.append(record)
        with open(self.path, "a") as f:
            f.write(dumps(record) + "\n")
        if self.sinks is not None:
            self.sinks.log(record)

    def close(self) -> None:
        if self.sinks is not None:
            self.sinks.close()

    @property
    def first_loss(self) -> float | None:
        return self.records[0]["loss"] if self.records else None


def read_metrics(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


class Progress:
    """A tqdm bar (loss, tokens/s, ETA) on a terminal; a line every tenth of the run otherwise."""

    def __init__(self, *, total: int, initial: int = 0, enabled: bool = True):
        self.enabled, self.total, self.initial = enabled, total, initial
        self.bar = None
        self.every = max(1, (total - initial) // 10)
        self.started = time.perf_counter()
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(
                total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True
            )

    def update(self, record: dict) -> None:
        if not self.enabled:
            return
        text = f"loss {record['loss']:.4f}" + (
            f", eval {record['eval_loss']:.4f}" if "eval_loss" in record else ""
        )
        rate = f"{record['tokens_per_s']:,.0f} tok/s"
        if self.bar is not None:
            self.bar.set_postfix_str(f"{text}, {rate}", refresh=False)
            self.bar.update(1)
        elif (
            (record["step"] + 1 - self.initial) % self.every == 0
            or record["step"] + 1 == self.total
            or "eval_loss" in record
        ):
            print(
                f"step {record['step'] + 1}/{self.total}: {text}, {rate}, "
                f"{time.perf_counter() - self.started:.1f} s",
                flush=True,
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def params_hash(module: torch.nn.Module) -> int:
    """A 63-bit hash of every param's bytes, in registration order."""
    digest = hashlib.sha256()
    for name, p in module.named_parameters():
        digest.update(name.encode())
        digest.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return int.from_bytes(digest.digest()[:8], "little") >> 1


def peak_memory_bytes(device: torch.device) -> int:
    """CUDA: max allocated on ``device``; CPU: this process's max resident set size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # Linux reports KiB


@dataclasses.dataclass
class Summary:
    """The end-of-run figures (also written to summary.json)."""

    steps: int
    start_step: int
    dp_size: int
    """Ranks of the job (the world size)."""
    replicas: int
    """Replicas the ranks form (``--replicas``, as the model built its groups); each shards
    over ``dp_size / replicas`` ranks."""
    vocab_size: int
    """Tokens in the model's vocabulary (ln of it is the loss of a uniform guess)."""
    first_loss: float | None
    """Global-batch loss of the first step in metrics.jsonl (step 0, also after a resume)."""
    train_loss: float | None
    """Global-batch loss of the last step."""
    eval_loss: float | None
    """Held-out loss after the last step."""
    tokens_per_s: float | None
    """Training tokens per second over all ranks, first step left out (None: fewer than two
    steps were trained)."""
    replicas_in_sync: bool
    """Every rank holds bit-identical params at the end."""
    peak_memory_bytes: int = 0
    """Largest over ranks: CUDA max allocated, or CPU max RSS."""
    padding_numel: int = 0
    padded_numel: int = 0
    wall_s: float = 0.0
    checkpoint: str | None = None
    """The run's newest checkpoint (None: --no-final-checkpoint and no --checkpoint-every)."""

    def lines(self) -> list[str]:
        padded = self.padded_numel
        padding = f"{100 * self.padding_numel / padded:.2f}%" if padded else "n/a"
        if self.start_step < self.steps:
            trained = (
                f"trained steps {self.start_step}..{self.steps - 1} on {self.dp_size} rank(s)"
                f"{describe_mesh(self.replicas, self.dp_size)} in {self.wall_s:.1f} s"
            )
        else:
            trained = (
                f"nothing left to train: resumed at step {self.start_step} of {self.steps} "
                "(raise --steps to go on)"
            )
        kept = (
            f"checkpoint {self.checkpoint} (--resume continues it; --resume --steps N extends it)"
            if self.checkpoint
            else "no checkpoint kept (--no-final-checkpoint)"
        )
        return [
            trained,
            kept,
            f"loss {_figure(self.first_loss, '.4f')} -> {_figure(self.train_loss, '.4f')} (train), "
            f"eval {_figure(self.eval_loss, '.4f')} (a uniform guess over {self.vocab_size:,} "
            f"tokens: {math.log(self.vocab_size):.4f})",
            f"throughput {_figure(self.tokens_per_s, ',.0f')} tokens/s, "
            f"peak memory {self.peak_memory_bytes / 2**20:,.1f} MiB per rank",
            f"grad buffers: {self.padding_numel:,} padding elements of {self.padded_numel:,} "
            f"({padding})",
            "replicas in sync: "
            + (
                "yes (identical param hashes on every rank)"
                if self.replicas_in_sync
                else "NO: param hashes differ between ranks"
            ),
        ]


def _figure(value: float | None, spec: str) -> str:
    return "n/a" if value is None or not math.isfinite(value) else format(value, spec)


def plot_loss(records: list[dict], path: str) -> None:
    """Train and eval loss against step, as a PNG (a bare Figure: pyplot's state is untouched)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    ax.plot(
        [r["step"] for r in records],
        [r["loss"] for r in records],
        label="train (global batch)",
        lw=1,
    )
    evals = [r for r in records if "eval_loss" in r]
    if evals:
        ax.plot(
            [r["step"] for r in evals],
            [r["eval_loss"] for r in evals],
            "o-",
            label="eval (held out)",
        )
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title("aligndp train")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _plot_layout(layouts, path: str) -> bool:
    try:
        from aligndp.app.plot import draw_layout
    except ImportError:
        return False
    draw_layout(layouts, path)
    return True


def finish_report(summary: Summary, model, *, out: str, metrics: MetricsLog, enabled: bool) -> dict:
    """Fill in the padding figures, write summary.json and the pictures, print the summary."""
    layouts = list(getattr(model, "layouts", ()))
    summary.padding_numel = sum(layout.padding_numel for layout in layouts)
    summary.padded_numel = sum(layout.padded_numel for layout in layouts)
    result = dataclasses.asdict(summary)
    if not enabled:
        return result
    with open(os.path.join(out, "summary.json"), "w") as f:
        f.write(dumps(result, indent=2) + "\n")
    plot_loss(metrics.records, os.path.join(out, "loss.png"))
    written = ["metrics.jsonl", "loss.png", "summary.json"]
    if layouts and _plot_layout(layouts, os.path.join(out, "layout.png")):
        written.append("layout.png")
    print("\n".join(summary.lines() + [f"wrote {', '.join(written)} to {out}"]), flush=True)
    return result
