r"""What one training step runs through, counted: files, functions, crossings between packages.

    PYTHONPATH=$PWD/src python tools/step_trace.py            # ZeRO-1 AdamW, 2 gloo ranks
    PYTHONPATH=$PWD/src python tools/step_trace.py --json     # one JSON line

The step (issue 40): a small net wrapped by ``aligndp.parallelize(sharding="zero1",
overlap_param_gather=True)`` at 2 gloo ranks on CPU; after two warm-up steps (readiness
learned, gathers overlapped), rank 0 traces ``loss.backward(); opt.step(); opt.zero_grad()``
with :func:`sys.setprofile` and counts, over aligndp's own code only:

- ``files``: source files under ``src/aligndp`` in which some function was entered;
- ``functions``: distinct functions entered (code objects);
- ``crossings``: distinct call edges (caller function -> callee function) whose two ends lie
  one in ``optim/`` and one in ``runtime/``, either way — how often control passes between the
  optimizer and the model;
- ``climbs``: distinct call edges into a layer the caller may not import (DESIGN.md
  "Modules"): a callback or listener calling back up;
- ``build``: the same counts for the ``parallelize()`` call that built the model;
- ``parallelize_lines``: lines of code of ``parallelize()`` (no docstring, comments, blanks).

On 2026-12-03, before issue 40's rebuild (main at 288163f): step 14 files, 63 functions,
8 crossings, 1 climb (the reducer's listener into the optimizer); parallelize() 91 lines,
building 29 files, 222 functions, 0 climbs. On 2026-12-07, with the masters kept by the
buckets ([Note: masters with the buckets] in runtime/masters.py) and the step top-down: 12
files, 56 functions, 3 crossings (zero_grad, finish_grad_sync, launch_rest), 0 climbs;
parallelize() 37 lines, building 63 files, 409 functions, 0 climbs. Later that day, with one
``Bucket`` type (runtime/bucket.py), the reducer in one file by concern and the optimizer's
step inside the reducer's step window (``reducer.update()``): 8 files, 64 functions, 2
crossings (the window, zero_grad), 0 climbs.

:func:`trace_step` is what tests/test_structure.py pins (the figures cannot regress).
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import inspect
import json
import os
import pathlib
import socket
import sys
import tempfile
import textwrap

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

# the aligndp that runs (an install from another checkout traces that checkout's files)
SRC = pathlib.Path(importlib.util.find_spec("aligndp").origin).resolve().parent


def _package(filename: str) -> str | None:
    """``optim``, ``runtime``, ... for a file under src/aligndp, else None."""
    path = pathlib.Path(filename).resolve()
    try:
        rel = path.relative_to(SRC)
    except ValueError:
        return None
    return rel.parts[0] if len(rel.parts) > 1 else "api"


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4)
    )


def _step(model, opt, x) -> None:
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()


# which layers each layer may import (tests/test_structure.py's ALLOWED, DESIGN.md "Modules"):
# a call into a layer the caller may not import is a call back up (a callback, a listener)
LAYERS_BELOW: dict[str, set[str]] = {
    "plan": set(),
    "lowp": {"plan"},
    "runtime": {"plan"},
    "state": {"plan", "runtime"},
    "optim": {"plan", "runtime", "state"},
    "api": {"plan", "lowp", "runtime", "state", "optim"},
}


class _Recorder:
    """A :func:`sys.setprofile` function counting aligndp's files, functions and call edges."""

    def __init__(self) -> None:
        self.files: set[str] = set()
        self.functions: set[tuple[str, int, str]] = set()
        self.crossings: set[tuple[str, str]] = set()
        self.climbs: set[tuple[str, str]] = set()

    def __call__(self, frame, event, _arg) -> None:
        if event != "call":
            return
        code = frame.f_code
        pkg = _package(code.co_filename)
        if pkg is None:
            return
        self.files.add(code.co_filename)
        self.functions.add((code.co_filename, code.co_firstlineno, code.co_qualname))
        caller = frame.f_back  # the nearest aligndp frame below (torch's frames skipped)
        while caller is not None and _package(caller.f_code.co_filename) is None:
            caller = caller.f_back
        if caller is None:
            return
        src = caller.f_code
        if src.co_name == "<module>" and caller is not frame.f_back:
            return  # the import machinery (binding a submodule on its package), not the module
        edge = (f"{src.co_filename}:{src.co_qualname}", f"{code.co_filename}:{code.co_qualname}")
        here = _package(src.co_filename)
        if {here, pkg} == {"optim", "runtime"}:
            self.crossings.add(edge)
        if pkg != here and here in LAYERS_BELOW and pkg not in LAYERS_BELOW[here]:
            self.climbs.add(edge)

    def run(self, fn):
        sys.setprofile(self)
        try:
            return fn()
        finally:
            sys.setprofile(None)

    def counts(self) -> dict:
        return {
            "files": len(self.files),
            "functions": len(self.functions),
            "crossings": len(self.crossings),
            "climbs": len(self.climbs),
            "file_list": sorted(
                str(pathlib.Path(f).resolve().relative_to(SRC)) for f in self.files
            ),
            "crossing_list": sorted(f"{_short(a)} -> {_short(b)}" for a, b in self.crossings),
            "climb_list": sorted(f"{_short(a)} -> {_short(b)}" for a, b in self.climbs),
        }


