"""Buffer layouts as plain data, made by pure functions.

[Note: alignment contract]
Every consumer of a buffer view (a fused wgrad GEMM writing into ``main_grad``, a collective
on a shard, a whole-tensor optimizer) declares a :class:`Requirement`. :func:`plan_layout`
satisfies the union of all of them (alignments combine by lcm) and :func:`validate` re-checks
the result; buffers call ``validate`` at construction, so no mode can skip it. Param starts
are 64-element aligned by default in every mode; a caller may lower that default only where
no active requirement asks for more.

This module allocates no tensors and imports no ``torch.distributed``.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Iterable, Mapping, Sequence

import torch

from aligndp.plan.assign import assign_owners, group_layerwise_buckets, newton_schulz_cost

__all__ = [
    "DEFAULT_START_ALIGNMENT",
    "DEFAULT_BUCKET_NUMEL",
    "DEFAULT_SHARD_ALIGNMENT",
    "Mode",
    "ParamSpec",
    "Requirement",
    "ParamSlot",
    "BucketSlot",
    "BufferLayout",
    "plan_layout",
    "plan_buffers",
    "validate",
    "combined_start_alignment",
]

DEFAULT_START_ALIGNMENT = 64
"""Elements. 128 B for 16-bit views: what cuBLASLt's MXFP8 wgrad needs; ≤ 63 elements of
padding per param."""

DEFAULT_BUCKET_NUMEL = 40_000_000
"""Elements per bucket when the caller names none: ``DDPConfig``, ``parallelize()`` and
``aligndp layout`` share it, so the picture shows the buckets the run builds."""

DEFAULT_SHARD_ALIGNMENT = 128
"""Elements. In sharded modes bucket ends are padded so each shard is a multiple of this."""


class Mode(str, enum.Enum):
    """How a buffer is reduced and who owns what."""

    REPLICATED = "replicated"
    """All-reduce; every rank owns everything (plain DDP)."""
    SHARDED = "sharded"
    """ZeRO-1: reduce-scatter; rank r owns slice r of every bucket (params may straddle)."""
    LAYERWISE = "layerwise"
    """Reduce-scatter; every param lies whole inside the shard of its owner rank."""

    @classmethod
    def parse(cls, value: Mode | str) -> Mode:
        try:
            return cls(value)
        except ValueError:
            choices = ", ".join(m.value for m in cls)
            raise ValueError(f"unknown mode {value!r}: choose one of {choices}") from None


def _is_power_of_two(n: int) -> bool:
    return isinstance(n, int) and n >= 1 and (n & (n - 1)) == 0


def _round_up(n: int, multiple: int) -> int:
    """Smallest multiple of ``multiple`` that is >= ``n``."""
    return -(-n // multiple) * multiple


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """What layout planning needs to know about one trainable parameter."""

    name: str
    """Fully qualified name, e.g. ``blocks.3.mlp.fc.weight``."""
    shape: tuple[int, ...]
    """Tensor shape; every dim >= 1."""
    dtype: torch.dtype = torch.float32
    """Parameter dtype (the grad buffer's dtype is chosen separately)."""
    tags: frozenset[str] = frozenset()
    """Free-form labels such as ``matrix`` or ``embedding`` (routing reads them, layout doesn't)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        object.__setattr__(self, "tags", frozenset(self.tags))
        if not isinstance(self.dtype, torch.dtype):
            raise TypeError(f"param {self.name!r}: dtype must be a torch.dtype, got {self.dtype!r}")
        if any(d < 1 for d in self.shape) or math.prod(self.shape) < 1:
            raise ValueError(
                f"param {self.name!r} has shape {self.shape} with zero elements: "
                "a zero-size param cannot be trained; freeze it (requires_grad=False) or remove it"
            )

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @classmethod
    def from_named_parameters(
        cls, named: Iterable[tuple[str, torch.nn.Parameter]]
    ) -> list[ParamSpec]:
        """Specs of the trainable params, in registration order."""
        specs = []
        for name, p in named:
            if p.requires_grad:
                tags = {"matrix"} if p.ndim == 2 else set()
                specs.append(cls(name, tuple(p.shape), p.dtype, frozenset(tags)))
        return specs


@dataclasses.dataclass(frozen=True)
class Requirement:
    """What one consumer of buffer views needs from the layout. See [Note: alignment contract]."""

    rule: str
    """Who needs it and why, quoted in errors, e.g. ``"MXFP8 wgrad (cuBLASLt)"``."""
    start_elements: int = 1
    """Every param start must be a multiple of this many elements (power of two)."""
    start_bytes: int = 1
    """Every param start must be a multiple of this many bytes in the grad buffer (power of two)."""
    shard_divisible: bool = False
    """Bucket length must split into ``dp_size`` equal shards (sharded and layerwise modes)."""
    whole_param_per_shard: bool = False
    """No param may straddle a shard boundary (whole-tensor optimizers)."""

    def __post_init__(self) -> None:
        for field in ("start_elements", "start_bytes"):
            value = getattr(self, field)
            if not _is_power_of_two(value):
                raise ValueError(
                    f"requirement {self.rule!r}: {field}={value!r} is not a power of two; "
                    "use 1, 2, 4, ..., e.g. 64"
                )

    def start_alignment(self, itemsize: int) -> int:
        """This requirement's start alignment in elements of size ``itemsize`` bytes."""
        return max(
            self.start_elements, self.start_bytes // itemsize if self.start_bytes > itemsize else 1
        )


def combined_start_alignment(requirements: Iterable[Requirement], itemsize: int) -> int:
    """The lcm of every requirement's start alignment, in elements of ``itemsize`` bytes."""
    return math.lcm(1, *(r.start_alignment(itemsize) for r in requirements))


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

    def rank_costs(self) -> list[float]:
        """Estimated Newton–Schulz cost each rank steps (layerwise mode; zeros otherwise)."""
        costs = [0.0] * self.dp_size
        for p in self.params:
            if p.owner is not None:
                costs[p.owner] += newton_schulz_cost(p.shape)
        return costs

    @property
    def imbalance(self) -> float:
        """max/mean of per-rank cost in layerwise mode; 1.0 for the other modes."""
        costs = self.rank_costs()
        mean = sum(costs) / len(costs)
        return max(costs) / mean if mean > 0 else 1.0

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
                f"  Newton–Schulz cost imbalance (max/mean over ranks): {self.imbalance:.4f}"
            )
        width = max([len(p.name) for p in self.params] + [4])
        lines.append(
            f"  {'name':<{width}}  {'shape':>14}  {'start':>12}  {'end':>12}  bucket  owner"
        )
        for p in self.params:
            shape = "x".join(map(str, p.shape))
            owner = "-" if p.owner is None else str(p.owner)
            lines.append(
                f"  {p.name:<{width}}  {shape:>14}  {p.start:>12,}  {p.end:>12,}  {p.bucket:>6}  {owner:>5}"
            )
        for b in self.buckets:
            lines.append(f"  bucket {b.index}: [{b.start:,}, {b.end:,}) {b.numel:,} elements")
        return "\n".join(lines)


