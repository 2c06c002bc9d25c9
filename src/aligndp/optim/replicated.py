"""Plain DDP optimizer: every rank steps every param with the averaged ``main_grad``."""
from __future__ import annotations

import torch

from aligndp.ddp import DataParallel
from aligndp.optim.base import DataParallelOptimizer

__all__ = ["ReplicatedOptimizer", "clip_by_total_norm"]


def clip_by_total_norm(grads: list[torch.Tensor], *, max_norm: float, total_norm: torch.Tensor) -> None:
    """Scale ``grads`` in place so their joint 2-norm is at most ``max_norm``.

    Same coefficient as ``torch.nn.utils.clip_grad_norm_``: max_norm / (total_norm + 1e-6),
    clamped to 1.
    """
    coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.dtype))


class ReplicatedOptimizer(DataParallelOptimizer):
    """One torch optimizer over all params; grads are the all-reduced ``main_grad`` views."""

    def __init__(self, model: DataParallel, inner: torch.optim.Optimizer, *, max_grad_norm: float | None = None):
        super().__init__(model, [inner])
        self.max_grad_norm = max_grad_norm
        self._params = [p for g in inner.param_groups for p in g["params"]]

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("closures are not supported: run forward/backward before step()")
        self.model.finish_grad_sync()
        grads = [self.model.main_grad(p) for p in self._params]
        if self.max_grad_norm is not None:
            total = torch.nn.utils.get_total_norm([g for g in grads if g is not None], norm_type=2.0)
            clip_by_total_norm([g for g in grads if g is not None], max_norm=self.max_grad_norm, total_norm=total)
        for p, g in zip(self._params, grads):
            p.grad = None if g is None else (g if g.dtype == p.dtype else g.to(p.dtype))
        self.inner[0].step()
        for p in self._params:
            p.grad = None  # the hooks add param.grad into main_grad; never leave an alias behind
