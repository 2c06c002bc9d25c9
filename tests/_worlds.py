"""Gloo worlds kept alive for the whole pytest session, one per world size (tests/_dist.py's
job-running part): the pytest process's side (starting, reusing and stopping worlds); each
rank's side, running a job's cases, is tests/_world_rank.py.

Starting a world costs seconds (every rank imports torch and aligndp), and a session needs
worlds of 1, 2, 3, 4 and 8 ranks for about 25 modules. So a world, once started, stays and runs
the next module's cases of its size too: :func:`run_job` sends a job (a module, its case
names, a folder for the results) to every rank of the kept world of that size and waits until
each rank has run it or one has died.

What a job sees is what a freshly spawned world would give it, as far as a process can be put
back: before each job a rank takes the pytest process's environment
variables, working directory and ``sys.path`` (what a spawned rank inherits) and reseeds its
random generators from fresh entropy (torch seeds a new process at random, and so does Python);
after each job it puts back the default dtype and device, grad mode, anomaly mode,
deterministic algorithms, float32 matmul precision, thread count and warning filters it had at
start, and resets Dynamo (``torch._dynamo.reset()``). Module-level state of imported libraries
(aligndp's caches of process groups, Lightning's and accelerate's singletons) stays, as it
stays between the cases of one module.

A world is given up, and the next job of its size starts a new one, when a rank dies (the job's
running case fails, the others are not run: tests/_dist.py reports them), when any case of a
job fails (a rank that raised between two collectives may leave the others' collective
sequence out of step, which must not fail the next module), or when environment variables that
only take effect at start (``ATEN_*``, ``OMP_*``, thread counts) differ from the world's. A
world is stopped at once, without waiting for its job, when a case failed on some ranks and
the others have not finished it ``ALIGNDP_TEST_FAILURE_GRACE`` seconds (default 10) later:
they wait in a collective the failed ranks left, which would hang until a timeout (gloo's, or
the case's); they first write where they wait (SIGUSR1, faulthandler).

``ALIGNDP_TEST_KEPT_RANKS`` (default 8) caps the ranks kept alive at once, so memory stays
bounded: starting a world past the cap first stops the least recently used ones, and a world
larger than the cap runs its job and stops. ``ALIGNDP_TEST_FRESH_WORLDS=1`` starts a fresh
world for every job (one per module and world size) and stops it after. Both are read at each
job.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import tempfile
import time
from multiprocessing import connection, get_context

from tests._world_rank import Job, rank_main

__all__ = ["Job", "World", "failure_grace", "kept", "run_job"]

_START_ONLY_ENV = ("ALIGNDP_TEST_THREADS", "ATEN_", "MKL_", "OMP_", "KMP_", "LD_", "PYTHON")
"""Prefixes of variables read once, when a rank starts (torch's import, the thread count): a
world started under other values is not reused."""


class World:
    """``size`` rank processes in one gloo process group, waiting for jobs."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.start_env = _start_env()
        self._tmp = tempfile.TemporaryDirectory(prefix="aligndp-world-")
        init_file = os.path.join(self._tmp.name, "rendezvous")
        ctx = get_context("spawn")
        self.conns: list[connection.Connection] = []
        self.procs = []
        for rank in range(size):
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(
                target=rank_main, args=(rank, size, init_file, theirs), name=f"rank{rank}"
            )
            proc.start()
            theirs.close()
            self.conns.append(mine)
            self.procs.append(proc)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def run(self, job: Job) -> tuple[str | None, bool]:
        """Run ``job`` on every rank: (why a rank is gone or None, whether a case failed). A
        world with a dead rank is stopped, and so is one where a case failed on some rank and
        the others had not agreed on it :func:`failure_grace` seconds later (they wait in a
        collective the failed rank left): why names the case, the failure and where they
        wait."""
        for conn in self.conns:
            try:
                conn.send(job)
            except OSError:
                pass  # a rank is gone already: its exit code says so below
        waiting = set(range(self.size))
        raised: dict[int, str] = {}
        failed = False
        watch = _FailureWatch(self.size, failure_grace())
        while waiting:
            sentinels = [p.sentinel for p in self.procs]
            conns = [self.conns[r] for r in waiting]
            for ready in connection.wait(conns + sentinels, timeout=watch.left()):
                if ready in sentinels:
                    continue
                r = self.conns.index(ready)
                try:
                    what, *detail = ready.recv()
                except (EOFError, OSError):
                    continue  # the rank exited: its sentinel says how
                if what in ("failed", "agreed"):
                    watch.note(r, what, *detail)
                    continue
                waiting.discard(r)
                if what == "raised":  # and it exits
                    raised[r] = detail[0]
                    self.procs[r].join(timeout=30)
                else:
                    failed = failed or detail[0]
            dead = [r for r, p in enumerate(self.procs) if p.exitcode is not None]
            if dead:
                if any(_dumped(job.out_dir, r, "stack") for r in dead):
                    self._let_exit(5)  # a case timeout: the others' are due too, let them dump
                self.close(at_once=True)
                why = "; ".join(_death(r, self.procs[r].exitcode, raised.get(r)) for r in dead)
                return why, True
            if watch.expired():
                stuck = watch.stuck()
                self._dump_stacks(stuck, job.out_dir)
                self.close(at_once=True)
                return watch.why(stuck), True
        return None, failed

    def _let_exit(self, seconds: float) -> None:
        """Wait up to ``seconds`` for every rank to exit by itself."""
        deadline = time.monotonic() + seconds
        for proc in self.procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))

    def _dump_stacks(self, ranks: list[int], out_dir: str) -> None:
        """SIGUSR1 to ``ranks``: each writes every thread's stack to ``rank{r}.stuck``
        (faulthandler, so also while a C++ collective holds its main thread)."""
        for r in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.procs[r].pid, signal.SIGUSR1)
        deadline = time.monotonic() + 5
        for r in ranks:
            while time.monotonic() < deadline and not _dumped(out_dir, r, "stuck"):
                time.sleep(0.05)

    def close(self, at_once: bool = False) -> None:
        """Stop every rank: asked to leave (unless ``at_once``), then terminated, then killed."""
        if not at_once:
            for conn in self.conns:
                try:
                    conn.send(None)
                except OSError:
                    pass
            for proc in self.procs:
                proc.join(timeout=10)
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()
        for proc in self.procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self.conns:
            conn.close()
        self._tmp.cleanup()


