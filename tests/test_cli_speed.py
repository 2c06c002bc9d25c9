"""The CLI answers at once: ``aligndp --help``, ``aligndp train --help`` and a mistyped flag
import no torch (the flags live in torch-free modules, the package imports lazily) and print
one line for an error, naming the flag meant.

Before: every call imported torch and torch._dynamo (5-6 s on 2 cores) and ``train --stesp 10``
printed the top-level usage with no suggestion."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": os.path.join(REPO, "src")}
BOUND_S = 4.0
"""Generous: about 0.5 s measured on the shared 2-core machine (torch alone takes 2.5 s)."""


def aligndp(*args: str) -> tuple[subprocess.CompletedProcess, float]:
    started = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-m", "aligndp", *args],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=60,
    )
    return result, time.perf_counter() - started


def test_parsers_import_no_torch():
    code = (
        "import sys; from aligndp.app import cli; parser, subs = cli.build_parser(); "
        "parser.format_help(); [p.format_help() for p in subs.values()]; import aligndp; "
        "from aligndp.models import PRESETS; "
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=60
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(
    ("args", "rc", "expect"),
    [
        (["--help"], 0, "GPT presets (--preset): demo (137 k params)"),
        (["train", "--help"], 0, "gpt2-small (124.4 M params)"),
        (["layout", "--help"], 0, "--sharding {none,zero1}"),
        (
            ["train", "--stesp", "10"],
            2,
            "aligndp train: error: unrecognized arguments: --stesp 10; did you mean --steps? "
            "(see aligndp train --help)",
        ),
        (
            ["train", "--optimizer", "adamv"],
            2,
            "aligndp train: error: argument --optimizer: invalid choice: 'adamv' (choose from "
            "'adamw', 'muon'); did you mean adamw? (see aligndp train --help)",
        ),
        (
            ["trian"],
            2,
            "aligndp: error: argument COMMAND: invalid choice: 'trian' (choose from 'train', "
            "'layout', 'rehearse'); did you mean train? (see aligndp --help)",
        ),
    ],
)
def test_help_and_bad_flags_answer_at_once(args, rc, expect):
    result, seconds = aligndp(*args)
    assert result.returncode == rc, result.stderr
    assert seconds < BOUND_S, f"aligndp {' '.join(args)} took {seconds:.1f} s"
    if rc:
        assert result.stdout == "" and result.stderr.splitlines() == [expect]
    else:
        assert expect in " ".join(result.stdout.split())


def test_help_texts_quote_no_measurements():
    """Figures belong to docs/performance.md, not to --help (--compile quoted H200 timings)."""
    for command in ("train", "layout"):
        text = " ".join(aligndp(command, "--help")[0].stdout.split())
        assert not re.search(r"\d\s*ms\b|benchmarks/results|[Ss]ession ?\d", text), text
