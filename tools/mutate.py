#!/usr/bin/env python
"""Mutation check: does the test suite catch each of a list of deliberate one-line breaks?

Not part of the default suite (it runs the targeted tests once per break, minutes in all).
For every entry of :data:`BREAKS` (read from ``tools/mutations.toml``) it copies the
repository (working tree, or a git revision with ``--rev``) into a temporary directory,
replaces the entry's exact ``original`` snippet in ``src/aligndp/<file>`` by
``replacement``, runs ``pytest -x`` on the entry's ``tests`` with ``PYTHONPATH=<copy>/src``
(so the copy, not the installed package, is imported by the test process, spawned ranks and
``aligndp`` subprocesses alike) and reports:

- ``caught``: the tests failed (exit status 1), as they should;
- ``SURVIVED``: the tests passed with the break in place — the suite does not guard it;
- ``caught*``: the tests errored out in another way (status 2-5: collection/import error,
  or the timeout), which counts as caught but says little;
- ``SNIPPET NOT FOUND`` / ``SNIPPET AMBIGUOUS``: the original text is not in the file exactly
  once — the code moved; refresh the entry (an error: the exit status is non-zero);
- ``UNJUDGED``: the break's tests already fail without any break (the baseline run, skipped
  with ``--no-baseline``), so failing with it proves nothing (an error too).

Usage::

    python tools/mutate.py                      # every break, against the working tree
    python tools/mutate.py --files plan/layout.py,lowp/mx_format.py --jobs 2
    python tools/mutate.py --only no_sync_keeps_syncing --rev HEAD
    python tools/mutate.py --check-snippets     # only verify that every snippet is found

Exit status 0 only if every selected break was caught and every snippet found.
Edit ``tools/mutations.toml`` (one ``[[break]]`` per break) when code moves; keep every
row one line of change.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = "src/aligndp"


@dataclasses.dataclass(frozen=True)
class Break:
    name: str
    file: str
    """Path under src/aligndp/."""
    original: str
    """Exact text that must occur once in the file."""
    replacement: str
    tests: tuple[str, ...]
    """pytest arguments (files or node ids) expected to fail with the break in place."""
    area: str = ""


BREAKS_FILE = ROOT / "tools" / "mutations.toml"


def load_breaks(path: pathlib.Path = BREAKS_FILE) -> list[Break]:
    """The rows of ``mutations.toml``: one ``[[break]]`` table per deliberate break."""
    rows = tomllib.loads(path.read_text())["break"]
    return [Break(**{**row, "tests": tuple(row["tests"])}) for row in rows]


BREAKS: list[Break] = load_breaks()


@dataclasses.dataclass
class Result:
    brk: Break
    status: str
    seconds: float = 0.0
    detail: str = ""


def make_copy(dest: pathlib.Path, rev: str | None) -> None:
    """The repository's files (no .git, build output or runs) at ``dest``."""
    if rev is None:
        ignore = shutil.ignore_patterns(
            ".git", "runs", "__pycache__", "*.egg-info", ".pytest_cache", ".hypothesis"
        )
        shutil.copytree(ROOT, dest, ignore=ignore, symlinks=True)
    else:
        dest.mkdir(parents=True)
        archive = subprocess.run(
            ["git", "-C", str(ROOT), "archive", rev], check=True, capture_output=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)


def locate(brk: Break, tree: pathlib.Path) -> str | None:
    """None if the snippet occurs exactly once, else the error status."""
    path = tree / PACKAGE / brk.file
    if not path.exists():
        return f"SNIPPET NOT FOUND (no file {PACKAGE}/{brk.file})"
    count = path.read_text().count(brk.original)
    if count == 0:
        return f"SNIPPET NOT FOUND in {PACKAGE}/{brk.file}"
    if count > 1:
        return f"SNIPPET AMBIGUOUS ({count} occurrences in {PACKAGE}/{brk.file})"
    return None


def run_tests(tests: tuple[str, ...], tree: pathlib.Path, timeout: float) -> tuple[int, str, float]:
    """``pytest -x`` on ``tests`` in ``tree``.

    Returns (exit status or -1 on timeout, the first failure line, seconds)."""
    env = dict(
        os.environ,
        PYTHONPATH=str(tree / "src") + os.pathsep + str(tree),
        PYTHONDONTWRITEBYTECODE="1",
    )
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
    start = time.monotonic()
    try:
        proc = subprocess.run(
            cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout
        )
        rc, out = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired:
        rc, out = -1, f"timed out after {timeout:.0f} s"
    lines = [
        ln for ln in out.splitlines() if ln.startswith(("FAILED", "ERROR"))
    ] or out.strip().splitlines()[-1:]
    return rc, (lines[0] if lines else ""), time.monotonic() - start


