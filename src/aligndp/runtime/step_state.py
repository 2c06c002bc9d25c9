"""The vocabulary of one data-parallel step: states, bucket references, the param index.

[Note: step states] in DESIGN.md; the transitions are in reducer.py.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping, Sequence

import torch
import torch.nn as nn

from aligndp.plan.slots import OwnedPiece, ParamSlot
from aligndp.plan.spec import Mode
from aligndp.runtime.buffer import FlatBuffer
from aligndp.runtime.grads import ShardedGrad

__all__ = [
    "BucketRef",
    "StepState",
    "GradSlot",
    "ParamIndex",
    "RoundReport",
    "param_index",
]


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
    """Where one trainable param lives: its bucket, plan slot, gradient view and owned piece."""

    index: int
    """Position in registration order (the order of the agreement flags)."""
    ref: BucketRef
    slot: ParamSlot
    """Where the plan put it in its buffer (start, end, bucket, owner)."""
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


@dataclasses.dataclass(frozen=True)
class ParamIndex:
    """The one param -> (buffer, bucket, slot, owned piece) index of a DataParallel, built once
    from its buffers (:func:`param_index`) and shared by the gradient side, the param gather
    and the optimizer parts."""

    buffers: tuple[FlatBuffer, ...]
    """The model's ``flat_buffers``; ``BucketRef.buffer`` indexes them."""
    slots: Mapping[nn.Parameter, GradSlot]
    """Every trainable param's :class:`GradSlot`, in registration order."""
    refs: tuple[BucketRef, ...]
    """Every bucket, in launch order ([Note: launch order across buffers])."""
    members: Mapping[BucketRef, tuple[nn.Parameter, ...]]
    """Each bucket's params, in registration order."""
    by_id: Mapping[int, GradSlot]
    """``slots`` keyed by ``id(param)``: what the param gather looks up, where a pending
    param's hash would wait for its gather ([Note: reads wait for the gather])."""

    def buffer(self, ref: BucketRef) -> FlatBuffer:
        return self.buffers[ref.buffer]

    def refs_of(self, mode: Mode) -> list[BucketRef]:
        """The buckets of buffers in ``mode``, in launch order."""
        return [ref for ref in self.refs if self.buffer(ref).layout.mode is mode]


def param_index(
    buffers: Sequence[FlatBuffer], params: Sequence[nn.Parameter], *, rank: int
) -> ParamIndex:
    """The :class:`ParamIndex` of ``buffers`` (``params`` in registration order) for ``rank``."""
    position = {p: k for k, p in enumerate(params)}
    slots: dict[nn.Parameter, GradSlot] = {}
    for i, buf in enumerate(buffers):
        for p, s, view in zip(buf.params, buf.slots, buf.main_grads):
            owned = None
            if buf.layout.mode is not Mode.REPLICATED:
                owned = buf.layout.owned_piece(s, rank)
            sharded = ShardedGrad(p) if owned is not None else None
            slots[p] = GradSlot(position[p], BucketRef(i, s.bucket), s, view, owned, sharded)
    slots = dict(sorted(slots.items(), key=lambda item: item[1].index))
    refs = _launch_order(buffers, slots.values())
    members: dict[BucketRef, list[nn.Parameter]] = {ref: [] for ref in refs}
    for p, slot in slots.items():
        members[slot.ref].append(p)
    return ParamIndex(
        tuple(buffers),
        slots,
        refs,
        {ref: tuple(ps) for ref, ps in members.items()},
        {id(p): slot for p, slot in slots.items()},
    )


def _launch_order(buffers: Sequence[FlatBuffer], slots) -> tuple[BucketRef, ...]:
    """[Note: launch order across buffers]
    Buckets launch strictly in one order, the same on every rank ([Note: bucket readiness]),
    so a bucket that is ready late holds back every bucket after it. Each buffer's buckets
    keep their order (reverse registration: about backward's); the buffers are merged by each
    bucket's earliest-registered param, the latest first, since backward reaches that param
    last. Buffer by buffer instead, layer-wise Muon on a GPT launched nothing before the end of
    backward, eager or compiled: its AdamW buffer comes first (the embedding is registered
    first) and its one bucket holds the embedding, whose gradient comes last."""
    first: dict[BucketRef, int] = {}
    for slot in slots:
        first[slot.ref] = min(first.get(slot.ref, slot.index), slot.index)
    queues = [
        [BucketRef(i, b) for b in range(len(buf.layout.buckets))] for i, buf in enumerate(buffers)
    ]
    order: list[BucketRef] = []
    while any(queues):  # ties: the lower buffer first (max keeps the first maximum)
        queue = max((q for q in queues if q), key=lambda q: first.get(q[0], -1))
        order.append(queue.pop(0))
    return tuple(order)
