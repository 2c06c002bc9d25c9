"""What ``param.grad`` shows between ``backward()`` and ``step()`` ([Note: step states], DESIGN).

Replicated params show their reduced gradient (the ``main_grad`` view itself where the dtypes
agree, so in-place edits such as ``clip_grad_norm_`` or ``GradScaler.unscale_`` reach the
buffer). Params of sharded and layer-wise buffers have no full reduced gradient on any rank:
each rank holds only its shard. Their ``param.grad`` is a :class:`ShardedGrad`, a tensor with
the param's shape, dtype and device and no data, whose every operation raises a ``TypeError``
that says what to do instead — so ``torch.nn.utils.clip_grad_norm_(model.parameters(), c)``
fails at once on every rank instead of returning 0 and clipping nothing.
"""

from __future__ import annotations

import torch

__all__ = ["ShardedGrad", "same_storage", "SHARDED_GRAD_HELP"]

SHARDED_GRAD_HELP = (
    "with sharding='zero1' (and optimizer='muon' layer-wise buffers) each rank holds only its "
    "shard of the reduced gradient, so param.grad has no full value to compute with. Clip with "
    "aligndp.parallelize(..., max_grad_norm=c) or opt.clip_grad_norm_(c) (the global norm, one "
    "all-reduce), read the global norm with opt.grad_norm(), use bf16 autocast instead of an fp16 "
    "GradScaler, or use sharding='none' where every rank holds every reduced gradient"
)


class ShardedGrad(torch.Tensor):
    """Stand-in ``param.grad`` of a param whose reduced gradient is sharded over the ranks."""

    @staticmethod
    def __new__(cls, param: torch.Tensor) -> ShardedGrad:
        return torch.Tensor._make_wrapper_subclass(
            cls, param.shape, dtype=param.dtype, device=param.device
        )

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise TypeError(f"aligndp: {func.__name__} on param.grad: {SHARDED_GRAD_HELP}")

    def __repr__(self) -> str:  # printing must not dispatch
        return f"ShardedGrad(shape={tuple(self.shape)}, dtype={self.dtype}; {SHARDED_GRAD_HELP})"


def same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when ``a`` is ``b`` or a view of the same elements (an alias of a ``main_grad``
    view)."""
    if a is b:
        return True
    if isinstance(a, ShardedGrad) or isinstance(b, ShardedGrad):
        return False
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.dtype == b.dtype
