"""The vocabulary of one data-parallel step: states, bucket references, per-param slots.

[Note: step states] in DESIGN.md; the transitions are in grad_sync.py.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence

import torch
import torch.nn as nn

from aligndp.plan.slots import OwnedPiece
from aligndp.plan.spec import Mode
from aligndp.runtime.buffer import FlatBuffer
from aligndp.runtime.grads import ShardedGrad

__all__ = ["BucketRef", "StepState", "GradSlot", "RoundReport", "grad_slots"]


@dataclasses.dataclass(frozen=True, order=True)
class BucketRef:
    """One bucket of one buffer: the one bucket key of the gradient reduction and the param
    gather (ordered buffer-major, as buckets launch)."""

    buffer: int
    """Index into ``DataParallel.flat_buffers``."""
    bucket: int
    """Index into that buffer's ``layout.buckets``."""


class StepState(enum.Enum):
    """Where a :class:`~aligndp.runtime.ddp.DataParallel` is in its step ([Note: step states])."""

    IDLE = "idle"
    ACCUMULATING = "accumulating"
    REDUCED = "reduced"


@dataclasses.dataclass
class GradSlot:
    """Where one trainable param's gradient lives."""

    index: int
    """Position in registration order (the order of the agreement flags)."""
    ref: BucketRef
    view: torch.Tensor
    """Its ``main_grad`` view."""
    owned: OwnedPiece | None
    """What this rank owns after a reduce-scatter (sharded and layer-wise buffers; possibly
    empty); None when replicated."""
    sharded_grad: ShardedGrad | None
    """The ``param.grad`` it shows once reduced, where it is sharded."""


@dataclasses.dataclass(frozen=True)
class RoundReport:
    """What the last synchronised backward did (for tests, logs and benchmarks)."""

    launched_during_backward: int
    """Buckets whose collective started before the end of backward (overlap)."""
    buckets: int
    used: int
    """Params that had a gradient on at least one rank."""


def grad_slots(
    buffers: Sequence[FlatBuffer], params: Sequence[nn.Parameter], *, rank: int
) -> tuple[dict[nn.Parameter, GradSlot], list[BucketRef]]:
    """Every param's :class:`GradSlot` (``params`` in registration order) and every bucket,
    in launch order (buffer by buffer, bucket by bucket)."""
    position = {p: k for k, p in enumerate(params)}
    slots: dict[nn.Parameter, GradSlot] = {}
    for i, buf in enumerate(buffers):
        for p, s, view in zip(buf.params, buf.slots, buf.main_grads):
            owned = None
            if buf.layout.mode is not Mode.REPLICATED:
                owned = buf.layout.owned_piece(s, rank)
            sharded = ShardedGrad(p) if owned is not None else None
            slots[p] = GradSlot(position[p], BucketRef(i, s.bucket), view, owned, sharded)
    refs = [
        BucketRef(i, b) for i, buf in enumerate(buffers) for b in range(len(buf.layout.buckets))
    ]
    return slots, refs
