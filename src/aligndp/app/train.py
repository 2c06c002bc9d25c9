"""``aligndp train``: the main job. Options, pre-flight checks and the launch of ranks.

With no arguments it trains the CPU demo GPT on the embedded synthetic language on 2 gloo
ranks that it starts itself through torch's elastic launcher. Inside a process started by
``torchrun`` (``RANK``/``WORLD_SIZE`` set) it trains on that process group instead:
``torchrun --nproc-per-node 8 -m aligndp train --device cuda`` uses NCCL.

The options are the fields of :class:`TrainConfig`; the argparse flags are generated from it
(the field docstrings are the help texts). The loop itself lives in ``train_loop.py``, the
metrics, plots and summary in ``train_report.py``.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import logging
import os
import signal
import sys
import textwrap
import typing
import uuid
from typing import Literal

from aligndp.models.gpt import PRESETS

__all__ = ["TrainConfig", "add_arguments", "config_from_args", "launch_local", "run", "train"]

Optimizer = Literal["adamw", "muon"]
Sharding = Literal["none", "zero1"]
Wgrad = Literal["none", "fp8", "mxfp8"]
Device = Literal["cpu", "cuda"]
Dtype = Literal["fp32", "bf16"]


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything ``aligndp train`` can be told; one flag per field."""

    preset: str = "demo"
    """Model shape: a key of aligndp.models.gpt.PRESETS."""
    steps: int = 500
    """Optimizer steps to train for (in total, counting steps done before a --resume)."""
    batch_size: int = 32
    """Global batch in sequences per optimizer step, over all ranks and micro-batches."""
    micro_batches: int = 1
    """Micro-batches per rank per step (gradient accumulation under model.no_sync())."""
    optimizer: Optimizer = "adamw"
    """Optimizer that aligndp.parallelize builds."""
    sharding: Sharding = "none"
    """none: replicated optimizer state (all-reduce); zero1: optimizer state sharded over ranks."""
    wgrad: Wgrad = "none"
    """Low-precision weight-gradient GEMMs accumulating into the aligned grad buffer."""
    lr: float = 3e-3
    """Peak learning rate (linear warm-up, then cosine decay to a tenth of it)."""
    seed: int = 0
    """Seeds the model's initialisation and the order of the data."""
    nproc: int = 2
    """Ranks to launch on this machine (ignored inside torchrun, which sets the world size)."""
    device: Device = "cpu"
    """cpu trains on gloo ranks; cuda on NCCL ranks, one GPU each."""
    dtype: Dtype = "fp32"
    """fp32, or bf16 autocast for the forward and backward (params, grads and optimizer state stay fp32)."""
    eval_every: int = 100
    """Evaluate on the held-out split every this many steps (0: only at the end)."""
    checkpoint_dir: str | None = None
    """Where checkpoints go (default: OUT/checkpoints)."""
    checkpoint_every: int = 0
    """Save a checkpoint every this many steps (0: never)."""
    keep_last: int = 0
    """Keep only the newest this many checkpoints (0: keep all)."""
    resume: bool = False
    """Continue the run in --out from its latest checkpoint (only a run started with the same options)."""
    overwrite: bool = False
    """Replace the run that --out (or --checkpoint-dir) holds; without it a fresh run there refuses."""
    out: str = "runs/latest"
    """Directory for run.json, metrics.jsonl, loss.png, layout.png and summary.json."""
    data: str | None = None
    """Training text: a text file (bytes) or a nanoGPT-style uint16 .bin file (default: embedded synthetic arithmetic)."""
    timeout: float = 300.0
    """Seconds a rank waits for the others in a collective (and in save/load) before the run fails; raise it when writing a checkpoint takes longer."""

    def __post_init__(self) -> None:
        if self.preset not in PRESETS:
            raise ValueError(f"unknown preset {self.preset!r}: choose one of {', '.join(PRESETS)}")
        for name, lowest in (
            ("steps", 1),
            ("batch_size", 1),
            ("micro_batches", 1),
            ("nproc", 1),
            ("eval_every", 0),
            ("checkpoint_every", 0),
            ("keep_last", 0),
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < lowest:
                raise ValueError(f"--{_flag(name)} must be an integer >= {lowest}, got {value!r}")
        if not self.lr > 0:
            raise ValueError(f"--lr must be > 0, got {self.lr!r}")
        if not self.timeout > 0:
            raise ValueError(f"--timeout must be > 0 seconds, got {self.timeout!r}")
        if self.resume and self.overwrite:
            raise ValueError(
                "--resume continues the run in --out and --overwrite replaces it: pass one of them"
            )
        hints = typing.get_type_hints(TrainConfig)
        for field in dataclasses.fields(self):
            choices = _choices(hints[field.name])
            if choices and getattr(self, field.name) not in choices:
                raise ValueError(
                    f"--{_flag(field.name)} {getattr(self, field.name)!r} is not one of {', '.join(choices)}"
                )
        parts = self.nproc * self.micro_batches
        if self.batch_size % parts:
            raise ValueError(
                f"--batch-size {self.batch_size} does not split into --nproc {self.nproc} ranks x "
                f"--micro-batches {self.micro_batches} = {parts} equal parts; use a multiple of {parts}, "
                f"e.g. --batch-size {-(-self.batch_size // parts) * parts}"
            )

    @property
    def checkpoint_path(self) -> str:
        return self.checkpoint_dir or os.path.join(self.out, "checkpoints")


def _flag(name: str) -> str:
    return name.replace("_", "-")


def _choices(hint: object) -> tuple[str, ...]:
    return typing.get_args(hint) if typing.get_origin(hint) is Literal else ()


def _field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a dataclass, read from its source."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return {}
    body = tree.body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per :class:`TrainConfig` field: ``--batch-size`` for ``batch_size``, and so on."""
    hints = typing.get_type_hints(TrainConfig)
    docs = _field_docs(TrainConfig)
    for field in dataclasses.fields(TrainConfig):
        hint, flag, help_text = (
            hints[field.name],
            "--" + _flag(field.name),
            docs.get(field.name, ""),
        )
        if hint is bool:
            parser.add_argument(flag, action="store_true", help=help_text)
            continue
        choices = _choices(hint)
        if choices:
            kind = str
        else:
            kind = next(t for t in typing.get_args(hint) or (hint,) if t is not type(None))
        default = "" if field.default is None else f" (default: {field.default})"
        parser.add_argument(
            flag,
            type=kind,
            choices=choices or None,
            default=field.default,
            metavar=None if choices else field.name.upper(),
            help=help_text + default,
        )


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    return TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)})


def _inside_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def preflight(config: TrainConfig) -> None:
    """Checks that need the machine or files, run once before any rank starts (so that a bad
    input is one clear error, not one per rank)."""
    import torch

    from aligndp.app.data import BatchSpec
    from aligndp.app.train_loop import latest_checkpoint, load_data, wgrad_backend

    cfg = PRESETS[config.preset]
    BatchSpec(config.batch_size, cfg.seq_len, config.nproc, config.micro_batches)
    load_data(config).check(seq_len=cfg.seq_len, vocab_size=cfg.vocab_size)
    if config.wgrad != "none":
        wgrad_backend(config)
    if config.device == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("--device cuda but torch sees no CUDA device; use --device cpu")
        if not _inside_torchrun() and config.nproc > torch.cuda.device_count():
            raise ValueError(
                f"--nproc {config.nproc} ranks need {config.nproc} GPUs, torch sees "
                f"{torch.cuda.device_count()}; use --nproc {torch.cuda.device_count()}"
            )
    if config.resume and latest_checkpoint(config.checkpoint_path) is None:
        raise ValueError(
            f"--resume but {config.checkpoint_path} holds no checkpoint; run once with "
            "--checkpoint-every N first (or drop --resume)"
        )


def launch_local(entrypoint, nproc: int, *args) -> dict[int, object]:
    """Run ``entrypoint(*args)`` on ``nproc`` ranks of this machine through torch's elastic
    launcher (c10d rendezvous on localhost, a free port, no restarts; each rank gets
    RANK/WORLD_SIZE/MASTER_ADDR/... in its environment) and return each rank's result.

    ``entrypoint`` must be a module-level function: ranks are spawned processes.
    """
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # the launcher's own warnings ("Received 2 death signal ...") would double our one-line
    # errors; each of its modules sets its logger's level, so set them all
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.ERROR)
    launch = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        run_id=f"aligndp-{uuid.uuid4().hex[:8]}",
        max_restarts=0,
        monitor_interval=0.1,
        start_method="spawn",
        logs_specs=DefaultLogsSpecs(log_dir=os.devnull),
    )
    return elastic_launch(launch, entrypoint)(*args)


def _run_dirs(config: TrainConfig) -> list[str]:
    """Directories this run writes: --out, and the checkpoint directory when it has one."""
    dirs = [config.out]
    if (config.checkpoint_every or config.resume) and config.checkpoint_path not in dirs:
        dirs.append(config.checkpoint_path)
    return dirs


def train(config: TrainConfig) -> dict:
    """Train as ``config`` says and return the summary (a dict; see train_report.Summary).

    Inside torchrun: this process is one rank of the job. Otherwise: ``config.nproc`` ranks are
    launched (one rank runs in this process, no launch). NotImplementedError from the engine
    (an option combination not built yet) comes back as a ValueError. The process that owns
    the run (this one, or torchrun's rank 0) holds the run directories' locks and writes
    their run.json ([Note: run directories] in run_dir.py).
    """
    from aligndp.app.run_dir import (
        RunLock,
        check_not_files,
        check_run_dirs,
        clear_outputs,
        write_run_files,
    )
    from aligndp.app.train_loop import train_worker

    if _inside_torchrun():
        config = dataclasses.replace(config, nproc=int(os.environ["WORLD_SIZE"]))
    check_not_files(config)  # before a lock creates a directory
    owner = not _inside_torchrun() or int(os.environ["RANK"]) == 0
    locks: list[RunLock] = []
    try:
        if (
            owner
        ):  # torchrun's other ranks would see the run.json rank 0 writes: only the owner checks
            locks = [RunLock(d).acquire() for d in _run_dirs(config)]
            check_run_dirs(config)  # under the lock: what --out holds cannot change under us
        preflight(config)
        if owner:
            if config.overwrite:
                for directory in {config.out, config.checkpoint_path}:
                    clear_outputs(directory)
            write_run_files(config, _run_dirs(config))
        if _inside_torchrun() or config.nproc == 1:
            result = train_worker(config)
        else:
            from aligndp.app.train_loop import launched_worker

            result = launch_local(launched_worker, config.nproc, config)[0]
    finally:
        for lock in locks:
            lock.release()
    if "error" in result:
        raise ValueError(result["error"])
    return result


_SIGNALS = {2: "SIGINT", 6: "SIGABRT", 9: "SIGKILL", 11: "SIGSEGV", 15: "SIGTERM"}


def _describe(failure) -> str:
    code = failure.exitcode
    how = (
        f"killed by {_SIGNALS.get(-code, f'signal {-code}')}" if code < 0 else f"exit status {code}"
    )
    return f"rank {failure.local_rank} ({how})"


def run(args: argparse.Namespace) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    try:
        train(config_from_args(args))
    except SignalException as e:  # the launcher turns SIGINT/SIGTERM into this
        if e.sigval == signal.SIGINT:
            raise KeyboardInterrupt from None
        print(f"aligndp train: stopped by {e.sigval.name}", file=sys.stderr)
        return 128 + int(e.sigval)
    except ChildFailedError as e:
        failures = sorted(e.failures.values(), key=lambda f: f.local_rank)
        if all(f.exitcode in (130, -2) for f in failures):
            raise KeyboardInterrupt from None
        print(
            f"aligndp train: error: {', '.join(_describe(f) for f in failures)} failed; a rank's traceback, "
            "if it wrote one, is above",
            file=sys.stderr,
        )
        return 1
    return 0
