"""Owner assignment for layerwise mode: who steps which whole matrix.

Pure functions, no torch. A whole-tensor optimizer such as Muon costs each rank the
Newton–Schulz work of the matrices it owns, so owners are chosen to balance that cost
while every rank's shard stays close to the same number of elements (padding is the gap
between a rank's elements and the largest rank's).
"""
from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["newton_schulz_cost", "assign_owners"]


def newton_schulz_cost(shape: Sequence[int]) -> float:
    """Estimated flops-proportional cost of orthogonalising a param of ``shape``.

    One Newton–Schulz iteration on an m×n matrix costs O(max(m,n)·min(m,n)²) (the Gram
    matrix and its products are min×min). Params that are not 2-D are not orthogonalised by
    Muon; they count their numel so that they still spread across ranks.
    """
    if len(shape) == 2:
        m, n = shape
        return float(max(m, n) * min(m, n) ** 2)
    return float(math.prod(shape))


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def assign_owners(
    buckets: Sequence[Sequence[Sequence[int]]],
    *,
    dp_size: int,
    alignment: int = 1,
    numel_slack: float = 0.005,
) -> list[list[int]]:
    """Owner rank of each param of each bucket (``buckets[b][i]`` is a shape).

    Greedy longest-processing-time: within a bucket, params in decreasing cost go to the rank
    with the least total cost so far (across all buckets, so small buckets don't pile onto
    rank 0), among ranks whose shard in this bucket stays under a numel cap of
    ``max(largest param, (1 + numel_slack) · bucket numel / dp_size)``; if no rank fits, the
    rank with the fewest elements in this bucket. Ties break on the lower rank, so the result
    is deterministic.
    """
    if dp_size < 1:
        raise ValueError(f"dp_size must be >= 1, got {dp_size}")
    totals = [0.0] * dp_size
    result: list[list[int]] = []
    for shapes in buckets:
        sizes = [_round_up(math.prod(s), alignment) for s in shapes]
        costs = [newton_schulz_cost(s) for s in shapes]
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
        result.append(owners)
    return result
