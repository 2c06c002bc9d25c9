"""Muon as a whole-matrix optimizer: ``torch.optim.Muon`` plus its Newton–Schulz cost.

Registered as ``"muon"`` in aligndp/optim/registry.py; everything else (routing, layer-wise
buffers, owners, the step, checkpoints) is the generic whole-matrix path
([Note: layer-wise step] in aligndp/optim/whole_matrix.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from aligndp.optim.ns_cost import FLOPS_SPLIT, H200_NS_COST
from aligndp.optim.whole_matrix import WholeMatrixSpec
from aligndp.plan.split import wide

__all__ = [
    "MUON",
    "MUON_DEFAULTS",
    "MUON_OPTIONS",
    "FLOPS_SPLIT",
    "MUON_SPLIT",
    "newton_schulz_cost",
    "newton_schulz_part_cost",
]

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
    """Multiply-adds of one Newton–Schulz iteration on a param of ``shape`` (the flops a rank
    spends; every iteration alike, so the count of iterations drops out of a balance).

    In the wide orientation (m <= n): ``A = X Xᵀ`` is m²n, ``A·A`` m³ and ``B X`` m²n, so
    ``m²·(2n + m)``. Params that are not 2-D are not orthogonalised by Muon; they count their
    numel so that they still spread across ranks.
    """
    if len(shape) == 2:
        m, n = wide(shape)
        return float(m * m * (2 * n + m))
    return float(math.prod(shape))


def newton_schulz_part_cost(shape: Sequence[int], cols: int, rows: int) -> float:
    """Multiply-adds of one part of a split Newton–Schulz iteration
    ([Note: split Newton–Schulz] in plan/split.py): its ``cols`` columns' share of ``X Xᵀ``
    and ``B X`` (m²·cols each) and its ``rows`` rows of ``A·A`` (m²·rows). The parts of a
    matrix add up to :func:`newton_schulz_cost`: splitting moves flops, it adds none."""
    m, _ = wide(shape)
    return float(m * m * (2 * cols + rows))


MUON_SPLIT = H200_NS_COST.policy()
"""Muon's default split policy: split what balance needs (target max/mean 1.05) by one
H200's Newton–Schulz time ([Note: Newton–Schulz device cost] in optim/ns_cost.py: a fixed
cost per part per iteration plus the flops; owners balanced by the same time), parts of at
least 128 columns and 2 fixed costs. Another device: ``parallelize(split=cost.policy())``
with its ``NewtonSchulzCost``; the flops model alone: ``FLOPS_SPLIT`` (whose parts add up to
:func:`newton_schulz_cost`, :func:`newton_schulz_part_cost` each)."""


MUON_DEFAULTS = (("adjust_lr_fn", "match_rms_adamw"),)
"""[Note: one lr for Muon and AdamW]
``parallelize(optimizer="muon", lr=x)`` gives ``x`` to Muon and to the AdamW of the other
params. With torch's default ``adjust_lr_fn`` ("original": ``lr·sqrt(max(1, A/B))``) Muon
wants a lr near 0.02, ten times an AdamW lr, and one shared lr either starves Muon or makes
AdamW diverge (GPT-2 small: loss 10.97 -> 17.3 at 0.02). ``"match_rms_adamw"``
(``lr·0.2·sqrt(max(A, B))``, as Moonlight and torchtitan scale it) gives Muon's update the
RMS of an AdamW update, so one AdamW-sized lr serves both; it is aligndp's default.
``muon_lr=`` / ``adamw_lr=`` set one part's lr, and ``adjust_lr_fn="original"`` with
``muon_lr=0.02`` is Keller Jordan's two-lr setting."""

MUON = WholeMatrixSpec(
    torch.optim.Muon,
    cost=newton_schulz_cost,
    options=MUON_OPTIONS,
    defaults=MUON_DEFAULTS,
    split=MUON_SPLIT,
)
"""Muon on the hidden 2-D matrices (the default selector), AdamW on the rest."""