def _check_settings(
    dp_size: int, bucket_numel: int | None, start_alignment: int, shard_alignment: int
) -> None:
    if not isinstance(dp_size, int) or dp_size < 1:
        raise ValueError(f"dp_size must be an integer >= 1, got {dp_size!r}")
    if bucket_numel is not None and (not isinstance(bucket_numel, int) or bucket_numel <= 0):
        raise ValueError(
            f"bucket_numel must be a positive number of elements or None (one bucket), got {bucket_numel!r}"
        )
    if not _is_power_of_two(start_alignment):
        raise ValueError(
            f"start_alignment must be a power of two (1, 2, 4, ..., 64), got {start_alignment!r}"
        )
    if not _is_power_of_two(shard_alignment):
        raise ValueError(
            f"shard_alignment must be a power of two (1, 2, 4, ..., 128), got {shard_alignment!r}"
        )


def _group_into_buckets(specs: Sequence[ParamSpec], bucket_numel: int | None) -> list[list[int]]:
    """Indices of ``specs`` (already in layout order) grouped into buckets.

    A bucket closes once it holds at least ``bucket_numel`` elements (layerwise mode groups
    with :func:`aligndp.plan.assign.group_layerwise_buckets` instead).
    """
    if bucket_numel is None:
        return [list(range(len(specs)))]
    buckets: list[list[int]] = [[]]
    filled = 0
    for i, spec in enumerate(specs):
        buckets[-1].append(i)
        filled += spec.numel
        if filled >= bucket_numel:
            buckets.append([])
            filled = 0
    if not buckets[-1]:
        buckets.pop()
    return buckets


