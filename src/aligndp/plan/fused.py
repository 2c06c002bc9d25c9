"""The contract between modules that write gradients themselves and the buffers.

[Note: fused wgrad]
A module whose backward accumulates its weight gradient straight into the gradient buffer
(gradient-accumulation fusion, e.g. :class:`aligndp.lowp.MXLinear`) implements
:class:`FusedWgradModule`. The data-parallel wrapper, which owns the one mapping from params
to buffer views, binds a :class:`GradSink` into every such module at wrap time. In backward
the module asks ``sink.grad_target(weight)`` for the view, writes its wgrad into it, returns
``None`` as the weight's autograd gradient (so no ``param.grad`` is ever allocated and the
post-accumulate hook does not fire) and calls ``sink.mark_ready(weight)`` so bucket readiness
still counts it. Each such module also declares the :class:`~aligndp.plan.spec.Requirement` its
kernel needs, and :func:`aligndp.parallelize` plans every buffer with it.

[Note: write, not accumulate]
The first contribution to a view after ``zero_grad`` need not be added to anything: the view
is stale (not yet zeroed: [Note: lazy zeroing] in ddp.py), and zeroing it only to read the
zeros back costs two passes over the view and a third to read the GEMM's output. So the sink
says which it is: :attr:`GradTarget.accumulate` False means the kernel must overwrite every
element of the view (a GEMM with the view as its output), True that it must add. The sink
counts the view as written only when ``mark_ready`` comes, so a kernel that raises before it
leaves the view stale, to be zeroed lazily as before. A weight used twice in one backward
(tied, or a layer called twice) writes once and accumulates the second time.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol, runtime_checkable

import torch

from aligndp.plan.spec import Requirement

__all__ = ["GradSink", "GradTarget", "FusedWgradModule", "fused_wgrad_modules"]


class GradTarget(NamedTuple):
    """Where a fused kernel puts one weight gradient ([Note: write, not accumulate])."""

    view: torch.Tensor
    """The param's view of the grad buffer (``main_grad``), shaped like the param."""
    accumulate: bool
    """True: add the gradient to the view. False: the view holds nothing of this step;
    overwrite every element of it."""


class GradSink(Protocol):
    def grad_target(self, param: torch.nn.Parameter) -> GradTarget | None:
        """Where to put ``param``'s gradient, or None if it has no view (plain autograd)."""

    def mark_ready(self, param: torch.nn.Parameter) -> None:
        """Count one gradient contribution of ``param`` as written into its view."""

    def param_writes(self) -> int:
        """A count that changes whenever the sink's owner writes param values without bumping
        the params' version counters (the all-gather after a sharded step): caches of a
        param's quantised value key on it. Optional: a sink whose owner never writes params
        behind torch's version counter may leave it out."""


@runtime_checkable
class FusedWgradModule(Protocol):
    def wgrad_requirements(self) -> list[Requirement]:
        """Layout requirements of this module's wgrad kernel (e.g. 64-element starts)."""

    def bind_grad_sink(self, sink: GradSink | None) -> None:
        """Accumulate into ``sink``'s views from now on (None: plain autograd gradients)."""


def fused_wgrad_modules(model: torch.nn.Module) -> list[tuple[str, FusedWgradModule]]:
    """Every submodule of ``model`` that implements :class:`FusedWgradModule`, by name."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, FusedWgradModule)]