def _trace_rank(rank: int, world_size: int, init: str, out: str) -> None:
    import aligndp

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world_size)
    try:
        build = _Recorder()
        model, opt = build.run(
            lambda: aligndp.parallelize(
                _net(), sharding="zero1", overlap_param_gather=True, lr=1e-2, bucket_numel=600
            )
        )
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(rank))
        for _ in range(2):
            _step(model, opt, x)
        loss = model(x).square().mean()
        step = _Recorder()

        def one_step() -> None:
            loss.backward()
            opt.step()
            opt.zero_grad()

        step.run(one_step)
        if rank == 0:
            result = step.counts() | {"build": build.counts()}
            pathlib.Path(out).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def _short(where: str) -> str:
    filename, name = where.rsplit(":", 1)
    return f"{pathlib.Path(filename).resolve().relative_to(SRC)}:{name}"


def count_code_lines(source: str) -> int:
    """Lines of code in the body of the one function defined in ``source``: no docstring,
    comments or blank lines."""
    source = textwrap.dedent(source)
    body = ast.parse(source).body[0].body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    lines = source.splitlines()
    code = [lines[i - 1] for node in body for i in range(node.lineno, node.end_lineno + 1)]
    return sum(1 for line in code if line.strip() and not line.strip().startswith("#"))


def parallelize_lines() -> int:
    """Lines of code of ``aligndp.parallelize.parallelize``."""
    # the module, not the function the package exports under the same name
    module = importlib.import_module("aligndp.parallelize")
    return count_code_lines(inspect.getsource(module.parallelize))


def trace_step(world_size: int = 2) -> dict:
    """Run the traced step at ``world_size`` gloo ranks; the counts of rank 0."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "trace.json")
        mp.spawn(
            _trace_rank,
            args=(world_size, f"tcp://127.0.0.1:{port}", out),
            nprocs=world_size,
            join=True,
        )
        result = json.loads(pathlib.Path(out).read_text())
    result["parallelize_lines"] = parallelize_lines()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--json", action="store_true", help="one JSON line")
    args = parser.parse_args()
    result = trace_step(args.ranks)
    if args.json:
        print(json.dumps(result))
        return
    print(f"files entered:        {result['files']}")
    for f in result["file_list"]:
        print(f"  {f}")
    print(f"crossings optim<->runtime (distinct call edges): {result['crossings']}")
    for c in result["crossing_list"]:
        print(f"  {c}")
    print(f"functions entered:    {result['functions']}")
    print(f"calls back up a layer: {result['climbs']}")
    for c in result["climb_list"]:
        print(f"  {c}")
    build = result["build"]
    print(f"parallelize(): {result['parallelize_lines']} lines of code; building enters")
    print(f"  {build['files']} files, {build['functions']} functions; calls back up a layer:")
    for c in build["climb_list"]:
        print(f"  {c}")


if __name__ == "__main__":
    main()