def plan_layout(
    specs: Sequence[ParamSpec],
    *,
    dp_size: int = 1,
    mode: Mode | str = Mode.REPLICATED,
    bucket_numel: int | None = None,
    requirements: Iterable[Requirement] = (),
    start_alignment: int = DEFAULT_START_ALIGNMENT,
    shard_alignment: int = DEFAULT_SHARD_ALIGNMENT,
    grad_dtype: torch.dtype | None = None,
) -> BufferLayout:
    """Plan one buffer for ``specs`` (registration order, one param dtype).

    Params are laid out in reverse registration order (≈ backward order) so bucket 0 is ready
    first. Each start is a multiple of ``lcm(start_alignment, every requirement)``. In sharded
    modes each bucket's length is a multiple of ``dp_size * lcm(shard_alignment, start)``; in
    layerwise mode each bucket is cut into ``dp_size`` equal shards, params packed whole into
    their owner's shard, owners chosen by :func:`aligndp.plan.assign.assign_owners`.
    The result is checked by :func:`validate` before it is returned.
    """
    mode = Mode.parse(mode)
    _check_settings(dp_size, bucket_numel, start_alignment, shard_alignment)
    if not specs:
        raise ValueError(
            "no trainable params to lay out: the model has no params with requires_grad=True"
        )
    dtypes = {s.dtype for s in specs}
    if len(dtypes) != 1:
        raise ValueError(
            f"one buffer holds one param dtype, got {sorted(map(str, dtypes))}; use plan_buffers()"
        )
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        duplicated = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(
            f"param names must be unique, got {duplicated} more than once: list a shared (tied) param once, "
            "as model.named_parameters() does"
        )
    param_dtype = specs[0].dtype
    grad_dtype = grad_dtype or param_dtype
    requirements = tuple(requirements)
    if mode is Mode.SHARDED and any(r.whole_param_per_shard for r in requirements):
        rules = [r.rule for r in requirements if r.whole_param_per_shard]
        raise ValueError(
            f"{rules} need every param whole inside one shard, which sharded mode does not keep; "
            "plan with mode='layerwise'"
        )
    if mode is not Mode.REPLICATED:
        requirements += (
            Requirement(f"{mode.value} mode: equal shards per rank", shard_divisible=True),
        )
    if mode is Mode.LAYERWISE:
        requirements += (
            Requirement("layerwise mode: whole-tensor optimizer", whole_param_per_shard=True),
        )
    itemsizes = {grad_dtype.itemsize, param_dtype.itemsize}
    align = math.lcm(
        start_alignment, *(combined_start_alignment(requirements, s) for s in itemsizes)
    )
    shard_align = math.lcm(shard_alignment, align) if mode is not Mode.REPLICATED else 1

    order = list(reversed(range(len(specs))))  # layout order: reverse registration
    ordered = [specs[i] for i in order]
    if mode is Mode.LAYERWISE:  # buckets that pack into whole-param shards with little padding
        groups = group_layerwise_buckets(
            [s.shape for s in ordered],
            dp_size=dp_size,
            bucket_numel=bucket_numel,
            alignment=align,
            shard_alignment=shard_align,
        )
    else:
        groups = _group_into_buckets(ordered, bucket_numel)

    slots: list[ParamSlot] = []
    buckets: list[BucketSlot] = []
    cursor = 0
    if mode is Mode.LAYERWISE:
        owners = assign_owners(
            [[ordered[i].shape for i in group] for group in groups],
            dp_size=dp_size,
            alignment=align,
        )
    for b, group in enumerate(groups):
        bucket_start = cursor
        if mode is Mode.LAYERWISE:
            per_rank: list[list[int]] = [[] for _ in range(dp_size)]
            for i, owner in zip(group, owners[b]):
                per_rank[owner].append(i)
            used = [
                sum(_round_up(ordered[i].numel, align) for i in members) for members in per_rank
            ]
            shard = _round_up(max(max(used), 1), shard_align)
            for rank, members in enumerate(per_rank):
                pos = bucket_start + rank * shard
                for i in members:
                    s = ordered[i]
                    slots.append(ParamSlot(s.name, s.shape, order[i], pos, pos + s.numel, b, rank))
                    pos = _round_up(pos + s.numel, align)
            cursor = bucket_start + dp_size * shard
        else:
            for i in group:
                s = ordered[i]
                cursor = _round_up(cursor, align)
                slots.append(
                    ParamSlot(s.name, s.shape, order[i], cursor, cursor + s.numel, b, None)
                )
                cursor += s.numel
            multiple = dp_size * shard_align if mode is Mode.SHARDED else align
            if mode is Mode.REPLICATED and any(r.shard_divisible for r in requirements):
                multiple = math.lcm(align, dp_size)  # a consumer splits buckets into dp_size slices
            cursor = bucket_start + _round_up(cursor - bucket_start, multiple)
        buckets.append(BucketSlot(b, bucket_start, cursor))

    layout = BufferLayout(
        mode=mode,
        dp_size=dp_size,
        param_dtype=param_dtype,
        grad_dtype=grad_dtype,
        start_alignment=align,
        shard_alignment=shard_align,
        params=tuple(slots),
        buckets=tuple(buckets),
        requirements=requirements,
    )
    validate(layout, requirements)
    return layout


