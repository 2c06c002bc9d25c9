"""Owner assignment for layerwise mode: who steps which whole matrix.

Pure functions, no torch. A whole-tensor optimizer costs each rank the work of the params it
owns — ``cost(shape)``, a field of the plan request (Muon's Newton–Schulz estimate lives with
Muon, aligndp/optim/muon.py) — so owners are chosen to balance that cost while every rank's
shard stays close to the same number of elements (padding is the gap between a rank's
elements and the largest rank's).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from aligndp.plan.spec import OwnerCost, round_up

__all__ = ["assign_owners", "group_layerwise_buckets"]


def assign_owners(
    buckets: Sequence[Sequence[Sequence[int]]],
    *,
    dp_size: int,
    cost: OwnerCost,
    alignment: int = 1,
    numel_slack: float = 0.005,
) -> list[list[int]]:
    """Owner rank of each param of each bucket (``buckets[b][i]`` is a shape).

    Greedy longest-processing-time: within a bucket, params in decreasing ``cost(shape)`` go to
    the rank with the least total cost so far (across all buckets, so small buckets don't pile
    onto rank 0), among ranks whose shard in this bucket stays under a numel cap of
    ``max(largest param, (1 + numel_slack) · bucket numel / dp_size)``; if no rank fits, the
    rank with the fewest elements in this bucket. Ties break on the lower rank, so the result
    is deterministic.
    """
    if dp_size < 1:
        raise ValueError(f"dp_size must be >= 1, got {dp_size}")
    totals = [0.0] * dp_size
    result: list[list[int]] = []
    for shapes in buckets:
        owners, _, totals = _assign_bucket(
            shapes, totals, cost=cost, alignment=alignment, numel_slack=numel_slack
        )
        result.append(owners)
    return result


def _assign_bucket(
    shapes: Sequence[Sequence[int]],
    totals: Sequence[float],
    *,
    cost: OwnerCost,
    alignment: int,
    numel_slack: float,
) -> tuple[list[int], list[int], list[float]]:
    """One bucket of :func:`assign_owners`: (owners, aligned elements per rank, new cost totals)."""
    dp_size = len(totals)
    totals = list(totals)
    sizes = [round_up(math.prod(s), alignment) for s in shapes]
    costs = [float(cost(tuple(s))) for s in shapes]
    cap = max(max(sizes, default=0), math.ceil((1 + numel_slack) * sum(sizes) / dp_size))
    used = [0] * dp_size
    owners = [0] * len(shapes)
    for i in sorted(range(len(shapes)), key=lambda i: (-costs[i], -sizes[i], i)):
        fits = [r for r in range(dp_size) if used[r] + sizes[i] <= cap]
        if fits:
            rank = min(fits, key=lambda r: (totals[r], used[r], r))
        else:
            rank = min(range(dp_size), key=lambda r: (used[r], totals[r], r))
        owners[i] = rank
        used[rank] += sizes[i]
        totals[rank] += costs[i]
    return owners, used, totals


def group_layerwise_buckets(
    shapes: Sequence[Sequence[int]],
    *,
    dp_size: int,
    bucket_numel: int | None,
    cost: OwnerCost,
    alignment: int = 1,
    shard_alignment: int = 1,
    max_padding: float = 0.005,
    numel_slack: float = 0.005,
) -> list[list[int]]:
    """Indices of ``shapes`` (layout order) grouped into layerwise buckets.

    Why not close a bucket as soon as it holds ``bucket_numel`` elements: a layerwise bucket is
    cut into ``dp_size`` equal shards that each hold whole params, so a bucket of a few layers'
    matrices pads every shard up to the largest (GPT hidden matrices at dp_size 8 and 40 M
    buckets: 25-29% padding). A bucket therefore closes at the first param where it holds at
    least ``bucket_numel`` elements and ``dp_size`` params *and* :func:`assign_owners` packs it
    with at most ``max_padding`` of its padded elements as padding. While the last bucket packs
    worse than that, it is merged into the one before if that lowers the total padding (so
    large embeddings may end up sharing one bucket with much of the model). Deterministic.
    """
    if bucket_numel is None or not shapes:
        return [list(range(len(shapes)))]
    numels = [math.prod(s) for s in shapes]

    def padded(start: int, end: int, totals: list[float]) -> tuple[int, list[float]]:
        _, used, totals = _assign_bucket(
            shapes[start:end], totals, cost=cost, alignment=alignment, numel_slack=numel_slack
        )
        return dp_size * round_up(max(used), shard_alignment), totals

    bounds: list[tuple[int, int]] = []
    history = [[0.0] * dp_size]  # cost totals before each bucket
    start = filled = 0
    for end in range(1, len(shapes) + 1):
        filled += numels[end - 1]
        if filled < bucket_numel or end - start < dp_size:
            continue
        size, totals = padded(start, end, history[-1])
        if size - filled <= max_padding * size:
            bounds.append((start, end))
            history.append(totals)
            start, filled = end, 0
    if start < len(shapes):
        bounds.append((start, len(shapes)))
        history.append(padded(start, len(shapes), history[-1])[1])
    while len(bounds) > 1:
        (a, b), (_, c) = bounds[-2], bounds[-1]
        last, _ = padded(b, c, history[-2])
        if last - sum(numels[b:c]) <= max_padding * last:
            break
        merged, totals = padded(a, c, history[-3])
        if merged >= padded(a, b, history[-3])[0] + last:
            break
        bounds[-2:] = [(a, c)]
        history[-2:] = [totals]
    return [list(range(a, b)) for a, b in bounds]
