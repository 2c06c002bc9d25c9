"""The contract between modules that write gradients themselves and the buffers.

[Note: fused wgrad]
A module whose backward accumulates its weight gradient straight into the gradient buffer
(gradient-accumulation fusion, e.g. :class:`aligndp.lowp.MXLinear`) implements
:class:`FusedWgradModule`. The data-parallel wrapper, which owns the one mapping from params
to buffer views, binds a :class:`GradSink` into every such module at wrap time. In backward
the module asks ``sink.main_grad(weight)`` for the view, accumulates into it, returns ``None``
as the weight's autograd gradient (so no ``param.grad`` is ever allocated and the
post-accumulate hook does not fire) and calls ``sink.mark_ready(weight)`` so bucket readiness
still counts it. Each such module also declares the :class:`~aligndp.plan.spec.Requirement` its
kernel needs, and :func:`aligndp.parallelize` plans every buffer with it.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from aligndp.plan.spec import Requirement

__all__ = ["GradSink", "FusedWgradModule", "fused_wgrad_modules"]


class GradSink(Protocol):
    def main_grad(self, param: torch.nn.Parameter) -> torch.Tensor | None:
        """The buffer view to accumulate ``param``'s gradient into, or None if it has none."""

    def mark_ready(self, param: torch.nn.Parameter) -> None:
        """Count one gradient contribution of ``param`` as accumulated (readiness)."""


@runtime_checkable
class FusedWgradModule(Protocol):
    def wgrad_requirements(self) -> list[Requirement]:
        """Layout requirements of this module's wgrad kernel (e.g. 64-element starts)."""

    def bind_grad_sink(self, sink: GradSink | None) -> None:
        """Accumulate into ``sink``'s views from now on (None: plain autograd gradients)."""


def fused_wgrad_modules(model: torch.nn.Module) -> list[tuple[str, FusedWgradModule]]:
    """Every submodule of ``model`` that implements :class:`FusedWgradModule`, by name."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, FusedWgradModule)]