def plan_buffers(
    specs: Sequence[ParamSpec],
    *,
    mode: Mode | str = Mode.REPLICATED,
    modes: Mapping[str, Mode | str] | None = None,
    grad_dtype: torch.dtype | None = None,
    **kwargs,
) -> list[BufferLayout]:
    """One layout per (mode, param dtype) group, registration order kept within each group.

    This is the plan :class:`~aligndp.runtime.ddp.DataParallel` builds its buffers from, so the
    ``aligndp layout`` command shows exactly what a run allocates. ``modes`` maps param
    names to their mode (others get ``mode``); ``grad_dtype`` None keeps each buffer's grads
    in its param dtype; ``kwargs`` go to :func:`plan_layout` for every group.
    """
    if not specs:
        raise ValueError(
            "no trainable params to lay out: the model has no params with requires_grad=True"
        )
    modes = dict(modes or {})
    unknown = set(modes) - {s.name for s in specs}
    if unknown:
        raise ValueError(f"modes name params that are not among the specs: {sorted(unknown)}")
    groups: dict[tuple[Mode, torch.dtype], list[ParamSpec]] = {}
    for s in specs:
        groups.setdefault((Mode.parse(modes.get(s.name, mode)), s.dtype), []).append(s)
    return [
        plan_layout(group, mode=m, grad_dtype=grad_dtype, **kwargs)
        for (m, _), group in groups.items()
    ]


def _fail(layout: BufferLayout, p: ParamSlot | None, what: str, rule: str, fix: str) -> None:
    where = ""
    if p is not None:
        item = layout.grad_dtype.itemsize
        where = (
            f"param {p.name!r} starts at element {p.start} ({p.start * item} B into the buffer): "
        )
    raise ValueError(f"{where}{what}; rule: {rule}; {fix}")


