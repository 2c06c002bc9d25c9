"""Collectives on buckets: free functions that take their process group explicitly.

Each returns the ``Work`` handle of an asynchronous collective (``async_op=True``) so the
caller decides when to wait. Gradients are averaged by pre-dividing by the group size and
summing — the same order of operations as torch DDP's default, so results match it bit for
bit on the same reduction algorithm. On NCCL the division is fused into the collective
(``ReduceOp.AVG``), saving one read and one write of every bucket.

Sharded collectives work in place: rank r's shard is
``bucket.view(dp_size, -1)[r]`` (NCCL and gloo both accept an output that aliases the
input at that offset), so no staging copies are made.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = [
    "all_reduce_mean",
    "reduce_scatter_mean",
    "all_gather_shards",
    "shard_of",
    "all_reduce_sum",
]

# torch >= 2.13 renamed the tensor-in/tensor-out collectives; older releases keep the old names.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def shard_of(bucket: torch.Tensor, *, rank: int, dp_size: int) -> torch.Tensor:
    """Rank's equal slice of a 1-D bucket (a view; the bucket length is a multiple of dp_size)."""
    return bucket.view(dp_size, -1)[rank]


def _mean_op(bucket: torch.Tensor, group: dist.ProcessGroup | None) -> dist.ReduceOp:
    """AVG where the backend has it (NCCL); else pre-divide in place and SUM."""
    if dist.get_backend(group) == "nccl":
        return dist.ReduceOp.AVG
    bucket.div_(dist.get_world_size(group))
    return dist.ReduceOp.SUM


def all_reduce_mean(bucket: torch.Tensor, *, group: dist.ProcessGroup | None) -> dist.Work:
    """Average ``bucket`` in place over ``group``; returns the async handle."""
    return dist.all_reduce(bucket, op=_mean_op(bucket, group), group=group, async_op=True)


def all_reduce_sum(tensor: torch.Tensor, *, group: dist.ProcessGroup | None) -> None:
    """Sum ``tensor`` in place over ``group`` (blocking; small tensors such as norms)."""
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)


def reduce_scatter_mean(bucket: torch.Tensor, *, group: dist.ProcessGroup | None) -> dist.Work:
    """Average ``bucket`` over ``group`` into this rank's shard of it, in place; async handle.

    Only the caller's shard holds the mean afterwards; the rest of the bucket holds this
    rank's own (possibly pre-divided) contribution and is not to be read.
    """
    op = _mean_op(bucket, group)
    out = shard_of(bucket, rank=dist.get_rank(group), dp_size=dist.get_world_size(group))
    return _reduce_scatter(out, bucket, op=op, group=group, async_op=True)


def all_gather_shards(bucket: torch.Tensor, *, group: dist.ProcessGroup | None) -> dist.Work:
    """Fill every rank's shard of ``bucket`` from its owner, in place; async handle."""
    dp_size = dist.get_world_size(group)
    shard = shard_of(bucket, rank=dist.get_rank(group), dp_size=dp_size)
    return _all_gather(bucket, shard, group=group, async_op=True)
