"""``benchmarks/run_all.py --smoke``: the one-command benchmark of issue 14, on 2 gloo ranks.

The GPU run is one call on a borrowed machine; a row that silently vanished (a section that
raised, a key renamed) would only show there. So CI runs the CPU smoke mode and checks that
every row of the issue's table is printed and written, with a figure or an explicit skip.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The rows of issue 14's table and the figures its "Done when" asks for beside them; a key
# ending in "@" stands for one row per message size.
EXPECTED = [
    "ddp.step",
    "local.fwdbwd@rank0",
    "local.fwdbwd@rank1",
    "local.skew",
    "nccl.all_reduce@",
    "nccl.reduce_scatter@",
    "nccl.all_gather@",
    "zero1.vs_torch",
    "zero1.vs_aligndp_ddp",
    "ddp_adamw.vs_torch",
    "muon.step",
    "compile.vs_torch_ddp",
    "compile.blocks_vs_torch_ddp",
    "compile.hooks_ms",
    "mx.fp8_step",
    "mx.mxfp8_step",
    "mx.wgrad_mxfp8",
    "mx.wgrad_fp8",
    "mx.quantise_fp8",
    "mx.quantise_mxfp8",
    "fp8.tensor_compile.vs_torchao",
    "fp8.tensor_compile.vs_bf16",
    "fp8.blockwise_compile.vs_bf16",
    "fp8.small_compile.vs_bf16_compile",
    "fp8.small_eager.vs_bf16",
]
GPU_ONLY = [
    *EXPECTED[-5:],
    "compile.vs_torch_ddp",
    "compile.blocks_vs_torch_ddp",
    "compile.hooks_ms",
    "mx.fp8_step",
    "mx.wgrad_mxfp8",
    "mx.wgrad_fp8",
    "mx.quantise_fp8",
    "mx.quantise_mxfp8",
]


def _matching(rows: list[dict], key: str) -> list[dict]:
    return [r for r in rows if (r["key"].startswith(key) if key.endswith("@") else r["key"] == key)]


def test_smoke_run_prints_every_row(tmp_path):
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
    )
    env.pop("RANK", None)  # run_all starts its own 2 ranks
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "run_all.py"),
            "--smoke",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    lines = (tmp_path / "run_all.jsonl").read_text().splitlines()
    header, rows = json.loads(lines[0]), [json.loads(line) for line in lines[1:]]
    assert header["what"] == "env" and header["world_size"] == 2 and header["backend"] == "gloo"
    for field in ("date", "command", "torch", "devices"):
        assert header[field], field
    for key in EXPECTED:
        found = _matching(rows, key)
        assert found, f"no row {key!r} in {[r['key'] for r in rows]}"
        for row in found:
            assert (row["figure"] is not None) != bool(row["skipped"]), row
            assert f"{row['key']} | " in result.stdout, f"row {row['key']!r} was not printed"
    for key in GPU_ONLY:
        assert all("needs CUDA" in row["skipped"] for row in _matching(rows, key)), _matching(
            rows, key
        )
    assert not [r for r in rows if r["skipped"] and "error" in r["skipped"]], (
        "a section raised on CPU"
    )
    table = (tmp_path / "run_all.md").read_text()
    assert table.count("\n| ") >= len(rows) + 1  # header + one line per row
