"""The optimizer's side of uneven inputs under torch's ``Join`` ([Note: join] in
aligndp/runtime/join.py), as torch's ``ZeroRedundancyOptimizer`` is a ``Joinable``.

A rank that ran out of batches steps on the gradients its model's shadow backward reduced:
a zero1 shard must still step and all-gather (the other ranks need its params), and every
rank runs the global norm's all-reduce of ``max_grad_norm``. In ``Join([model, opt])`` the
optimizer's own hook steps; under ``model.join()`` alone the last optimizer built over the
model is stepped by the model's hook. A norm the user asks for (``clip_grad_norm_``,
``grad_norm``) is an all-reduce a joined rank cannot foresee: refused inside a Join.
"""

from __future__ import annotations

import weakref

import torch
from torch.distributed.algorithms.join import Joinable, JoinHook

__all__ = ["JoinableOptimizer"]


class _OptimizerJoinHook(JoinHook):
    def __init__(self, opt) -> None:
        self.opt = opt

    def main_hook(self) -> None:
        """Step when the model's hook shadowed a synchronised backward this iteration."""
        if self.opt.model._join_shadowed:
            self.opt.step()

    def post_hook(self, is_last_joiner: bool) -> None:
        Joinable.__init__(self.opt)  # later steps are outside any Join


class JoinableOptimizer(Joinable):
    """torch ZeroRedundancyOptimizer's ``Joinable`` face of the composite optimizer."""

    def _join_init(self, model) -> None:
        Joinable.__init__(self)
        model._join_optimizer = weakref.ref(self)  # steps on a joined rank under model.join()

    def join_hook(self, **kwargs) -> JoinHook:
        Joinable.__init__(self.model)  # a Join left by an error keeps its configs; Join sets
        return _OptimizerJoinHook(self)  # them anew for its joinables

    @property
    def join_device(self) -> torch.device:
        return self.model.device

    @property
    def join_process_group(self):
        return self.model.process_group

    def _join_check_step(self) -> None:
        """Inside a Join: refuse one that lists the optimizer first (the model's forward
        notifies it)."""
        if self._join_config.is_first_joinable:
            raise ValueError(
                "Join(...) lists the optimizer before its DataParallel (or without it): the "
                "model's forward must notify the join first; put the model first: "
                "Join([model, opt])"
            )

    def _join_refuse_norm(self, what: str) -> None:
        if self._join_config.enable or self.model._join_config.enable:
            raise RuntimeError(
                f"{what} inside a Join: a rank that ran out of batches cannot shadow its "
                "all-reduce; clip with the optimizer's max_grad_norm= instead "
                "(parallelize(..., max_grad_norm=...)), which every rank runs in step()"
            )
