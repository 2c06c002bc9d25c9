"""Buffer layouts as plain data, made by pure functions.

The planner's side of [Note: alignment contract] (DESIGN.md). Every consumer of a buffer view
(a fused wgrad GEMM writing into ``main_grad``, a collective on a shard, a whole-tensor
optimizer) declares a :class:`Requirement`. :func:`plan_layout` satisfies the union of all of
them (alignments combine by lcm) and :func:`validate` re-checks the result; buffers call
``validate`` at construction, so no mode can skip it. Param starts are 64-element aligned by
default in every mode; a caller may lower that default only where no active requirement asks
for more.

This module plans one buffer; :func:`aligndp.plan.request.plan_buffers` plans every buffer of
a :class:`~aligndp.plan.request.PlanRequest`. The vocabulary (specs, requirements, modes)
lives in aligndp/plan/spec.py, the planned data in aligndp/plan/slots.py, the check in
aligndp/plan/validate.py. It allocates no tensors and imports no ``torch.distributed``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch

from aligndp.plan.assign import assign_owners, group_layerwise_buckets
from aligndp.plan.slots import BucketSlot, BufferLayout, ParamSlot
from aligndp.plan.spec import (
    DEFAULT_BUCKET_NUMEL,
    DEFAULT_SHARD_ALIGNMENT,
    DEFAULT_START_ALIGNMENT,
    Mode,
    OwnerCost,
    ParamSpec,
    Requirement,
    check_settings,
    combined_start_alignment,
    numel_cost,
    round_up,
)
from aligndp.plan.split import MatrixSplit, SplitPolicy, plan_splits
from aligndp.plan.validate import validate

__all__ = ["plan_layout"]


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


def _check_specs(specs: Sequence[ParamSpec]) -> None:
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
            f"param names must be unique, got {duplicated} more than once: list a shared (tied) "
            "param once, as model.named_parameters() does"
        )


def plan_layout(
    specs: Sequence[ParamSpec],
    *,
    dp_size: int = 1,
    mode: Mode | str = Mode.REPLICATED,
    bucket_numel: int | None = DEFAULT_BUCKET_NUMEL,
    requirements: Iterable[Requirement] = (),
    start_alignment: int = DEFAULT_START_ALIGNMENT,
    shard_alignment: int = DEFAULT_SHARD_ALIGNMENT,
    grad_dtype: torch.dtype | None = None,
    owner_cost: OwnerCost = numel_cost,
    gather_dtype: torch.dtype | None = None,
    split: SplitPolicy | None = None,
) -> BufferLayout:
    """Plan one buffer for ``specs`` (registration order, one param dtype).

    Params are laid out in reverse registration order (≈ backward order) so bucket 0 is ready
    first. Each start is a multiple of ``lcm(start_alignment, every requirement)``. In sharded
    modes each bucket's length is a multiple of ``dp_size * lcm(shard_alignment, start)``; in
    layerwise mode each bucket is cut into ``dp_size`` equal shards, params packed whole into
    their owner's shard, owners chosen by :func:`aligndp.plan.assign.assign_owners` balancing
    ``owner_cost(shape)`` (recorded in each slot); with a ``split`` policy, matrices whose
    Newton–Schulz several ranks share are then chosen by :func:`aligndp.plan.split.plan_splits`
    ([Note: split Newton–Schulz]). ``bucket_numel`` None: one bucket. ``gather_dtype``: what
    the param all-gather moves, if not the params themselves (sharded and layerwise modes);
    starts then also meet every requirement in its itemsize.
    The result is checked by :func:`validate` before it is returned.
    """
    mode = Mode.parse(mode)
    if split is not None and split.cost is not None:  # owners balanced in the split's units
        owner_cost = split.cost
    check_settings(
        dp_size=dp_size,
        bucket_numel=bucket_numel,
        start_alignment=start_alignment,
        shard_alignment=shard_alignment,
    )
    _check_specs(specs)
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
    if gather_dtype is not None and mode is Mode.REPLICATED:
        raise ValueError(
            f"gather_dtype {gather_dtype} asks for a low-precision param all-gather, but a "
            "replicated buffer gathers nothing; plan it in a sharded or layerwise mode"
        )
    itemsizes = {grad_dtype.itemsize, param_dtype.itemsize}
    if gather_dtype is not None:
        itemsizes.add(gather_dtype.itemsize)
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
            cost=owner_cost,
            alignment=align,
            shard_alignment=shard_align,
        )
        owners = assign_owners(
            [[ordered[i].shape for i in group] for group in groups],
            dp_size=dp_size,
            cost=owner_cost,
            alignment=align,
        )
        splits: dict[int, MatrixSplit | None] = {}
        if split is not None:
            flat = [i for group in groups for i in group]
            chosen = plan_splits(
                [ordered[i].shape for i in flat],
                [o for bucket in owners for o in bucket],
                dp_size=dp_size,
                cost=owner_cost,
                policy=split,
            )
            splits = dict(zip(flat, chosen))
    else:
        groups = _group_into_buckets(ordered, bucket_numel)

    slots: list[ParamSlot] = []
    buckets: list[BucketSlot] = []
    cursor = 0
    for b, group in enumerate(groups):
        bucket_start = cursor
        if mode is Mode.LAYERWISE:
            per_rank: list[list[int]] = [[] for _ in range(dp_size)]
            for i, owner in zip(group, owners[b]):
                per_rank[owner].append(i)
            used = [sum(round_up(ordered[i].numel, align) for i in m) for m in per_rank]
            shard = round_up(max(max(used), 1), shard_align)
            for rank, members in enumerate(per_rank):
                pos = bucket_start + rank * shard
                for i in members:
                    s = ordered[i]
                    cost = float(owner_cost(s.shape))
                    slots.append(
                        ParamSlot(
                            s.name,
                            s.shape,
                            order[i],
                            pos,
                            pos + s.numel,
                            b,
                            rank,
                            cost,
                            splits.get(i),
                        )
                    )
                    pos = round_up(pos + s.numel, align)
            cursor = bucket_start + dp_size * shard
        else:
            for i in group:
                s = ordered[i]
                cursor = round_up(cursor, align)
                slots.append(
                    ParamSlot(s.name, s.shape, order[i], cursor, cursor + s.numel, b, None)
                )
                cursor += s.numel
            multiple = dp_size * shard_align if mode is Mode.SHARDED else align
            if mode is Mode.REPLICATED and any(r.shard_divisible for r in requirements):
                multiple = math.lcm(align, dp_size)  # a consumer splits buckets into dp_size slices
            cursor = bucket_start + round_up(cursor - bucket_start, multiple)
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
        gather_dtype=gather_dtype,
    )
    validate(layout, requirements)
    return layout
