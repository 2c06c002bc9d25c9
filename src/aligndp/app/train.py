"""``aligndp train``: the main job. Options, pre-flight checks and the launch of ranks.

With no arguments it trains the CPU demo GPT on the embedded synthetic language on 2 gloo
ranks that it starts itself through torch's elastic launcher. Inside a process started by
``torchrun`` (``RANK``/``WORLD_SIZE`` set) it trains on that process group instead:
``torchrun --nproc-per-node 8 -m aligndp train --device cuda`` uses NCCL, and on several
nodes ``--replicas R`` shards inside each of R replicas (a node's ranks) and replicates across
them (``aligndp.replica_mesh``).

The options are the fields of :class:`TrainConfig`; the argparse flags are generated from it
(the field docstrings are the help texts). The loop itself lives in ``train_loop.py``, the
metrics, plots and summary in ``train_report.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import signal
import sys
import uuid

from aligndp.app.train_config import TrainConfig, add_arguments, compile_blocker, config_from_args
from aligndp.models.gpt import PRESETS

__all__ = ["TrainConfig", "add_arguments", "config_from_args", "launch_local", "run", "train"]


def _inside_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def check_can_compile(device: str) -> None:
    """Raise a one-line ``ValueError`` where ``--compile`` cannot work on ``device``."""
    why = compile_blocker(device)
    if why:
        raise ValueError(f"--compile: {why}; install it or drop --compile")


def preflight(config: TrainConfig) -> None:
    """Checks that need the machine or files, run once before any rank starts (so that a bad
    input is one clear error, not one per rank)."""
    import torch

    from aligndp.app.data import BatchSpec
    from aligndp.app.metric_sinks import check_installed
    from aligndp.app.run_checkpoints import check_resume_from, resume_point
    from aligndp.app.train_loop import load_data, wgrad_backend

    cfg = PRESETS[config.preset]
    BatchSpec(config.batch_size, cfg.seq_len, config.nproc, config.micro_batches)
    load_data(config).check(seq_len=cfg.seq_len, vocab_size=cfg.vocab_size)
    wgrad_backend(config)  # raises for a recipe with no backend on --device
    if config.compile:
        check_can_compile(config.device)
    if config.device == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("--device cuda but torch sees no CUDA device; use --device cpu")
        if not _inside_torchrun() and config.nproc > torch.cuda.device_count():
            raise ValueError(
                f"--nproc {config.nproc} ranks need {config.nproc} GPUs, torch sees "
                f"{torch.cuda.device_count()}; use --nproc {torch.cuda.device_count()}"
            )
    check_installed(config.loggers)
    if config.resume_from is not None:
        check_resume_from(config.resume_from)
    elif config.resume and resume_point(config) is None:
        raise ValueError(
            f"--resume but {config.checkpoint_path} holds no complete checkpoint; a run saves "
            "one when it ends (unless --no-final-checkpoint), or drop --resume"
        )


def launch_local(entrypoint, nproc: int, *args) -> dict[int, object]:
    """Run ``entrypoint(*args)`` on ``nproc`` ranks of this machine through torch's elastic
    launcher (c10d rendezvous on localhost, a free port, no restarts; each rank gets
    RANK/WORLD_SIZE/MASTER_ADDR/... in its environment) and return each rank's result.

    ``entrypoint`` must be a module-level function: ranks are spawned processes.
    """
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

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
    with _quiet_launcher():
        return elastic_launch(launch, entrypoint)(*args)


@contextlib.contextmanager
def _quiet_launcher():
    """The launcher's own warnings ("Received 2 death signal ...") would double our one-line
    errors. Each of its modules has its own logger: raise theirs to ERROR for the launch and
    put every level back afterwards (the caller's logging configuration is theirs)."""
    loggers = [
        logging.getLogger(name)
        for name in list(logging.root.manager.loggerDict)
        if name.startswith("torch.distributed.elastic")
    ]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _run_dirs(config: TrainConfig) -> list[str]:
    """Directories this run writes: --out, and the checkpoint directory when it has one."""
    dirs = [config.out]
    saves = config.checkpoint_every or config.final_checkpoint or config.resume
    if saves and config.checkpoint_path not in dirs:
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
            from aligndp.lowp.recipes import get_recipe

            # the ranks are fresh interpreters: a recipe registered at runtime goes with them
            recipe = get_recipe(config.wgrad)
            result = launch_local(launched_worker, config.nproc, config, recipe)[0]
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
        world = int(os.environ["WORLD_SIZE"]) if _inside_torchrun() else None
        train(config_from_args(args, world_size=world))
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
            f"aligndp train: error: {', '.join(_describe(f) for f in failures)} failed; "
            "a rank's traceback, if it wrote one, is above",
            file=sys.stderr,
        )
        return 1
    return 0