def validate(layout: BufferLayout, requirements: Iterable[Requirement] = ()) -> None:
    """Re-check every invariant of ``layout`` against ``requirements``; raise ``ValueError``.

    Checks: each param start meets every requirement's alignment (elements and bytes, for the
    grad and param dtypes); params don't overlap and keep their numel; buckets are contiguous,
    start at 0 and cover every param; in sharded modes each bucket splits into ``dp_size``
    equal shards; in layerwise mode each param lies whole in its owner's shard.
    """
    requirements = tuple(requirements) + tuple(layout.requirements)
    itemsizes = {layout.grad_dtype.itemsize, layout.param_dtype.itemsize}
    rules = [
        (
            layout.start_alignment,
            f"the layout's own start alignment of {layout.start_alignment} elements",
        )
    ]
    for r in requirements:
        for size in itemsizes:
            if r.start_alignment(size) > 1:
                rules.append(
                    (
                        r.start_alignment(size),
                        f"{r.rule} needs {r.start_alignment(size)}-element starts"
                        f" ({r.start_elements} elements / {r.start_bytes} B)",
                    )
                )
    for p in layout.params:
        if p.numel != math.prod(p.shape):
            _fail(
                layout,
                p,
                f"covers {p.numel} elements but its shape {p.shape} has {math.prod(p.shape)}",
                "a param's view is exactly its numel",
                "re-plan the layout with plan_layout()",
            )
        for align, rule in rules:
            if p.start % align:
                _fail(
                    layout,
                    p,
                    f"start % {align} = {p.start % align}",
                    rule,
                    f"plan the layout with start_alignment={align} (or pass the requirement to plan_layout)",
                )
    spans = sorted((p.start, p.end, p) for p in layout.params)
    for (_, end_a, a), (start_b, _, b) in zip(spans, spans[1:]):
        if start_b < end_a:
            _fail(
                layout,
                b,
                f"overlaps param {a.name!r} which ends at element {end_a}",
                "params never share elements",
                "re-plan the layout with plan_layout()",
            )
    cursor = 0
    for i, bucket in enumerate(layout.buckets):
        if bucket.index != i or bucket.start != cursor or bucket.end < bucket.start:
            _fail(
                layout,
                None,
                f"bucket {i} is [{bucket.start}, {bucket.end}) after element {cursor}",
                "buckets are contiguous, in order, from element 0",
                "re-plan the layout with plan_layout()",
            )
        cursor = bucket.end
    sharded = any(r.shard_divisible for r in requirements) or layout.sharded
    # replicated: every rank holds (and may step) every param whole, so there is nothing to check
    whole = layout.sharded and (
        any(r.whole_param_per_shard for r in requirements) or layout.mode is Mode.LAYERWISE
    )
    for p in layout.params:
        if not 0 <= p.bucket < len(layout.buckets):
            _fail(
                layout,
                p,
                f"names bucket {p.bucket} of {len(layout.buckets)}",
                "every param is in a bucket",
                "re-plan the layout",
            )
        b = layout.buckets[p.bucket]
        if not b.start <= p.start <= p.end <= b.end:
            _fail(
                layout,
                p,
                f"ends at {p.end}, outside its bucket [{b.start}, {b.end})",
                "a param lies inside its bucket",
                "re-plan the layout",
            )
        if whole:
            size = b.numel // layout.dp_size
            shard = (p.start - b.start) // size if size else 0
            if (p.end - 1 - b.start) // max(size, 1) != shard:
                _fail(
                    layout,
                    p,
                    f"straddles shards {shard} and {(p.end - 1 - b.start) // size} of bucket {p.bucket}"
                    f" (shard size {size})",
                    "a whole-tensor optimizer needs every param inside one shard",
                    "plan in layerwise mode",
                )
            if p.owner != shard:
                _fail(
                    layout,
                    p,
                    f"lies in shard {shard} but its owner is {p.owner}",
                    "owner ids agree with shard ids",
                    "re-plan in layerwise mode",
                )
    if sharded:
        for b in layout.buckets:
            if b.numel % (layout.dp_size * layout.shard_alignment):
                _fail(
                    layout,
                    None,
                    f"bucket {b.index} has {b.numel} elements, not a multiple of dp_size "
                    f"{layout.dp_size} x shard alignment {layout.shard_alignment}",
                    "collectives on shards need equal shards",
                    "plan in sharded mode",
                )
