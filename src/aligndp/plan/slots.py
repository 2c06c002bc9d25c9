"""A planned buffer as plain, frozen, printable data: where each param and bucket lies.

Made by :func:`aligndp.plan.layout.plan_layout`, checked by :func:`aligndp.plan.validate.validate`,
allocated by the runtime's ``FlatBuffer``. Pure: no tensors, no ``torch.distributed``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch

from aligndp.plan.spec import Mode, OwnerCost, Requirement, max_over_mean
from aligndp.plan.split import MatrixSplit

__all__ = ["ParamSlot", "BucketSlot", "OwnedPiece", "BufferLayout", "padding_totals"]


@dataclasses.dataclass(frozen=True)
class ParamSlot:
    """Where one param lives in a buffer."""

    name: str
    shape: tuple[int, ...]
    index: int
    """Position in registration order among this buffer's params."""
    start: int
    end: int
    bucket: int
    owner: int | None
    """Rank that steps this param whole (layerwise mode); None otherwise."""
    cost: float = 0.0
    """The owner cost the planner balanced (layerwise mode, the request's cost function); 0
    otherwise."""
    split: MatrixSplit | None = None
    """Layerwise mode: the ranks that share this matrix's Newton–Schulz, the owner first
    ([Note: split Newton–Schulz] in plan/split.py); None: the owner alone."""

    @property
    def numel(self) -> int:
        return self.end - self.start


@dataclasses.dataclass(frozen=True)
class BucketSlot:
    """A contiguous range of a buffer: the unit of one collective."""

    index: int
    start: int
    end: int

    @property
    def numel(self) -> int:
        return self.end - self.start


@dataclasses.dataclass(frozen=True)
class OwnedPiece:
    """A rank's piece of one param: buffer elements ``[start, end)`` are the flattened param's
    ``[lo, hi)`` (``lo = offset``). The one type for it everywhere ([Note: owned pieces] in
    DESIGN.md); empty (``start == end``) where the rank owns nothing of the param."""

    name: str
    index: int
    """The param's registration index within its buffer (``ParamSlot.index``)."""
    bucket: int
    start: int
    end: int
    offset: int
    """Where ``start`` lies in the flattened param."""

    @property
    def numel(self) -> int:
        return self.end - self.start

    @property
    def lo(self) -> int:
        return self.offset

    @property
    def hi(self) -> int:
        return self.offset + self.numel


def padding_totals(layouts: Iterable[BufferLayout]) -> tuple[int, int]:
    """``(real, padded)`` elements summed over ``layouts``."""
    layouts = list(layouts)
    return sum(lo.numel for lo in layouts), sum(lo.padded_numel for lo in layouts)


