"""Run a script of ``examples/`` as its docstring says, under torch's elastic launcher."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def torchrun(script: pathlib.Path, *args: str, nproc: int = 2, timeout: float = 300) -> str:
    """``torchrun --standalone --nproc-per-node nproc script args``; returns its stdout and
    fails with the tail of its output when it exits non-zero (``--standalone``: a free port,
    so parallel test runs do not meet on one)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", str(nproc), str(script), *args]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout
