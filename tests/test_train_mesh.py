"""`aligndp train --replicas R` over two "nodes" of one host, and resumed at another mesh shape.

Two ``torchrun --nnodes 2 --nproc-per-node 2`` agents (node ranks 0 and 1, a static
rendezvous on localhost) start 4 gloo ranks that train the demo preset with ZeRO-1 as
2 replicas x 2 shards ([Note: replicate x shard mesh] in aligndp/runtime/mesh.py: a replica
is one node's ranks). The run, cut short after its first checkpoint, is then resumed on 4
ranks in one flat group (``--replicas 1``) and must log the uninterrupted run's losses, as
tests/test_train.py checks resuming at another rank count.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import torch.distributed as dist

import aligndp
from aligndp.app import cli
from aligndp.app.train_report import read_metrics
from tests.models import ADAMW_GAIN, interrupted_copy, order_tolerance

pytestmark = pytest.mark.skipif(
    not dist.is_available(), reason="torch built without torch.distributed (no torchrun)"
)
STEPS = 6
CHECKPOINT = 3
RUN = [
    *("--steps", str(STEPS), "--batch-size", "8", "--eval-every", str(CHECKPOINT)),
    *("--seed", "3", "--sharding", "zero1", "--checkpoint-every", str(CHECKPOINT)),
]
LOSS_REL = order_tolerance(
    terms=8 * 64, steps=STEPS - CHECKPOINT, gain=ADAMW_GAIN, cancelling=False
)
"""The resumed steps differ from the uninterrupted ones only in the order of the gradient
mean's fp32 sums (a 2 x 2 mesh sums in pairs, a flat group of 4 in its ring's order); the
longest sums are the weight gradients' 8 rows x 64 tokens (tests/models.py [Tolerances])."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun_two_nodes(args: list[str], out) -> list[subprocess.CompletedProcess]:
    """``torchrun --nnodes 2 --nproc-per-node 2`` started twice on this host (node ranks 0 and
    1 meet at a free localhost port), both running ``aligndp train ARGS --out OUT``."""
    source = os.path.dirname(os.path.dirname(aligndp.__file__))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([source, os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
    }
    port = str(_free_port())
    nodes = [
        subprocess.Popen(
            [
                *(sys.executable, "-m", "torch.distributed.run", "--nnodes", "2"),
                *("--nproc-per-node", "2", "--node-rank", str(node)),
                *("--master-addr", "127.0.0.1", "--master-port", port),
                *("-m", "aligndp", "train", *args, "--out", str(out)),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for node in (0, 1)
    ]
    results = []
    try:
        for proc in nodes:
            stdout, stderr = proc.communicate(timeout=300)
            results.append(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr))
    finally:
        for proc in nodes:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    return results


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    out = tmp_path_factory.mktemp("two_nodes")
    nodes = _torchrun_two_nodes([*RUN, "--replicas", "2"], out)
    for node, result in enumerate(nodes):
        assert result.returncode == 0, f"node {node}:\n{result.stdout}\n{result.stderr[-4000:]}"
    return out, nodes


def _layout_padded_numel(capsys, replicas: int) -> int:
    """What ``aligndp layout`` plans for this run's ZeRO-1 buffers on 4 ranks."""
    argv = ["layout", "--preset", "demo", "--nproc", "4", "--replicas", str(replicas)]
    assert cli.main([*argv, "--sharding", "zero1", "--json"]) == 0
    return sum(b["padded_numel"] for b in json.loads(capsys.readouterr().out)["buffers"])


def test_two_nodes_train_as_two_replicas_of_two_shards(two_nodes, capsys):
    out, (node0, _) = two_nodes
    summary = json.loads((out / "summary.json").read_text())
    # the run's buffers are the ones `aligndp layout --replicas 2` shows: planned for the 2
    # ranks of a shard group, which pad less than a plan for 4 would
    assert summary["padded_numel"] == _layout_padded_numel(capsys, 2)
    assert summary["padded_numel"] != _layout_padded_numel(capsys, 1)
    assert (summary["dp_size"], summary["replicas"]) == (4, 2)
    assert summary["replicas_in_sync"] is True
    assert "on 4 gloo rank(s) (2 replicas x 2 shards)" in node0.stdout
    assert "on 4 rank(s) (2 replicas x 2 shards)" in node0.stdout
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(STEPS))
    assert records[-1]["loss"] < records[0]["loss"] - 0.5
    assert sorted(os.listdir(out / "checkpoints")) == ["run.json", "step-000003", "step-000006"]


def test_resume_on_a_flat_group_of_four_logs_the_same_losses(two_nodes, tmp_path):
    """Cut after step 4 with its checkpoint at step 3, resumed on 4 ranks in one flat group:
    the checkpoint of 2 replicas x 2 shards is resharded over 4 shards."""
    run, _ = two_nodes
    interrupted_copy(run, tmp_path, checkpoint_step=CHECKPOINT, last_logged_step=4)
    args = [*RUN, "--nproc", "4", "--replicas", "1", "--resume", "--out", str(tmp_path)]
    assert cli.main(["train", *args]) == 0
    expected = read_metrics(run / "metrics.jsonl")
    resumed = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in resumed] == list(range(STEPS))
    assert resumed[:CHECKPOINT] == expected[:CHECKPOINT]
    losses = [r["loss"] for r in resumed[CHECKPOINT:]]
    assert losses == pytest.approx([r["loss"] for r in expected[CHECKPOINT:]], rel=LOSS_REL)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert (summary["start_step"], summary["dp_size"], summary["replicas"]) == (CHECKPOINT, 4, 1)


def test_inside_torchrun_replicas_must_divide_its_world_size(tmp_path, capsys, monkeypatch):
    """Under torchrun --nproc is ignored: --replicas is checked against WORLD_SIZE, on every
    rank, before anything starts."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "6")
    assert cli.main(["train", "--replicas", "4", "--batch-size", "12", "--out", str(tmp_path)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == (
        "aligndp train: error: --replicas 4 does not split the 6 ranks (--nproc, or torchrun's "
        "world size) into equal replicas; use one of 1, 2, 3, 6"
    )
    assert not os.listdir(tmp_path)
