"""Model-space entries as DCP state: whole tensors, or 1-D ``ShardedTensor`` s of pieces.

A piece that is not the whole tensor becomes one shard of a 1-D ``ShardedTensor`` (global
metadata from one ``all_gather_object`` of piece extents, no per-tensor collective), so each
rank writes only the elements it owns and DCP's load planner reads any other cut of them.
Whole tensors (replicated params, whole optimizer state, scalars) are plain tensors that DCP
deduplicates to one writer. ShardedTensor is deprecated in favour of DTensor, which cannot
cut at arbitrary offsets.
"""

from __future__ import annotations

import dataclasses
import warnings

import torch
import torch.distributed as dist
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import (
    ShardedTensorMetadata,
    TensorProperties,
)

from aligndp.state.model_space import FlatPiece

__all__ = ["ParamGroups", "to_dcp"]


@dataclasses.dataclass
class ParamGroups:
    """Hyper-parameters of the optimizer's groups; one opaque DCP entry (DCP would flatten a bare
    list)."""

    groups: list[dict]


def to_dcp(entries: dict[str, object], group: dist.ProcessGroup | None) -> dict[str, object]:
    """Turn FlatPieces into plain tensors (whole) or 1-D ShardedTensors (parts); one collective."""
    mine = {
        k: (v.offset, v.tensor.numel(), v.numel, str(v.tensor.dtype), str(v.tensor.device))
        for k, v in entries.items()
        if isinstance(v, FlatPiece)
    }
    everyone: list[dict] = [None] * dist.get_world_size(group)  # type: ignore[list-item]
    dist.all_gather_object(everyone, mine, group=group)
    out = {k: v for k, v in entries.items() if not isinstance(v, FlatPiece)}
    keys = sorted({k for d in everyone for k in d})
    for key in keys:
        shards = [(r, d[key]) for r, d in enumerate(everyone) if key in d and d[key][1] > 0]
        local = entries.get(key)
        if any(length == numel for _, (_, length, numel, _, _) in shards):
            if local is not None and local.tensor.numel() == local.numel:
                out[key] = local.tensor  # whole on every holder: DCP deduplicates
            continue
        out[key] = _sharded_tensor(key, shards, local, group)
    return out


def _sharded_tensor(key: str, shards: list, local: FlatPiece | None, group) -> ShardedTensor:
    """A 1-D ShardedTensor whose shards are the ranks' pieces, built without communication."""

    def global_rank(r: int) -> int:
        return dist.get_global_rank(group, r) if group is not None else r

    metas = {
        r: ShardMetadata([off], [length], placement=f"rank:{global_rank(r)}/{device}")
        for r, (off, length, _, _, device) in shards
    }
    numel, dtype = shards[0][1][2], getattr(torch, shards[0][1][3].removeprefix("torch."))
    props = TensorProperties(
        dtype=dtype,
        layout=torch.strided,
        requires_grad=False,
        memory_format=torch.contiguous_format,
        pin_memory=False,
    )
    md = ShardedTensorMetadata(list(metas.values()), torch.Size([numel]), props)
    rank = dist.get_rank(group)
    local_shards = [Shard(local.tensor, metas[rank])] if local is not None and rank in metas else []
    with warnings.catch_warnings():
        warnings.simplefilter(
            "ignore"
        )  # ShardedTensor is deprecated in favour of DTensor, which cannot cut at arbitrary offsets
        return ShardedTensor._init_from_local_shards_and_global_metadata(
            local_shards, md, process_group=group
        )
