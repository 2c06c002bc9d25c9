"""DDPConfig: the settings of :class:`~aligndp.runtime.ddp.DataParallel`."""

from __future__ import annotations

import dataclasses

import torch

from aligndp.plan.spec import (
    DEFAULT_BUCKET_NUMEL,
    DEFAULT_START_ALIGNMENT,
    check_bucket_numel,
    check_grad_dtype,
)
from aligndp.runtime.collective_backends import DEFAULT_COLLECTIVES, check_collectives_name

__all__ = ["DDPConfig", "NONFINITE_ACTIONS"]

NONFINITE_ACTIONS = ("raise", "skip")


@dataclasses.dataclass(frozen=True)
class DDPConfig:
    """Settings of the data-parallel wrapper."""

    bucket_numel: int | None = DEFAULT_BUCKET_NUMEL
    """Target elements per bucket (one collective each); None puts each buffer in one bucket."""
    overlap: bool = True
    """Launch each bucket's collective during backward as soon as it is ready; False waits
    for the end of backward and launches everything there."""
    grad_dtype: torch.dtype | None = None
    """dtype of the gradient buffers; None keeps each param's dtype (fp32 for bf16 params
    gives fp32 gradient accumulation and reduction)."""
    start_alignment: int = DEFAULT_START_ALIGNMENT
    """Param start alignment in elements; requirements of active consumers can only raise it."""
    check_finite: bool = False
    """Count every param's non-finite (NaN/Inf) local gradient elements before its bucket's
    collective: one pass over each bucket, on the device, no host sync there. The counts ride
    on the end-of-backward agreement, which is then read on the host once per step, and every
    rank acts per ``on_nonfinite``."""
    on_nonfinite: str = "raise"
    """With ``check_finite``: ``"raise"`` a FloatingPointError naming the params on every
    rank, or ``"skip"`` the optimizer step on every rank (params and state untouched)."""
    broadcast_at_wrap: bool = True
    """Copy rank 0's params and buffers to every rank when wrapping."""
    broadcast_buffers: bool = True
    """Copy rank 0's module buffers (BatchNorm statistics, ...) to every rank at the start of
    every forward through the wrapper, as torch DDP's ``broadcast_buffers=True``."""
    overlap_param_gather: bool = False
    """Sharded and layer-wise buffers: leave the param all-gathers of a step in flight and let
    each module's forward pre-hook wait for its own buckets (installed when wrapping), instead
    of waiting for them at the end of ``step()``."""
    collectives: str = DEFAULT_COLLECTIVES
    """Name of the collectives backend that reduces and gathers the buckets and allocates the
    buffers ([Note: collectives seam] in aligndp/runtime/collectives.py): ``"torch"`` is
    torch.distributed on the process group; others are registered with
    ``aligndp.register_collectives``."""

    def __post_init__(self) -> None:
        check_bucket_numel(self.bucket_numel)
        check_grad_dtype(self.grad_dtype)
        if self.on_nonfinite not in NONFINITE_ACTIONS:
            raise ValueError(
                f"on_nonfinite must be one of {NONFINITE_ACTIONS}, got {self.on_nonfinite!r}"
            )
        check_collectives_name(self.collectives)
