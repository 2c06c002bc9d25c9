"""Run many multi-rank test cases inside gloo process groups (tests/_worlds.py keeps one
world per world size alive for the session): registering the cases, collecting their results.

Spawning processes costs seconds; a test module registers its cases with :func:`case`, and
:func:`make_tests` creates one pytest test per (case, world size) backed by a module-scoped
run that sends each world size's cases, as one job, to the kept world of that size
(tests/_worlds.py: started at its first job, reused by later modules with the process state put
back; ``ALIGNDP_TEST_FRESH_WORLDS=1`` starts one per module and world size instead). A case is a
module-level function ``fn(rank, world_size)``; it raises to fail. After every case the ranks
agree on whether anybody failed, so one rank's error cannot leave the others waiting in a
collective of the next case.

Every failure names its case: a case may raise anything, ``BaseException`` included
(pytest's ``Failed`` from a ``pytest.raises`` that did not raise, ``SystemExit``), and is
reported as that case's failure while the other cases of its world size still run. A rank
that dies outright (``os._exit``, a crash in C++) fails the case it was running, named from a
progress file each rank writes before every case; the cases after it are reported as not run.
A case that runs past :func:`case_timeout` on a rank fails with every rank's stacks. A case
that fails on some ranks while the others wait in a collective the failed ones left (a check
on one rank only, between two collectives) fails within ``ALIGNDP_TEST_FAILURE_GRACE``
seconds (default 10) with the failure and where the others wait: the world is stopped
(tests/_worlds.py), and the cases after it are reported as not run.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import tempfile
from collections.abc import Callable

import pytest

from tests._worlds import Job, run_job


def case_timeout() -> float:
    """Seconds one case may run on a rank (``ALIGNDP_CASE_TIMEOUT``, default 600) before that
    rank dumps every thread's stack (the call it waits in) under the rank and case name, and
    exits: the case fails naming both, never hangs. Read at each run."""
    return float(os.environ.get("ALIGNDP_CASE_TIMEOUT", "600"))


def _read(path: str, default: object) -> object:
    try:
        with open(path, "rb") as f:
            return pickle.load(f)
    except FileNotFoundError:
        return default


def run_cases(module: str, names: list[str], world_size: int) -> dict[str, str | None]:
    """Run ``names`` of ``module`` on ``world_size`` gloo ranks; error text (or None) per case.

    If a rank process dies, the case it was running gets the error (with the spawn error's
    text) and every case no rank finished gets "not run"; cases finished before keep theirs.
    """
    with tempfile.TemporaryDirectory(prefix="aligndp-job-") as tmp:
        died = run_job(Job(module, names, tmp, case_timeout()), world_size)
        merged: dict[str, str | None] = dict.fromkeys(names)
        finished: set[str] = set(names)
        for r in range(world_size):
            done = _read(os.path.join(tmp, f"rank{r}.pkl"), {})
            finished &= set(done)
            for name, err in done.items():
                if err is not None and (
                    merged[name] is None or "another rank failed" in merged[name]
                ):
                    merged[name] = err
        if died is None:
            return merged
        running = {r: _read(os.path.join(tmp, f"rank{r}.current"), None) for r in range(world_size)}
        crashed_in = sorted(
            {name for name in running.values() if name is not None and name not in finished},
            key=names.index,
        )
        for name in names:
            if name in finished:
                continue
            if name in crashed_in:
                ranks = [r for r, n in running.items() if n == name]
                merged[name] = (
                    f"a rank process died or the world was stopped while rank(s) {ranks} ran "
                    f"this case: {died}" + _stacks(tmp, world_size)
                )
            else:
                merged[name] = (
                    f"not run: a rank process died or the world was stopped during "
                    f"{crashed_in or 'start-up'}: {died}"
                )
        return merged


def _stacks(tmp: str, world_size: int) -> str:
    """The stacks the ranks dumped (faulthandler: a header naming rank and case, then every
    thread's stack): past :func:`case_timeout` (``rank{r}.stack``), or when the world was
    stopped after another rank failed the case (``rank{r}.stuck``); or ""."""
    out = ""
    for r in range(world_size):
        for kind in ("stack", "stuck"):
            with (
                contextlib.suppress(FileNotFoundError),
                open(os.path.join(tmp, f"rank{r}.{kind}")) as f,
            ):
                text = f.read()
                if "most recent call first" in text:
                    out += "\n" + text
    return out


_REGISTRY: dict[str, dict[str, tuple[int, ...]]] = {}
_XFAIL: dict[str, dict[str, str]] = {}
"""module -> case -> the reason of a strict xfail (a convention that differs from a peer's)."""
_AFTER: dict[str, dict[int, set[int]]] = {}
"""module -> world size -> world sizes whose cases must have run first (e.g. wrote a file it
reads)."""


def case(*world_sizes: int, after: tuple[int, ...] = (), xfail: str | None = None) -> Callable:
    """Register a module-level function ``fn(rank, world_size)`` to run at these world sizes.

    ``after``: world sizes of this module whose cases run before these (whatever pytest selects).
    ``xfail``: the case keeps a peer suite's expectation that aligndp's documented convention
    breaks; its test is a strict xfail with this reason (it fails if the case passes).
    """

    def register(fn: Callable) -> Callable:
        _REGISTRY.setdefault(fn.__module__, {})[fn.__name__] = world_sizes
        if xfail is not None:
            _XFAIL.setdefault(fn.__module__, {})[fn.__name__] = xfail
        for ws in world_sizes:
            _AFTER.setdefault(fn.__module__, {}).setdefault(ws, set()).update(after)
        return fn

    return register


def make_tests(module_globals: dict) -> None:
    """Create ``test_<case>[ws]`` functions in a test module for its registered cases."""
    module = module_globals["__name__"]
    cases = _REGISTRY.get(module, {})
    cache: dict[int, dict[str, str | None]] = {}

    def results(ws: int) -> dict[str, str | None]:
        for first in sorted(_AFTER.get(module, {}).get(ws, ())):
            results(first)
        if ws not in cache:
            cache[ws] = run_cases(module, [n for n, s in cases.items() if ws in s], ws)
        return cache[ws]

    for name, case_sizes in cases.items():

        def test(ws: int, _name: str = name) -> None:
            err = results(ws)[_name]
            if err is not None:
                pytest.fail(err, pytrace=False)

        test.__name__ = f"test_{name}"
        reason = _XFAIL.get(module, {}).get(name)
        if reason is not None:
            test = pytest.mark.xfail(strict=True, reason=reason)(test)
        module_globals[test.__name__] = pytest.mark.parametrize("ws", case_sizes)(test)
