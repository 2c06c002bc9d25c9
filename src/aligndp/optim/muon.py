"""Muon as a whole-matrix optimizer: ``torch.optim.Muon`` plus its Newton–Schulz cost.

Registered as ``"muon"`` in aligndp/optim/registry.py; everything else (routing, layer-wise
buffers, owners, the step, checkpoints) is the generic whole-matrix path
([Note: layer-wise step] in aligndp/optim/whole_matrix.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from aligndp.optim.whole_matrix import WholeMatrixSpec

__all__ = ["MUON", "MUON_OPTIONS", "newton_schulz_cost"]

MUON_OPTIONS = (
    "lr",
    "momentum",
    "nesterov",
    "ns_steps",
    "ns_coefficients",
    "eps",
    "adjust_lr_fn",
    "weight_decay",
)
"""Keyword arguments passed through to ``torch.optim.Muon`` (its defaults otherwise)."""


def newton_schulz_cost(shape: Sequence[int]) -> float:
    """Estimated flops-proportional cost of orthogonalising a param of ``shape``.

    One Newton–Schulz iteration on an m×n matrix costs O(max(m,n)·min(m,n)²) (the Gram
    matrix and its products are min×min). Params that are not 2-D are not orthogonalised by
    Muon; they count their numel so that they still spread across ranks.
    """
    if len(shape) == 2:
        m, n = shape
        return float(max(m, n) * min(m, n) ** 2)
    return float(math.prod(shape))


MUON = WholeMatrixSpec(torch.optim.Muon, cost=newton_schulz_cost, options=MUON_OPTIONS)
"""Muon on the hidden 2-D matrices (the default selector), AdamW on the rest."""
