"""The README's own-loop example runs as written: ``torchrun --nproc-per-node 2
examples/train_own_model.py``, stopped part-way and resumed, on 2 gloo ranks; and once with
``--sharding zero1``.

Reference: the same model, data, param groups, schedule and clipping trained by plain
``torch.optim.AdamW`` in this one process on each whole global batch, with no stop. The losses
the two launches log (the second resumed from the first's ``aligndp.save`` checkpoint and
torch scheduler state) must equal the reference's, step for step, to fp32 summation order.
"""

import json
import pathlib
import sys

import pytest
import torch
import torch.nn.functional as F

from tests._torchrun import torchrun
from tests.models import ADAMW_GAIN, order_tolerance

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train_own_model.py"
sys.path.insert(0, str(SCRIPT.parent))
import train_own_model as example  # noqa: E402  (examples/ is not a package)

STEPS, STOP = 12, 5


def _reference_losses(steps: int, seed: int = 0, lr: float = 3e-3) -> list[float]:
    module = example.build_model(seed)
    optimizer = torch.optim.AdamW(example.param_groups(module), lr=lr)
    scheduler = example.lr_schedule(optimizer, steps)
    losses = []
    for step in range(steps):
        inputs, labels = example.global_batch(step, seed)
        loss = F.cross_entropy(module(inputs), labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _check_against_one_process(out: pathlib.Path) -> None:
    logged = [json.loads(line) for line in (out / "losses.jsonl").open()]
    assert [r["step"] for r in logged] == list(range(STEPS))
    # fp32 summation order only (tests/models.py [Tolerances]): a weight gradient sums the 64
    # rows of the global batch (one process) or each rank's 32; AdamW over STEPS steps
    rel = order_tolerance(terms=64, steps=STEPS, gain=ADAMW_GAIN, cancelling=False)
    reference = _reference_losses(STEPS)
    assert [r["loss"] for r in logged] == pytest.approx(reference, rel=rel)
    assert reference[-1] < reference[0] - 0.3  # it learns: the comparison means something


def test_own_loop_example_stopped_and_resumed_matches_one_process(tmp_path):
    """The README's three commands: a run cut short by ``--stop-at``, then ``--resume``."""
    out = str(tmp_path / "run")
    torchrun(SCRIPT, "--steps", str(STEPS), "--stop-at", str(STOP), "--out", out)
    torchrun(SCRIPT, "--steps", str(STEPS), "--resume", "--out", out)
    _check_against_one_process(tmp_path / "run")


def test_own_loop_example_with_zero1_matches_one_process(tmp_path):
    """``--sharding zero1``: the loop clips through ``optimizer.clip_grad_norm_``."""
    torchrun(SCRIPT, "--steps", str(STEPS), "--sharding", "zero1", "--out", str(tmp_path / "run"))
    _check_against_one_process(tmp_path / "run")
