"""The torch-optimizer face shared by aligndp's optimizers.

aligndp's optimizers drive one or more torch optimizers over buffer views and must still
look like a single ``torch.optim.Optimizer`` to user code: ``step``/``zero_grad``,
``param_groups`` whose edits (lr schedulers) reach the inner optimizers, and ``state_dict``.
``param_groups`` is the concatenation of the inner optimizers' own group dicts — the same
dict objects, so writing ``group["lr"]`` changes the inner optimizer directly. It is read
afresh on every access: ``Optimizer.load_state_dict`` (a checkpoint load) replaces an inner
optimizer's group dicts, and a list captured at construction would then point at dead dicts,
so an lr scheduler's writes after a resume would be silently ignored.
"""
from __future__ import annotations

from collections import OrderedDict

import torch

from aligndp.ddp import DataParallel

__all__ = ["DataParallelOptimizer", "ELEMENTWISE_OPTIMIZERS", "resolve_optimizer_class"]

ELEMENTWISE_OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "adamw": torch.optim.AdamW,
    "adam": torch.optim.Adam,
    "sgd": torch.optim.SGD,
}
"""Optimizers whose update of one element depends only on that element's history: the only
ones ZeRO-1 may step on arbitrary slices."""


def resolve_optimizer_class(name: str | type[torch.optim.Optimizer]) -> type[torch.optim.Optimizer]:
    if isinstance(name, type) and issubclass(name, torch.optim.Optimizer):
        return name
    try:
        return ELEMENTWISE_OPTIMIZERS[str(name).lower()]
    except KeyError:
        raise ValueError(
            f"unknown optimizer {name!r}: choose one of {sorted(ELEMENTWISE_OPTIMIZERS) + ['muon']}"
        ) from None


class DataParallelOptimizer(torch.optim.Optimizer):
    """Base class: wraps inner torch optimizers and the :class:`DataParallel` they serve.

    Subclasses implement :meth:`step`. ``Optimizer.__init__`` is deliberately not called: the
    inner optimizers own the params and state; this object only forwards to them.
    """

    def __init__(self, model: DataParallel, inner: list[torch.optim.Optimizer]) -> None:
        self.model = model
        self.inner = inner
        self.defaults = dict(inner[0].defaults) if inner else {}
        self._optimizer_step_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_step_post_hooks: OrderedDict = OrderedDict()
        self._optimizer_state_dict_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_state_dict_post_hooks: OrderedDict = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_load_state_dict_post_hooks: OrderedDict = OrderedDict()

    @property
    def param_groups(self) -> list[dict]:  # type: ignore[override]
        return [g for opt in self.inner for g in opt.param_groups]

    @param_groups.setter
    def param_groups(self, value) -> None:
        raise AttributeError("param_groups belong to the inner torch optimizers; edit the group dicts instead")

    @property
    def state(self) -> dict:  # type: ignore[override]
        merged: dict = {}
        for opt in self.inner:
            merged.update(opt.state)
        return merged

    @state.setter
    def state(self, value) -> None:  # Optimizer internals may assign; the inner ones own it
        pass

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradient buffers (and drop any ``param.grad``) for the next step."""
        self.model.zero_grad_buffer()

    def add_param_group(self, param_group: dict) -> None:
        raise NotImplementedError(
            "aligndp plans its buffers for the params given to parallelize(); build a new one to add params"
        )

    def __repr__(self) -> str:
        inner = ", ".join(type(o).__name__ for o in self.inner)
        return f"{type(self).__name__}({inner}; {len(self.param_groups)} param group(s))"