@dataclasses.dataclass(frozen=True)
class BufferLayout:
    """The layout of one flat buffer: plain, frozen, printable data."""

    mode: Mode
    dp_size: int
    param_dtype: torch.dtype
    grad_dtype: torch.dtype
    start_alignment: int
    """Effective param start alignment in elements (lcm of the default and every requirement)."""
    shard_alignment: int
    """Sharded modes: each shard's length is a multiple of this; 1 in replicated mode."""
    params: tuple[ParamSlot, ...]
    """In layout order (reverse registration order, grouped by owner in layerwise mode)."""
    buckets: tuple[BucketSlot, ...]
    requirements: tuple[Requirement, ...] = ()

    @property
    def numel(self) -> int:
        """Real (unpadded) elements."""
        return sum(p.numel for p in self.params)

    @property
    def padded_numel(self) -> int:
        return self.buckets[-1].end if self.buckets else 0

    @property
    def padding_numel(self) -> int:
        return self.padded_numel - self.numel

    @property
    def padding_fraction(self) -> float:
        return self.padding_numel / self.padded_numel if self.padded_numel else 0.0

    @property
    def sharded(self) -> bool:
        return self.mode is not Mode.REPLICATED

    def shard_range(self, bucket: int, rank: int) -> tuple[int, int]:
        """``[start, end)`` of rank's shard of a bucket (the whole bucket when replicated)."""
        b = self.buckets[bucket]
        if not self.sharded:
            return b.start, b.end
        size = b.numel // self.dp_size
        return b.start + rank * size, b.start + (rank + 1) * size

    def params_in_bucket(self, bucket: int) -> tuple[ParamSlot, ...]:
        return tuple(p for p in self.params if p.bucket == bucket)

    def owned_piece(self, param: ParamSlot, rank: int) -> OwnedPiece:
        """``param`` intersected with rank's shard of its bucket (the whole param when
        replicated; possibly empty: a param may straddle shards, a shard may hold only
        padding)."""
        lo, hi = self.shard_range(param.bucket, rank)
        start = min(max(param.start, lo), param.end)
        end = max(min(param.end, hi), start)
        return OwnedPiece(param.name, param.index, param.bucket, start, end, start - param.start)

    def owned_pieces(self, rank: int) -> tuple[OwnedPiece, ...]:
        """Rank's real elements, one non-empty piece per param it (partly) owns, in layout
        order; over all ranks of a sharded layout they partition the real elements once."""
        if not 0 <= rank < self.dp_size:
            raise ValueError(f"rank {rank} is outside dp_size {self.dp_size}")
        pieces = (
            self.owned_piece(p, rank)
            for b in range(len(self.buckets))
            for p in self.params_in_bucket(b)
        )
        return tuple(piece for piece in pieces if piece.numel)

    def rank_costs(self, cost: OwnerCost | None = None) -> list[float]:
        """Owner cost each rank steps (layerwise mode; zeros otherwise): the costs recorded
        at plan time, a split matrix's parts on their ranks; or, when a function is given,
        ``cost(shape)`` of every param on its owner (splits ignored)."""
        costs = [0.0] * self.dp_size
        for p in self.params:
            if p.owner is None:
                continue
            if cost is None and p.split is not None:
                for rank, part in zip(p.split.ranks, p.split.costs):
                    costs[rank] += part
            else:
                costs[p.owner] += p.cost if cost is None else cost(p.shape)
        return costs

    @property
    def splits(self) -> tuple[ParamSlot, ...]:
        """The params whose Newton–Schulz several ranks share, in layout order."""
        return tuple(p for p in self.params if p.split is not None)

    def rank_numels(self) -> list[int]:
        """Real elements each rank owns: its shard of every bucket intersected with params."""
        owned = [0] * self.dp_size
        for b in self.buckets:
            for rank in range(self.dp_size):
                lo, hi = self.shard_range(b.index, rank)
                owned[rank] += sum(
                    max(0, min(hi, p.end) - max(lo, p.start))
                    for p in self.params_in_bucket(b.index)
                )
        return owned

    @property
    def imbalance(self) -> float:
        """max/mean of per-rank owner cost in layerwise mode; 1.0 for the other modes."""
        return max_over_mean(self.rank_costs())

    def param(self, name: str) -> ParamSlot:
        for p in self.params:
            if p.name == name:
                return p
        raise KeyError(f"no param {name!r} in this layout")

    def to_dict(self) -> dict:
        return {
            "mode": self.mode.value,
            "dtype": str(self.grad_dtype).removeprefix("torch."),
            "param_dtype": str(self.param_dtype).removeprefix("torch."),
            "dp_size": self.dp_size,
            "start_alignment": self.start_alignment,
            "numel": self.numel,
            "padded_numel": self.padded_numel,
            "padding_numel": self.padding_numel,
            "imbalance": self.imbalance,
            "rank_costs": self.rank_costs() if self.mode is Mode.LAYERWISE else None,
            "buckets": [{"start": b.start, "end": b.end} for b in self.buckets],
            "params": [
                {
                    "name": p.name,
                    "shape": list(p.shape),
                    "start": p.start,
                    "end": p.end,
                    "bucket": p.bucket,
                    "owner": p.owner,
                    "split": None
                    if p.split is None
                    else {"ranks": list(p.split.ranks), "cols": list(p.split.cols)},
                }
                for p in self.params
            ],
        }

    def __str__(self) -> str:
        dt = str(self.grad_dtype).removeprefix("torch.")
        lines = [
            f"{self.mode.value} buffer ({dt} grads, dp_size={self.dp_size}, "
            f"starts % {self.start_alignment} elements): {self.numel:,} real + "
            f"{self.padding_numel:,} padding = {self.padded_numel:,} elements "
            f"({100 * self.padding_fraction:.3f}% padding), {len(self.buckets)} bucket(s)"
        ]
        if self.mode is Mode.LAYERWISE:
            lines.append(
                f"  owner cost imbalance (max/mean over ranks): {self.imbalance:.4f}, "
                f"{len(self.splits)} matrices split over ranks"
            )
        width = max([len(p.name) for p in self.params] + [4])
        lines.append(
            f"  {'name':<{width}}  {'shape':>14}  {'start':>12}  {'end':>12}  bucket  owner"
            + ("  split (rank:columns)" if self.splits else "")
        )
        for p in self.params:
            shape = "x".join(map(str, p.shape))
            owner = "-" if p.owner is None else str(p.owner)
            lines.append(
                f"  {p.name:<{width}}  {shape:>14}  {p.start:>12,}  {p.end:>12,}  "
                f"{p.bucket:>6}  {owner:>5}" + (f"  {p.split}" if p.split else "")
            )
        for b in self.buckets:
            lines.append(f"  bucket {b.index}: [{b.start:,}, {b.end:,}) {b.numel:,} elements")
        return "\n".join(lines)
