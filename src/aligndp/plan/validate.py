"""``validate(layout, requirements)``: re-check a planned layout, with messages that name the
param, its offset in elements and bytes, the rule and the fix. See [Note: alignment contract]
in DESIGN.md; buffers call it at construction, so no mode can skip it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from aligndp.plan.slots import BufferLayout, ParamSlot
from aligndp.plan.spec import Mode, Requirement

__all__ = ["validate"]


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
    itemsizes = layout.itemsizes
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
                    f"plan the layout with start_alignment={align} (or pass the requirement to "
                    "plan_layout)",
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
                    f"straddles shards {shard} and {(p.end - 1 - b.start) // size} of bucket "
                    f"{p.bucket} (shard size {size})",
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
