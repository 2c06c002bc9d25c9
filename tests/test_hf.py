"""An unmodified Hugging Face GPT2LMHeadModel under aligndp.parallelize (skipped without
transformers).

Reference: the same model (same seed) trained by plain torch AdamW in this one process on the
whole global batch. The head is tied to the token embedding, so this also checks that a param
used twice per step is reduced once with both contributions.
"""

import pathlib
import sys

import pytest
import torch

pytest.importorskip("transformers")

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
import hf_gpt2  # noqa: E402  (examples/ is not a package; spawned ranks find it through sys.path)

from aligndp.app.data import BatchSpec, TokenData  # noqa: E402
from tests.models import ADAMW_GAIN, order_tolerance  # noqa: E402

STEPS = 6


def _reference_losses(steps: int, seed: int) -> list[float]:
    model = hf_gpt2.build_model(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=hf_gpt2.LR)
    data = TokenData.synthetic()
    spec = BatchSpec(hf_gpt2.BATCH_SIZE, hf_gpt2.SEQ_LEN)
    losses = []
    for step in range(steps):
        loss = hf_gpt2.loss_of(model, *data.batch(step, spec, seed=seed))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_hf_gpt2_on_two_ranks_matches_one_process():
    result = hf_gpt2.main(["--steps", str(STEPS), "--nproc", "2", "--seed", "1"])
    # fp32 summation order only (tests/models.py [Tolerances]): the weight gradients sum the
    # batch's 8 x 64 tokens (one process) or each rank's half; AdamW over STEPS steps
    rel = order_tolerance(terms=8 * 64, steps=STEPS, gain=ADAMW_GAIN, cancelling=False)
    assert result["losses"] == pytest.approx(_reference_losses(STEPS, seed=1), rel=rel)
    assert result["losses"][-1] < result["losses"][0] - 1.0
