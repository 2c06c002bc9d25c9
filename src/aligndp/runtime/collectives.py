"""Collectives on buckets behind one small interface, and today's implementation of it.

[Note: collectives seam]
Everything the runtime communicates per bucket — the gradient all-reduce or reduce-scatter
(reducer.py), the param all-gather (param_gather.py), the small sums of the end-of-backward
agreement, ``join()`` and the optimizers' global norm — goes through one :class:`Collectives`
object bound to the data-parallel process group, and so does the buffers' storage
(:meth:`Collectives.allocate`, the allocation hook: a symmetric-memory backend allocates its
buffers where its peers can reach them). ``DDPConfig.collectives`` names the backend; the
registry is in collective_backends.py. A new backend is one module with one class, plus its
registration there. Whatever a backend allocates, :class:`~aligndp.runtime.buffer.FlatBuffer`
checks the real addresses ([Note: alignment contract]), so no backend can weaken it.

:class:`TorchCollectives`, the default, calls ``torch.distributed`` asynchronously
(``async_op=True``) and returns its ``Work`` so the caller decides when to wait. Gradients
are averaged by pre-dividing by the group size and summing — the same order of operations as
torch DDP's default, so results match it bit for bit on the same reduction algorithm. On NCCL
the division is fused into the collective (``ReduceOp.AVG``), saving one read and one write
of every bucket. Sharded collectives work in place: rank r's shard is
``bucket.view(dp_size, -1)[r]`` (NCCL and gloo both accept an output that aliases the input
at that offset), so no staging copies are made.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist

from aligndp.runtime.buffer import AlignedAllocator, Allocator

__all__ = ["Work", "Collectives", "TorchCollectives", "shard_of"]

# torch >= 2.13 renamed the tensor-in/tensor-out collectives; older releases keep the old names.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class Work(Protocol):
    """The handle of an asynchronous collective (``torch.distributed.Work`` is one)."""

    def wait(self) -> object:
        """Block until the collective's result may be read."""
        ...


class Collectives(Allocator, Protocol):
    """The collectives of one process group that the runtime uses ([Note: collectives seam]).

    Buckets are 1-D views into a buffer made by this backend's :meth:`allocate`, with a
    length divisible by ``dp_size`` where they are sharded. Callers skip every collective
    when ``dp_size == 1``.
    """

    name: str
    """The name it is registered under (errors name it)."""
    group: dist.ProcessGroup | None
    """The data-parallel process group it is bound to (None: the default group)."""
    rank: int
    """This rank's index in ``group``."""
    dp_size: int
    """Ranks in ``group``."""
    replicas: int
    """Ranks holding each shard ([Note: replicate x shard mesh] in mesh.py); 1 on a flat group."""

    def all_reduce_mean(self, bucket: torch.Tensor) -> Work:
        """Start averaging ``bucket`` in place over the ranks."""
        ...

    def reduce_scatter_mean(self, bucket: torch.Tensor) -> Work:
        """Start averaging ``bucket`` over the ranks into this rank's shard of it
        (:func:`shard_of`), in place; the rest of the bucket is not to be read afterwards."""
        ...

    def all_gather_shards(self, bucket: torch.Tensor) -> Work:
        """Start filling every rank's shard of ``bucket`` from its owner, in place."""
        ...

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        """Sum a small ``tensor`` (flags) in place over every rank of the job, blocking."""
        ...

    def all_reduce_owned_sum(self, tensor: torch.Tensor) -> None:
        """Sum a small ``tensor`` (a norm's owned squares) in place over ``group``, blocking:
        one copy of every owned piece, however many replicas hold it."""
        ...


def shard_of(bucket: torch.Tensor, *, rank: int, dp_size: int) -> torch.Tensor:
    """Rank's equal slice of a 1-D bucket (a view; the bucket length is a multiple of dp_size)."""
    return bucket.view(dp_size, -1)[rank]


class TorchCollectives(AlignedAllocator):
    """The default backend: ``torch.distributed`` on ``group``, storage from
    :func:`~aligndp.runtime.buffer.aligned_empty`. Subclass it to change one piece."""

    name = "torch"
    replicas = 1

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.dp_size = dist.get_world_size(group)
        self._has_avg = dist.get_backend(group) == "nccl"  # asked once, not per bucket

    def _mean_op(self, bucket: torch.Tensor) -> dist.ReduceOp:
        """AVG where the backend has it (NCCL); else pre-divide in place and SUM."""
        if self._has_avg:
            return dist.ReduceOp.AVG
        bucket.div_(self.dp_size)
        return dist.ReduceOp.SUM

    def all_reduce_mean(self, bucket: torch.Tensor) -> dist.Work:
        op = self._mean_op(bucket)
        return dist.all_reduce(bucket, op=op, group=self.group, async_op=True)

    def reduce_scatter_mean(self, bucket: torch.Tensor) -> dist.Work:
        op = self._mean_op(bucket)
        out = shard_of(bucket, rank=self.rank, dp_size=self.dp_size)
        return _reduce_scatter(out, bucket, op=op, group=self.group, async_op=True)

    def all_gather_shards(self, bucket: torch.Tensor) -> dist.Work:
        shard = shard_of(bucket, rank=self.rank, dp_size=self.dp_size)
        return _all_gather(bucket, shard, group=self.group, async_op=True)

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)

    def all_reduce_owned_sum(self, tensor: torch.Tensor) -> None:
        self.all_reduce_sum(tensor)


@torch.no_grad()
def broadcast_by_dtype(tensors: list[torch.Tensor], *, src: int, group) -> None:
    """Rank ``src``'s (global rank) values of ``tensors`` to every rank of ``group``: one
    broadcast per dtype, none for an empty list (module buffers each forward, and a Join's
    final sync of params and buffers)."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t.data)
    for same in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in same])
        dist.broadcast(flat, src=src, group=group)
        torch._foreach_copy_(
            same, [f.view_as(t) for f, t in zip(flat.split([t.numel() for t in same]), same)]
        )