class _FailureWatch:
    """The pytest process's view of a job's failed case: the ranks that failed it (with their
    errors) and those that have agreed on it since; a deadline while some have not."""

    def __init__(self, size: int, grace: float) -> None:
        self.size, self.grace = size, grace
        self.case: str | None = None
        self.errors: dict[int, str] = {}
        self.agreed: dict[str, set[int]] = {}
        self.deadline: float | None = None

    def note(self, rank: int, what: str, case: str, error: str | None = None) -> None:
        agreed = self.agreed.setdefault(case, set())
        if what == "agreed":  # may come before another rank's "failed" (other pipes)
            agreed.add(rank)
        elif self.case in (None, case):
            self.case = case
            self.errors[rank] = error
            if self.deadline is None:
                self.deadline = time.monotonic() + self.grace
        if self.case == case and len(agreed) == self.size:
            self.case, self.errors, self.deadline = None, {}, None

    def left(self) -> float | None:
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    def expired(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline

    def stuck(self) -> list[int]:
        """The ranks that neither failed the case nor agreed on it."""
        done = self.agreed.get(self.case, set()) | set(self.errors)
        return [r for r in range(self.size) if r not in done]

    def why(self, stuck: list[int]) -> str:
        first = self.errors[min(self.errors)]
        return (
            f"rank(s) {sorted(self.errors)} failed case {self.case} and rank(s) {stuck} had not "
            f"finished it {self.grace:.0f} s later (they wait in a call the failed rank(s) "
            f"left, in the stacks below), so the world was stopped; the first failure:\n{first}"
        )


def failure_grace() -> float:
    """Seconds the other ranks of a world get to finish a case that failed on one rank
    (``ALIGNDP_TEST_FAILURE_GRACE``, default 10) before the world is stopped. Read at each
    job."""
    return float(os.environ.get("ALIGNDP_TEST_FAILURE_GRACE", "10"))


def _dumped(out_dir: str, rank: int, kind: str) -> bool:
    """Whether faulthandler wrote ``rank``'s stacks to its ``rank{r}.{kind}`` file."""
    try:
        with open(os.path.join(out_dir, f"rank{rank}.{kind}")) as f:
            return "most recent call first" in f.read()
    except FileNotFoundError:
        return False


def _death(rank: int, code: int, raised: str | None) -> str:
    """How a rank process ended, in torch.multiprocessing.spawn's words."""
    how = (
        f"terminated with signal {signal.Signals(-code).name}"
        if code < 0
        else f"terminated with exit code {code}"
    )
    return f"process {rank} {how}" + (f" and the following error:\n{raised}" if raised else "")


def _start_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith(_START_ONLY_ENV)}


def _fresh() -> bool:
    return os.environ.get("ALIGNDP_TEST_FRESH_WORLDS", "0") == "1"


def _kept_ranks() -> int:
    raw = os.environ.get("ALIGNDP_TEST_KEPT_RANKS", "8")
    try:
        cap = int(raw)
    except ValueError:
        cap = -1
    if cap < 0:
        raise ValueError(
            f"ALIGNDP_TEST_KEPT_RANKS={raw!r} is not a whole number >= 0; it caps the ranks "
            "kept alive between test modules (0 keeps none)"
        )
    return cap


_KEPT: dict[int, World] = {}
"""world size -> its kept world, least recently used first."""


def run_job(job: Job, world_size: int) -> str | None:
    """Run ``job`` in a world of ``world_size`` ranks, kept from an earlier job or started now;
    None, or why a rank died. The world is kept for the next job unless a rank died, a case
    failed, fresh worlds are asked for (kept ones are then left alone) or it is larger than the
    cap."""
    cap = _kept_ranks()  # a wrong value fails before any process starts
    if _fresh():
        world = World(world_size)
        died, _ = _run(world, job)
        if died is None:
            world.close()
        return died
    world = _KEPT.pop(world_size, None)
    if world is not None and not (world.alive() and world.start_env == _start_env()):
        world.close(at_once=True)
        world = None
    if world is None:
        _make_room(world_size)  # before it starts: its ranks' memory counts at once
        world = World(world_size)
    died, failed = _run(world, job)
    if died is not None:
        return died
    if failed or world.size > cap:
        world.close()
    else:
        _make_room(world.size)
        _KEPT[world_size] = world
    return None


def _run(world: World, job: Job) -> tuple[str | None, bool]:
    try:
        return world.run(job)
    except BaseException:  # Ctrl-C in pytest: no rank may outlive the session
        world.close(at_once=True)
        raise


def _make_room(size: int) -> None:
    """Stop the least recently used kept worlds until ``size`` more ranks fit the cap."""
    while _KEPT and sum(w.size for w in _KEPT.values()) + size > _kept_ranks():
        _KEPT.pop(next(iter(_KEPT))).close()


def kept() -> dict[int, list[int]]:
    """World size -> the process ids of its kept ranks (tests/test_dist_runner.py)."""
    return {size: w.pids for size, w in _KEPT.items()}


@atexit.register
def _close_all() -> None:
    while _KEPT:
        _KEPT.popitem()[1].close()
