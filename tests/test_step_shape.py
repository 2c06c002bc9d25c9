"""The shape of one step and of its construction, pinned so it cannot grow back (issue 40).

tools/step_trace.py traces one ZeRO-1 AdamW step (2 gloo ranks, overlapped param gather:
``loss.backward(); opt.step(); opt.zero_grad()``) and counts the files, functions and call
edges between ``optim/`` and ``runtime/`` it enters. Before issue 40: 14 files, 63 functions,
8 crossings, one of them the reducer calling into the optimizer (``reduction_listeners`` ->
``CompositeOptimizer._on_reduced``), and ``parallelize()`` 91 lines of code. With the masters
in the model's buckets, one ``Bucket`` type owning each bucket's landing, reduce, masters and
gather, the reducer in one file by concern (its landing state in grad_landing.py, its
agreement in step_agreement.py) and the optimizer's step inside the reducer's step window
(``reducer.update()``), the step crosses twice (the window and ``zero_grad``) and enters 8
files: the issue's goals, pinned.
"""

from __future__ import annotations

import importlib
import pathlib
import sys

TOOLS = pathlib.Path(__file__).resolve().parents[1] / "tools"

MAX_FILES = 8
MAX_CROSSINGS = 2
MAX_PARALLELIZE_LINES = 60


def _tool():
    if str(TOOLS) not in sys.path:  # importable by name: the spawned ranks unpickle from it
        sys.path.insert(0, str(TOOLS))
    return importlib.import_module("step_trace")


def test_parallelize_is_a_short_pipeline():
    """parallelize() calls named build steps (aligndp/build.py); it was 91 lines of code with
    21 locals."""
    lines = _tool().parallelize_lines()
    assert lines <= MAX_PARALLELIZE_LINES, f"parallelize() has {lines} lines of code"


def test_parallelize_lines_counts_code_only():
    """The counter skips the docstring, comments and blank lines (it can fail: a function
    of 3 statements counts 3)."""
    tool = _tool()
    source = 'def f():\n    """doc\n    more"""\n    a = 1\n\n    # c\n    b = (\n        2)\n'
    assert tool.count_code_lines(source) == 3


def test_one_step_enters_few_files_and_the_model_never_calls_the_optimizer():
    """Control passes from the optimizer into the model only: no call edge starts in
    ``runtime/`` and ends in ``optim/`` (the reducer's listener was one), no call goes into a
    layer its caller may not import (tests/test_structure.py's layers), neither in the step
    nor while ``parallelize()`` builds, and the step enters no more than 8 files and crosses
    at most twice (issue 40's goals)."""
    result = _tool().trace_step(2)
    upward = [c for c in result["crossing_list"] if c.startswith("runtime/")]
    assert not upward, f"the model calls into the optimizer: {upward}"
    assert not result["climbs"], f"calls back up a layer in the step: {result['climb_list']}"
    build = result["build"]
    assert not build["climbs"], f"calls back up a layer in parallelize(): {build['climb_list']}"
    assert build["functions"] > 50, "the trace saw parallelize() build"
    assert result["files"] <= MAX_FILES, result["file_list"]
    assert result["crossings"] <= MAX_CROSSINGS, result["crossing_list"]
    assert result["functions"] > 20, "the trace saw the step (a tracer that saw nothing passes)"
