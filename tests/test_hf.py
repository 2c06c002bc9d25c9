"""An unmodified Hugging Face GPT2LMHeadModel under aligndp.parallelize (skipped without
transformers): ``examples/hf_gpt2.py`` run as its docstring says, by torchrun on 2 gloo ranks.

Reference: the same model (same seed) trained by plain torch AdamW in this one process on the
whole global batch. The head is tied to the token embedding, so this also checks that a param
used twice per step is reduced once with both contributions.
"""

import json
import pathlib
import sys

import pytest
import torch

pytest.importorskip("transformers")

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
import hf_gpt2  # noqa: E402  (examples/ is not a package)

from tests._torchrun import torchrun  # noqa: E402
from tests.models import ADAMW_GAIN, order_tolerance  # noqa: E402

STEPS = 6


def _reference_losses(steps: int, seed: int) -> list[float]:
    model = hf_gpt2.build_model(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=hf_gpt2.LR)
    losses = []
    for step in range(steps):
        loss = hf_gpt2.loss_of(model, *hf_gpt2.global_batch(step, seed))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_hf_gpt2_on_two_ranks_matches_one_process(tmp_path):
    out = tmp_path / "losses.json"
    script = pathlib.Path(hf_gpt2.__file__)
    torchrun(script, "--steps", str(STEPS), "--seed", "1", "--losses", str(out))
    losses = json.loads(out.read_text())
    # fp32 summation order only (tests/models.py [Tolerances]): the weight gradients sum the
    # batch's 8 x 64 tokens (one process) or each rank's half; AdamW over STEPS steps
    rel = order_tolerance(terms=8 * 64, steps=STEPS, gain=ADAMW_GAIN, cancelling=False)
    assert losses == pytest.approx(_reference_losses(STEPS, seed=1), rel=rel)
    assert losses[-1] < losses[0] - 1.0
