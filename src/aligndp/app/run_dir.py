"""A run directory knows its run: ``run.json``, a lock, and what ``--overwrite`` may delete.

[Note: run directories]
``aligndp train`` writes ``run.json`` into ``--out`` (and into the checkpoint directory):
a run id and the options that define the run's numbers (:data:`IDENTITY`: model, data,
batch, optimizer, peak lr, seed; not the rank count, mesh shape (``--replicas``),
micro-batches or sharding, which a resumed run may change: a checkpoint holds model-space
values, read back at any of them; nor ``--steps``: ``--resume --steps N`` extends a run). It
also writes ``run.toml``, every option of the run, which ``--config`` reads back. Then:
- a fresh run into an ``--out`` (or checkpoint directory) that holds a run refuses, unless
  ``--overwrite``, which deletes only the files ``aligndp train`` writes there;
- ``--resume`` continues only a run with the same identity, naming the options that differ;
- ``.lock`` (created with ``O_EXCL``, holding pid and host) keeps two runs out of one
  directory; a lock whose process is gone (same host) is stale and taken over.
"""

from __future__ import annotations

import dataclasses
import datetime
import errno
import json
import os
import shutil
import socket
import uuid

__all__ = [
    "IDENTITY",
    "LOCK_FILE",
    "MAY_CHANGE_ON_RESUME",
    "OUTPUTS",
    "RUN_FILE",
    "CONFIG_FILE",
    "RunLock",
    "check_not_files",
    "check_run_dirs",
    "clear_outputs",
    "write_run_files",
]

RUN_FILE = "run.json"
LOCK_FILE = ".lock"
IDENTITY = (
    "preset",
    "batch_size",
    "optimizer",
    "lr",
    "seed",
    "wgrad",
    "wgrad_layers",
    "dtype",
    "data",
)
"""TrainConfig fields that define a run: a checkpoint resumes only into the same values."""
NOT_IN_RUN_TOML = ("resume", "resume_from", "overwrite")
"""How a run was started, not what it is: left out of its run.toml."""
MAY_CHANGE_ON_RESUME = (
    "steps",
    "final_checkpoint",
    "resume_from",
    "log_with",
    "micro_batches",
    "sharding",
    "nproc",
    "replicas",
    "device",
    "eval_every",
    "checkpoint_dir",
    "checkpoint_every",
    "keep_last",
    "resume",
    "overwrite",
    "out",
    "timeout",
    "compile",
    "fp8_param_gather",
)
"""The other TrainConfig fields: how the run is split, checkpointed, reported and timed, not
what it computes (up to rounding); every field is in exactly one of the two lists."""
CONFIG_FILE = "run.toml"
OUTPUTS = ("metrics.jsonl", "loss.png", "layout.png", "summary.json", RUN_FILE, CONFIG_FILE)
"""What ``aligndp train`` writes into ``--out`` (plus ``step-N`` checkpoints): all that
``--overwrite`` deletes."""


def _identity(config) -> dict:
    return {name: getattr(config, name) for name in IDENTITY}


