"""The rank's side of a kept gloo world (tests/_worlds.py): start, then run each job the
pytest process sends, as a freshly spawned rank would, and put the process state back after.

A job's cases run in order; after each the ranks agree (one all-reduce) on whether any rank
failed it. A failure is also sent to the pytest process at once, and every rank says when it
has agreed on it, so the pytest process can stop a world whose other ranks wait in a
collective the failed rank left (tests/_worlds.py). Results, the running case and the stacks
faulthandler writes (past the case timeout, or on SIGUSR1) go to files in the job's folder,
which tests/_dist.py reads.
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import pickle
import random
import signal
import sys
import time
import traceback
import warnings
from dataclasses import dataclass, field
from multiprocessing import connection

__all__ = ["TIMEOUT", "Job", "rank_main"]

TIMEOUT = datetime.timedelta(seconds=120)
"""gloo's timeout for one collective of the runner's own (the world's start, the agreement
after each case)."""


@dataclass
class Job:
    """What every rank of a world runs: ``names`` of ``module`` in order, results under
    ``out_dir`` (``rank{r}.pkl``, ``.current``, ``.stack``, ``.stuck``), as a fresh rank would
    see it."""

    module: str
    names: list[str]
    out_dir: str
    case_timeout: float
    environ: dict[str, str] = field(default_factory=lambda: dict(os.environ))
    cwd: str = field(default_factory=os.getcwd)
    sys_path: list[str] = field(default_factory=lambda: list(sys.path))


def rank_main(rank: int, world_size: int, init_file: str, conn: connection.Connection) -> None:
    try:
        _serve(rank, world_size, init_file, conn)
    except BaseException:  # noqa: BLE001  outside any case: the rank is lost, say why
        conn.send(("raised", traceback.format_exc()))
        _leave(1)
    _leave(0)


def _serve(rank: int, world_size: int, init_file: str, conn: connection.Connection) -> None:
    """Start the rank, then run jobs until the pytest process says stop (or is gone)."""
    import torch
    import torch.distributed as dist

    # 1 thread per rank; ALIGNDP_TEST_THREADS=2 re-runs the cases with other reduction splits
    # (tests/models.py [Tolerances])
    torch.set_num_threads(int(os.environ.get("ALIGNDP_TEST_THREADS", "1")))
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size, timeout=TIMEOUT
    )
    start = _ProcessState()
    while True:
        try:
            job = conn.recv()
        except EOFError:  # the pytest process is gone
            break
        if job is None:
            break
        _take_inherited(job)
        with warnings.catch_warnings():  # the filters as they were, after the job
            failed = _run_job(rank, world_size, job, conn)
        start.restore()
        conn.send(("done", failed))
    dist.destroy_process_group()


def _leave(code: int) -> None:
    # Leave without interpreter teardown: about 1 run in 16 aborted there ("terminate called
    # without an active exception", no Python frame) after every case had passed and the
    # results were written, failing the whole world size.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _take_inherited(job: Job) -> None:
    """What a spawned rank inherits from the pytest process, as of this job; fresh seeds."""
    import torch

    os.environ.clear()
    os.environ.update(job.environ)
    os.chdir(job.cwd)
    sys.path[:] = job.sys_path
    torch.seed()
    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()


class _ProcessState:
    """The process-wide settings a case may change, as the rank had them at start."""

    def __init__(self) -> None:
        import torch

        self.dtype = torch.get_default_dtype()
        self.device = torch.get_default_device()
        self.grad = torch.is_grad_enabled()
        self.anomaly = torch.is_anomaly_enabled()
        self.deterministic = torch.are_deterministic_algorithms_enabled()
        self.warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
        self.matmul = torch.get_float32_matmul_precision()
        self.threads = torch.get_num_threads()

    def restore(self) -> None:
        import gc

        import torch

        if "torch._dynamo" in sys.modules:  # imported by a case: drop its compiled code
            torch._dynamo.reset()
        torch.set_default_dtype(self.dtype)
        if torch.get_default_device() != self.device:
            torch.set_default_device(self.device)
        torch.set_grad_enabled(self.grad)
        torch.set_anomaly_enabled(self.anomaly)
        torch.use_deterministic_algorithms(self.deterministic, warn_only=self.warn_only)
        torch.set_float32_matmul_precision(self.matmul)
        torch.set_num_threads(self.threads)
        gc.collect()


def _run_job(rank: int, world_size: int, job: Job, conn: connection.Connection) -> bool:
    """Run the job's cases; after each, the ranks agree on whether anybody failed, so one
    rank's error cannot leave the others waiting in a collective of the next case. True if a
    case failed (on any rank).

    A failed case is told to the pytest process at once (``("failed", case, error)``), before
    the agreement, and every rank says when it has agreed on it (``("agreed", case)``): a rank
    that failed between two collectives of a case leaves the others waiting in the second, and
    the pytest process stops the world when they do not follow (:meth:`World.run`), after
    SIGUSR1 made them write where they wait (``rank{r}.stuck``)."""
    import importlib

    import torch
    import torch.distributed as dist

    began = time.perf_counter()
    mod = importlib.import_module(job.module)
    _log_time(rank, world_size, job.module, "(import)", began)
    results: dict[str, str | None] = {}
    out = job.out_dir
    with (
        open(os.path.join(out, f"rank{rank}.stack"), "w") as stacks,
        open(os.path.join(out, f"rank{rank}.stuck"), "w") as stuck,
    ):
        faulthandler.register(signal.SIGUSR1, file=stuck, all_threads=True)
        for name in job.names:
            _write(os.path.join(out, f"rank{rank}.current"), name)
            _header(stacks, f"rank {rank} ran case {name} for over {job.case_timeout:.0f} s")
            _header(stuck, f"rank {rank} had not finished case {name} when another rank failed it")
            faulthandler.dump_traceback_later(job.case_timeout, exit=True, file=stacks)
            began = time.perf_counter()
            error = None
            try:
                getattr(mod, name)(rank, world_size)
            except KeyboardInterrupt:
                raise
            except BaseException:  # noqa: BLE001  pytest's Failed and SystemExit too: reported
                error = f"rank {rank}: " + traceback.format_exc()
                # at once, while the case's frames live: freeing them runs the finalisers of
                # what the case built, which may wait in a collective the failure left
                conn.send(("failed", name, error))
            faulthandler.cancel_dump_traceback_later()
            flag = torch.tensor([0 if error is None else 1])
            dist.all_reduce(flag)
            if error is None and flag.item():
                error = f"rank {rank}: another rank failed"
            results[name] = error
            _log_time(rank, world_size, job.module, name, began)
            _write(os.path.join(out, f"rank{rank}.pkl"), results)  # survives a later crash
            dist.barrier()
            if flag.item():
                conn.send(("agreed", name))
        faulthandler.unregister(signal.SIGUSR1)
    _write(os.path.join(out, f"rank{rank}.current"), None)
    return any(error is not None for error in results.values())


def _header(f, what: str) -> None:
    """Start ``f`` afresh with a line saying whose stacks faulthandler may write after it."""
    f.seek(0)
    f.truncate()
    f.write(f"{what}; it waits in:\n")
    f.flush()


def _log_time(rank: int, world_size: int, module: str, name: str, began: float) -> None:
    """With ``ALIGNDP_TEST_CASE_TIMES=<file>``, rank 0 appends ``seconds<TAB>module[ws]::case``
    (the case and the ranks' agreement after it): pytest's ``--durations`` sees only the first
    test of each world size, which waits for the whole job."""
    path = os.environ.get("ALIGNDP_TEST_CASE_TIMES")
    if path and rank == 0:
        with open(path, "a") as f:
            f.write(f"{time.perf_counter() - began:.2f}\t{module}[{world_size}]::{name}\n")


def _write(path: str, obj: object) -> None:
    with open(path + ".tmp", "wb") as f:
        pickle.dump(obj, f)
    os.replace(path + ".tmp", path)
