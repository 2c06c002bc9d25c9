"""Model-space pieces as chunks of plain full-shape DCP tensors ([Note: checkpoint format]).

A rank's piece of a param (or of its per-element optimizer state) is a flat range
``[lo, hi)`` of the row-major tensor. :func:`flat_range_chunks` cuts that range into
rectangular chunks of the full-shape tensor (at most ``2 * ndim - 1``; at most three for a
matrix: a partial first row, whole rows, a partial last row), each a contiguous slice of the
piece. :class:`PieceSavePlanner` writes each rank's chunks as ``SHARD`` items of the full
tensor, so DCP's metadata describes an ordinary tensor of the param's shape that each rank
wrote part of; DCP's own planners read any cut of it (a plain ``nn.Module``'s state dict, or
:class:`PieceLoadPlanner`'s pieces at another dp size).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from aligndp.state.model_space import FlatPiece

__all__ = ["Cut", "PieceLoadPlanner", "PieceSavePlanner", "flat_range_chunks"]

Chunk = tuple[tuple[int, ...], tuple[int, ...]]
"""(offsets, sizes) of a rectangular block of a tensor."""


def flat_range_chunks(lo: int, hi: int, shape: tuple[int, ...]) -> list[Chunk]:
    """Rectangular blocks covering the flat (row-major) elements ``[lo, hi)`` of a tensor of
    ``shape`` exactly once, in flat order; each block is a contiguous flat range. Pure."""
    if lo >= hi:
        return []
    if len(shape) <= 1:
        return [((lo,), (hi - lo,))] if shape else [((), ())]
    inner = math.prod(shape[1:])
    rest = tuple(shape[1:])

    def within(row: int, a: int, b: int) -> list[Chunk]:  # [a, b) of one row (a slab)
        return [((row, *o), (1, *s)) for o, s in flat_range_chunks(a, b, rest)]

    first, last = -(-lo // inner), hi // inner  # whole rows [first, last)
    if first > last:  # inside one row
        return within(lo // inner, lo % inner, hi % inner)
    out = within(lo // inner, lo % inner, inner) if lo % inner else []
    if last > first:
        out.append(((first, *(0,) * len(rest)), (last - first, *rest)))
    if hi % inner:
        out += within(last, 0, hi % inner)
    return out


@dataclasses.dataclass(frozen=True)
class Cut:
    """A :class:`FlatPiece` of a tensor of full ``shape``: what a rank writes or reads of it."""

    piece: FlatPiece
    shape: tuple[int, ...]

    def chunks(self) -> Iterator[tuple[ChunkStorageMetadata, torch.Tensor]]:
        """Each block of the piece with its view into ``piece.tensor`` (shaped like the block)."""
        flat, pos = self.piece.tensor, 0
        for offsets, sizes in flat_range_chunks(
            self.piece.offset, self.piece.offset + flat.numel(), self.shape
        ):
            n = math.prod(sizes)
            yield (
                ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)),
                flat[pos : pos + n].view(sizes),
            )
            pos += n


class PieceSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, plus :class:`Cut` values written as ``SHARD`` chunks of their
    full-shape tensor (DCP's global plan joins every rank's chunks into one tensor's metadata
    and checks they tile it). Nested dicts flatten as DCP's own planner flattens them."""

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False) -> None:
        super().set_up_planner(state_dict, storage_meta, is_coordinator)
        self._cuts = {k: v for k, v in self.state_dict.items() if isinstance(v, Cut)}
        self.state_dict = {k: v for k, v in self.state_dict.items() if not isinstance(v, Cut)}
        self._views: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        items = []
        for fqn, cut in self._cuts.items():
            for chunk, view in cut.chunks():
                self._views[(fqn, tuple(chunk.offsets))] = view
                items.append(
                    WriteItem(
                        index=MetadataIndex(fqn, chunk.offsets),
                        type=WriteItemType.SHARD,
                        tensor_data=TensorWriteData(
                            chunk=chunk,
                            properties=TensorProperties.create_from_tensor(view),
                            size=torch.Size(cut.shape),
                        ),
                    )
                )
        self.plan = dataclasses.replace(plan, items=[*plan.items, *items])
        return self.plan

    def lookup_object(self, index: MetadataIndex):
        if index.fqn in self._cuts:
            return self._views[(index.fqn, tuple(index.offset))]
        return super().lookup_object(index)


class PieceLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner over a flat state dict, plus ``cuts`` (kept out of that dict:
    DCP copies it) read from whatever chunks were saved, any other cut of the same tensor."""

    def __init__(self, cuts: dict[str, Cut]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._cuts = cuts
        self._views: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}

    def create_local_plan(self) -> LoadPlan:
        plan = super().create_local_plan()
        items = []
        for fqn, cut in self._cuts.items():
            chunks = []
            for chunk, view in cut.chunks():
                self._views[(fqn, tuple(chunk.offsets))] = view
                chunks.append(chunk)
            items += create_read_items_for_chunk_list(
                fqn, self.metadata.state_dict_metadata[fqn], chunks
            )
        return dataclasses.replace(plan, items=[*plan.items, *items])

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        if index.fqn in self._cuts:
            return self._views[(index.fqn, tuple(index.offset))]
        return super().lookup_tensor(index)