def _read_run(directory: str) -> dict | None:
    path = os.path.join(directory, RUN_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            run = json.load(f)
    except ValueError:
        run = None
    if not isinstance(run, dict) or not isinstance(run.get("config"), dict) or "run_id" not in run:
        raise ValueError(
            f"{path} is damaged (not the JSON aligndp train writes); delete it, or pass "
            "--overwrite to start a fresh run there"
        )
    return run


def _holds_a_run(directory: str) -> bool:
    from aligndp.app.run_checkpoints import latest_checkpoint

    if not os.path.isdir(directory):
        return False
    names = set(os.listdir(directory))
    return (
        bool(names & {"metrics.jsonl", "summary.json", RUN_FILE})
        or latest_checkpoint(directory) is not None
    )


def check_not_files(config) -> None:
    """--out and --checkpoint-dir are directories (or do not exist yet)."""
    for flag, directory in (("--out", config.out), ("--checkpoint-dir", config.checkpoint_path)):
        if os.path.exists(directory) and not os.path.isdir(directory):
            raise ValueError(f"{flag} {directory} is a file; give a directory (created if missing)")


def check_run_dirs(config) -> None:
    """Refuse a fresh run into a directory that holds a run, and a resume of another run."""
    check_not_files(config)
    directories = [("--out", config.out)]
    if config.checkpoint_path != os.path.join(config.out, "checkpoints"):
        directories.append(("--checkpoint-dir", config.checkpoint_path))
    if config.resume_from is not None:  # its run's run.json sits beside it
        beside = os.path.dirname(os.path.normpath(config.resume_from)) or "."
        if os.path.isfile(os.path.join(beside, RUN_FILE)) and all(
            not os.path.samefile(beside, d) for _, d in directories if os.path.isdir(d)
        ):
            directories.append(("--resume-from", beside))
    if config.overwrite:
        return
    for flag, directory in directories:
        run = _read_run(directory)
        if not config.resume:
            inside = os.path.join(directory, "checkpoints")
            if _holds_a_run(directory) or (flag == "--out" and _holds_a_run(inside)):
                started = (
                    f" (run {run['run_id']}, started {run.get('created', '?')})" if run else ""
                )
                raise ValueError(
                    f"{flag} {directory} holds another run{started}; pass --resume to continue it, "
                    f"--overwrite to replace it, or choose another {flag}"
                )
            continue
        if run is None:
            if flag == "--out" and not _holds_a_run(config.checkpoint_path):
                continue  # checked below through the checkpoint directory
            raise ValueError(
                f"--resume: {directory} has no {RUN_FILE}, so nothing says which run wrote it; "
                "resume only a directory written by aligndp train, or start fresh with --overwrite"
            )
        differ = [
            f"--{k.replace('_', '-')} {run['config'].get(k)!r} there, {v!r} now"
            for k, v in _identity(config).items()
            if run["config"].get(k) != v
        ]
        if differ:
            raise ValueError(
                f"--resume: {directory} holds run {run['run_id']} with other options "
                f"({'; '.join(differ)}); resume with the options it was started with, or start a "
                "fresh run with --overwrite or another --out"
            )


def write_run_files(config, directories: list[str]) -> str:
    """Write ``run.json`` into each directory (its id kept when resuming) and ``run.toml``
    into ``--out``; returns the run id."""
    from aligndp.app.config_file import to_toml
    from aligndp.app.train_report import dumps

    earlier = (
        [run for run in map(_read_run, directories) if run is not None] if config.resume else []
    )
    run = {
        "run_id": uuid.uuid4().hex[:12],
        "created": datetime.datetime.now().isoformat(timespec="seconds"),
        **{k: earlier[0][k] for k in ("run_id", "created") if earlier and k in earlier[0]},
        "config": _identity(config),
        "options": dataclasses.asdict(config),
    }
    for directory in directories:
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, RUN_FILE), "w") as f:
            f.write(dumps(run, indent=1) + "\n")
    with open(os.path.join(config.out, CONFIG_FILE), "w") as f:
        f.write(
            to_toml(
                config,
                header=f"aligndp train --config {CONFIG_FILE} trains run {run['run_id']} again "
                "(flags beside it override it)",
                leave_out=NOT_IN_RUN_TOML,
            )
        )
    return run["run_id"]


def clear_outputs(directory: str) -> None:
    """``--overwrite``: delete what aligndp train writes in ``directory``, nothing else."""
    from aligndp.state.checkpoint_files import is_checkpoint_dir as _is_checkpoint_dir

    if not os.path.isdir(directory):
        return
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        if name in OUTPUTS and os.path.isfile(path):
            os.remove(path)
        elif name.startswith("step-") and _is_checkpoint_dir(path):
            shutil.rmtree(path)
        elif name == "tensorboard" and os.path.isdir(path):  # --log-with tensorboard's events
            for event in os.listdir(path):
                if event.startswith("events.out.tfevents."):
                    os.remove(os.path.join(path, event))


@dataclasses.dataclass
class RunLock:
    """``<directory>/.lock`` held by this process while a run writes there."""

    directory: str
    path: str = ""

    def __post_init__(self) -> None:
        self.path = os.path.join(self.directory, LOCK_FILE)

    def acquire(self) -> RunLock:
        os.makedirs(self.directory, exist_ok=True)
        me = f"{os.getpid()} {socket.gethostname()}"
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                if not self._stale():
                    raise ValueError(self._busy_message()) from None
                os.remove(self.path)  # its process is gone: take it over
                continue
            with os.fdopen(fd, "w") as f:
                f.write(me + "\n")
            return self
        raise ValueError(self._busy_message())

    def _holder(self) -> tuple[int, str] | None:
        try:
            with open(self.path) as f:
                pid, host = f.read().split()
            return int(pid), host
        except (OSError, ValueError):
            return None

    def _stale(self) -> bool:
        holder = self._holder()
        if holder is None or holder[1] != socket.gethostname():
            return False  # unreadable or another machine's: never take it over
        try:
            os.kill(holder[0], 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False

    def _busy_message(self) -> str:
        holder = self._holder()
        who = f"pid {holder[0]} on {holder[1]}" if holder else "another process"
        return (
            f"another aligndp train ({who}) is writing to {self.directory} ({self.path} exists); "
            f"wait for it to finish or use another --out; if that run is gone, delete {self.path}"
        )

    def release(self) -> None:
        holder = self._holder()
        if holder is not None and holder == (os.getpid(), socket.gethostname()):
            try:
                os.remove(self.path)
            except OSError as e:
                if e.errno != errno.ENOENT:
                    raise
