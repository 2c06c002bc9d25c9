"""Gradient clipping shared by every optimizer part.

Plain DDP stepping itself is :class:`aligndp.optim.composite.ReplicatedPart` behind a
:class:`~aligndp.optim.composite.CompositeOptimizer`, the same face ZeRO-1 Muon uses.
"""
from __future__ import annotations

import torch

__all__ = ["clip_by_total_norm"]


def clip_by_total_norm(grads: list[torch.Tensor], *, max_norm: float, total_norm: torch.Tensor) -> None:
    """Scale ``grads`` in place so their joint 2-norm is at most ``max_norm``.

    Same coefficient as ``torch.nn.utils.clip_grad_norm_``: max_norm / (total_norm + 1e-6),
    clamped to 1.
    """
    coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.dtype))
