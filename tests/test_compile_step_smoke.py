"""``benchmarks/compile_step.py --smoke``: issue 22's compiled-step benchmark, on one gloo rank.

The figures come from a GPU run; CI checks that the CPU smoke mode steps every variant eager
and compiled (aot_eager) in one process and prints each beside plain torch and torch DDP of
the same run, with the host time in gradient hooks from the profiler.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_smoke_run_prints_every_variant_beside_its_peers():
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
    )
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(var, None)  # one rank of its own
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "compile_step.py"), "--smoke"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    got = {(r["variant"], r["mode"]) for r in rows}
    expected = {
        (v, m)
        for v in ("torch", "torch_ddp", "aligndp_none", "aligndp_zero1", "aligndp_bf16")
        for m in ("eager", "compiled")
    } | {("aligndp_none_blocks", "compiled")}
    assert got == expected, got ^ expected
    for r in rows:
        assert r["ms_per_step"] > 0 and r["hook_host_ms_per_step"] >= 0, r
        assert r["vs_torch"] > 0 and r["vs_torch_ddp"] > 0, r
    assert "| aligndp_none | compiled |" in result.stdout
