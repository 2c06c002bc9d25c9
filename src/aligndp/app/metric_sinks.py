"""Where ``aligndp train`` logs its scalars besides ``metrics.jsonl``: ``--log-with
tensorboard,wandb``, through each library's own writer (torch's SummaryWriter, wandb.init).

Each sink gets every metrics.jsonl record and logs the same scalars under the same names
(``loss``, ``lr``, ``tokens_per_s``, ``step_s``, ``eval_loss``) at the record's ``step``.
Rank 0 alone builds sinks.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os

__all__ = ["EXTRAS", "MetricSinks", "check_installed", "scalars"]

EXTRAS = {"tensorboard": "tensorboard", "wandb": "wandb"}
"""``--log-with`` name: the package it needs (pip install 'aligndp[NAME]' installs it)."""


def check_installed(names: tuple[str, ...]) -> None:
    """One-line ValueError for a ``--log-with`` logger whose package is not installed."""
    for name in names:
        if importlib.util.find_spec(EXTRAS[name]) is None:
            raise ValueError(
                f"--log-with {name} needs the {EXTRAS[name]} package: pip install "
                f"'aligndp[{name}]' (or drop {name} from --log-with)"
            )


def scalars(record: dict) -> dict[str, float]:
    """The record's figures as logged: every number but ``step``, undefined ones left out."""
    return {
        k: float(v)
        for k, v in record.items()
        if k != "step" and isinstance(v, (int, float)) and math.isfinite(v)
    }


class _TensorBoard:
    def __init__(self, out: str, config) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=os.path.join(out, "tensorboard"))

    def log(self, record: dict) -> None:
        for name, value in scalars(record).items():
            self.writer.add_scalar(name, value, global_step=record["step"])

    def close(self) -> None:
        self.writer.close()


class _Wandb:
    def __init__(self, out: str, config) -> None:
        import wandb

        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "aligndp"),
            dir=out,
            config=dataclasses.asdict(config),
            mode=os.environ.get("WANDB_MODE", "offline"),  # no network unless asked for
        )

    def log(self, record: dict) -> None:
        self.run.log(scalars(record), step=record["step"])

    def close(self) -> None:
        self.run.finish()


_SINKS = {"tensorboard": _TensorBoard, "wandb": _Wandb}


class MetricSinks:
    """The ``--log-with`` loggers of a run (none on ranks other than 0)."""

    def __init__(self, config, *, enabled: bool) -> None:
        names = config.loggers if enabled else ()
        self.sinks = [_SINKS[name](config.out, config) for name in names]

    def log(self, record: dict) -> None:
        for sink in self.sinks:
            sink.log(record)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
        self.sinks = []