def run_break(brk: Break, tree: pathlib.Path, timeout: float) -> Result:
    error = locate(brk, tree)
    if error:
        return Result(brk, error)
    path = tree / PACKAGE / brk.file
    original = path.read_text()
    path.write_text(original.replace(brk.original, brk.replacement))
    try:
        rc, detail, seconds = run_tests(brk.tests, tree, timeout)
    finally:
        path.write_text(original)
    if rc == 0:
        return Result(brk, "SURVIVED", seconds, detail)
    if rc == 1:
        return Result(brk, "caught", seconds, detail)
    return Result(brk, f"caught* (rc {rc})", seconds, detail)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help="comma-separated break names")
    parser.add_argument(
        "--files",
        default="",
        help="comma-separated files under src/aligndp (e.g. plan/layout.py,lowp/mx_format.py)",
    )
    parser.add_argument(
        "--rev", default=None, help="test this git revision instead of the working tree"
    )
    parser.add_argument(
        "--jobs", type=int, default=1, help="breaks run at once (one repository copy each)"
    )
    parser.add_argument("--timeout", type=float, default=600, help="seconds per break")
    parser.add_argument(
        "--check-snippets", action="store_true", help="only check that every snippet is found once"
    )
    parser.add_argument(
        "--no-baseline",
        action="store_true",
        help="skip running each break's tests without any break first",
    )
    parser.add_argument(
        "--list", action="store_true", help="print the breaks and the tests meant to catch them"
    )
    args = parser.parse_args(argv)

    selected = BREAKS
    if args.only:
        names = set(args.only.split(","))
        unknown = names - {b.name for b in BREAKS}
        if unknown:
            parser.error(f"unknown break(s): {sorted(unknown)}")
        selected = [b for b in selected if b.name in names]
    if args.files:
        files = set(args.files.split(","))
        selected = [b for b in selected if b.file in files]
    if args.list:
        for b in selected:
            print(f"{b.name:45s} {b.area:22s} {b.file:20s} {' '.join(b.tests)}")
        return 0

    with tempfile.TemporaryDirectory(prefix="aligndp-mutate-") as tmp:
        trees = [pathlib.Path(tmp) / f"copy{i}" for i in range(max(1, args.jobs))]
        for tree in trees:
            make_copy(tree, args.rev)
        if args.check_snippets:
            results = [Result(b, locate(b, trees[0]) or "found") for b in selected]
        else:
            free = list(trees)
            results = []
            failing: dict[tuple[str, ...], str] = {}
            if (
                not args.no_baseline
            ):  # the tests must pass without a break, else a failure proves nothing
                targets = sorted({b.tests for b in selected})

                def baseline(tests: tuple[str, ...]) -> tuple[tuple[str, ...], int, str]:
                    tree = free.pop()
                    try:
                        rc, detail, _ = run_tests(tests, tree, args.timeout)
                        return tests, rc, detail
                    finally:
                        free.append(tree)

                with concurrent.futures.ThreadPoolExecutor(max_workers=len(trees)) as pool:
                    for tests, rc, detail in pool.map(baseline, targets):
                        if rc != 0:
                            failing[tests] = detail
                            print(
                                f"BASELINE FAILS (rc {rc}) {' '.join(tests)}: {detail}", flush=True
                            )
                print(
                    f"baseline: {len(targets) - len(failing)} of {len(targets)} "
                    "test targets pass unbroken",
                    flush=True,
                )
                unjudged = [b for b in selected if b.tests in failing]
                results += [Result(b, "UNJUDGED", 0.0, failing[b.tests]) for b in unjudged]
                selected = [b for b in selected if b.tests not in failing]

            def job(b: Break) -> Result:
                tree = free.pop()
                try:
                    return run_break(b, tree, args.timeout)
                finally:
                    free.append(tree)

            with concurrent.futures.ThreadPoolExecutor(max_workers=len(trees)) as pool:
                for result in pool.map(job, selected):
                    results.append(result)
                    print(
                        f"{result.status:22s} {result.brk.name:45s} "
                        f"{result.seconds:6.1f} s  {result.detail}",
                        flush=True,
                    )

    print()
    bad = [r for r in results if r.status.startswith(("SURVIVED", "SNIPPET", "UNJUDGED"))]
    for r in results:
        if r.status.startswith("SNIPPET"):
            print(
                f"ERROR {r.brk.name}: {r.status}: the code moved; refresh its row in BREAKS "
                f"(original: {r.brk.original.strip()[:80]!r})"
            )
    survivors = [r.brk.name for r in results if r.status == "SURVIVED"]
    print(
        f"{len(results)} break(s): {sum(r.status.startswith('caught') for r in results)} caught, "
        f"{len(survivors)} survived{': ' + ', '.join(survivors) if survivors else ''}, "
        f"{sum(r.status.startswith('SNIPPET') for r in results)} snippet(s) not found, "
        f"{sum(r.status == 'UNJUDGED' for r in results)} unjudged (tests fail without the break)"
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
