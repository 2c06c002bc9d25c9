"""Split Newton–Schulz: which layer-wise matrices are orthogonalised by a group of ranks.

[Note: split Newton–Schulz]
With whole matrices per owner the largest matrices set the pace once ranks outnumber them
(gpt2-small's 768x3072 MLP matrices at 64 ranks: imbalance 1.78). One Newton–Schulz iteration
on ``X`` (m x n in its wide orientation, m <= n, as torch transposes) is ``A = X Xᵀ``,
``B = bA + cA²``, ``X <- aX + BX``: the two m²n products split by columns (``X = [X_1 .. X_k]``,
``A = Σ_j X_j X_jᵀ``, one all-reduce of the m x m Gram in the group, then ``X_j <- aX_j + BX_j``
locally) and the m³ product ``A·A`` by rows of ``B`` (rank j computes its rows, one all-gather).
So part j costs ``m²·(2·n_j + r_j)`` for ``n_j`` columns and ``r_j`` rows, and the parts of a
matrix add up to its whole flops ``m²·(2n + m)``: splitting adds communication and, on a
device, each part's fixed cost (launches, small GEMMs), no flops. The policy's cost model
says what a part costs: Muon's default is a device's ``fixed + madds · s_per_madd`` seconds
([Note: Newton–Schulz device cost] in optim/ns_cost.py), so a matrix cut in k parts pays the
fixed cost k times and is cut only where that still lowers the most loaded rank; the flops
model alone (``FLOPS_SPLIT``) is kept for hand-worked plans. Communication is not in it. The
owner keeps the gradient, the momentum and the param whole in its shard (the layer-wise buffer
layout does not change); the others only lend their Newton–Schulz time. Muon's maths is
unchanged: one matrix is still orthogonalised as one matrix.

:func:`plan_splits` chooses, after owners are assigned, greedily: while the ranks' cost
max/mean is above :attr:`SplitPolicy.target`, the matrix with the largest share on the most
loaded rank is re-cut into the fewest more parts (owner keeps part 0, the other parts go to the
least loaded ranks holding no part of it) that leave every touched rank under the old
maximum; it stops when the target is met or no cut helps. Pure: plain numbers in, frozen data out.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

from aligndp.plan.spec import OwnerCost, max_over_mean

__all__ = ["MatrixSplit", "PartCost", "SplitPolicy", "plan_splits", "split_bounds", "wide"]

PartCost = Callable[[tuple[int, ...], int, int], float]
"""``cost(shape, cols, rows)`` of one part of a split matrix: ``cols`` columns of its wide
orientation and ``rows`` rows of ``B = bA + cA²``."""


@dataclasses.dataclass(frozen=True)
class SplitPolicy:
    """When the layer-wise planner splits one matrix's Newton–Schulz over several ranks."""

    part_cost: PartCost
    """Cost of one part (Muon: ``NewtonSchulzCost.part_cost`` in aligndp/optim/ns_cost.py);
    a matrix's parts add up to its whole cost plus what splitting adds (a fixed cost per
    part), never less."""
    target: float = 1.05
    """Splitting stops once the buffer's rank cost max/mean is at most this."""
    budget: float | None = None
    """A matrix costing more than this is split into parts of at most this (as far as the
    limits below allow), before balancing; None: only what balance needs."""
    min_cols: int = 128
    """Fewest columns (wide orientation) of one part: narrower GEMMs waste the device."""
    col_multiple: int = 128
    """Part widths are multiples of this where the matrix is wide enough."""
    min_part_cost: float = 2.0**24
    """Fewest cost units of one part: below it a part's collectives outweigh its flops (a
    device's policy: 2 fixed costs, ``NewtonSchulzCost.min_part_cost``)."""
    max_parts: int = 8
    """Most ranks one matrix is split over."""
    cost: OwnerCost | None = None
    """Cost of a whole param in ``part_cost``'s units (a 2-D matrix: its part with every
    column and row); the layer-wise planner then balances owners by it too (plan_layout).
    None: the request's owner cost, which must then be in ``part_cost``'s units."""

    def __post_init__(self) -> None:
        if not callable(self.part_cost):
            raise TypeError(f"part_cost must be a function, got {self.part_cost!r}")
        if self.target < 1.0:
            raise ValueError(f"target is a max/mean imbalance, >= 1.0; got {self.target}")
        for field in ("min_cols", "col_multiple", "max_parts"):
            value = getattr(self, field)
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"SplitPolicy.{field} must be an int >= 1, got {value!r}")
        if self.cost is not None and not callable(self.cost):
            raise TypeError(f"cost must be a function shape -> float or None, got {self.cost!r}")
        if self.budget is not None and self.budget <= 0:
            raise ValueError(f"budget must be > 0 or None, got {self.budget}")


@dataclasses.dataclass(frozen=True)
class MatrixSplit:
    """One matrix orthogonalised by ``len(ranks)`` ranks; part j is ``ranks[j]``'s."""

    ranks: tuple[int, ...]
    """Ranks of the group, the owner first; all different."""
    cols: tuple[int, ...]
    """``k + 1`` increasing bounds from 0 to n: part j has columns ``[cols[j], cols[j+1])`` of
    the matrix in its wide orientation (m <= n)."""
    rows: tuple[int, ...]
    """``k + 1`` non-decreasing bounds from 0 to m: part j computes these rows of ``B``."""
    costs: tuple[float, ...]
    """Cost of each part (the policy's ``part_cost``)."""

    def part_of(self, rank: int) -> int | None:
        """Index of ``rank``'s part, None if it has none."""
        return self.ranks.index(rank) if rank in self.ranks else None

    def __str__(self) -> str:
        widths = [b - a for a, b in zip(self.cols, self.cols[1:])]
        return " ".join(f"{r}:{w}" for r, w in zip(self.ranks, widths))


def wide(shape: Sequence[int]) -> tuple[int, int]:
    """``(m, n)`` of a 2-D shape in its wide orientation (m <= n)."""
    a, b = shape
    return min(a, b), max(a, b)


def split_bounds(shape: Sequence[int], k: int, policy: SplitPolicy) -> tuple[tuple[int, ...], ...]:
    """``(cols, rows)`` bounds of ``k`` parts (:class:`MatrixSplit`): widths multiples of
    ``policy.col_multiple`` where n allows (the last part takes the rest), otherwise as equal as
    can be; rows chosen so that ``2·n_j + r_j`` (a part's work) is as equal as can be."""
    m, n = wide(shape)
    q = policy.col_multiple if n >= k * policy.col_multiple else 1
    base, rem = divmod(n // q, k)
    widths = [(base + (j < rem)) * q for j in range(k)]
    widths[-1] += n - sum(widths)
    ideal = [max(0.0, (2 * n + m) / k - 2 * w) for w in widths]
    total = sum(ideal)
    ideal = [x * m / total for x in ideal] if total > 0 else [m / k] * k
    rows = [math.floor(x) for x in ideal]
    by_fraction = sorted(range(k), key=lambda j: (rows[j] - ideal[j], j))
    for j in by_fraction[: m - sum(rows)]:
        rows[j] += 1
    return _bounds(widths), _bounds(rows)


def _by_share(shares: list[tuple[float, int]]) -> list[int]:
    """Matrix indices by their share on a rank, largest first (ties: lower index)."""
    return [i for _, i in sorted(shares, key=lambda t: (-t[0], t[1]))]


def _bounds(sizes: Sequence[int]) -> tuple[int, ...]:
    out = [0]
    for s in sizes:
        out.append(out[-1] + s)
    return tuple(out)


def plan_splits(
    shapes: Sequence[Sequence[int]],
    owners: Sequence[int],
    *,
    dp_size: int,
    cost: OwnerCost,
    policy: SplitPolicy,
) -> list[MatrixSplit | None]:
    """The split of each matrix (None: its owner orthogonalises it alone), as the module's
    docstring says; ``owners[i]`` owns ``shapes[i]``; whole params cost ``policy.cost`` (None:
    ``cost``). Deterministic."""
    cost = policy.cost if policy.cost is not None else cost
    whole = [float(cost(tuple(s))) for s in shapes]
    groups: list[tuple[tuple[int, ...], tuple[float, ...]]] = [
        ((o,), (c,)) for o, c in zip(owners, whole)
    ]
    loads = [0.0] * dp_size
    for o, c in zip(owners, whole):
        loads[o] += c

    limits: dict[int, int] = {}

    def limit(i: int) -> int:
        """Most parts of matrix i: each part at least ``min_cols`` wide and costing at least
        ``min_part_cost`` (a k-th of its columns and rows; with a fixed cost per part that
        is more than a k-th of the whole)."""
        if i in limits:
            return limits[i]
        if len(shapes[i]) != 2:
            return 1
        m, n = wide(shapes[i])
        k = max(1, min(policy.max_parts, dp_size, m, n // policy.min_cols))
        shape = tuple(shapes[i])
        while k > 1 and policy.part_cost(shape, n / k, m / k) < policy.min_part_cost:
            k -= 1
        limits[i] = k
        return k

    def recut(i: int, k: int) -> tuple[tuple[int, ...], tuple[float, ...], list[float]]:
        new = list(loads)
        for r, c in zip(*groups[i]):
            new[r] -= c
        cols, rows = split_bounds(shapes[i], k, policy)
        costs = tuple(
            float(policy.part_cost(tuple(shapes[i]), cols[j + 1] - cols[j], rows[j + 1] - rows[j]))
            for j in range(k)
        )
        ranks = [owners[i]]
        new[owners[i]] += costs[0]
        for c in costs[1:]:
            r = min((r for r in range(dp_size) if r not in ranks), key=lambda r: (new[r], r))
            ranks.append(r)
            new[r] += c
        return tuple(ranks), costs, new

    def _first_better(i: int, ks: range, ceiling: float):
        """The cut of matrix i into the fewest parts in ``ks`` that leaves every rank it
        touches under ``ceiling`` (None if no such cut)."""
        for k in ks:
            if k > limit(i):
                break
            ranks, costs, new = recut(i, k)
            if max(new[r] for r in set(ranks) | set(groups[i][0])) < ceiling * (1 - 1e-12):
                return ranks, costs, new
        return None

    if policy.budget is not None:
        for i in sorted(range(len(shapes)), key=lambda i: (-whole[i], i)):
            k = 1
            while k < limit(i) and whole[i] / k > policy.budget:
                k += 1
            if k > 1:
                *groups[i], loads = recut(i, k)
    while max_over_mean(loads) > policy.target:
        top = max(range(dp_size), key=lambda r: (loads[r], -r))
        on_top = [(c, i) for i, g in enumerate(groups) for r, c in zip(*g) if r == top]
        # one more part for any matrix on the top rank first; more parts only if none helps
        now = {i: len(groups[i][0]) for i in _by_share(on_top)}
        tries = [(i, range(k + 1, k + 2)) for i, k in now.items()]
        tries += [(i, range(k + 2, limit(i) + 1)) for i, k in now.items()]
        for i, ks in tries:
            cut = _first_better(i, ks, loads[top])
            if cut is not None:
                groups[i], loads = cut[:2], cut[2]
                break
        else:
            break
    result: list[MatrixSplit | None] = []
    for i, (ranks, costs) in enumerate(groups):
        if len(ranks) == 1:
            result.append(None)
            continue
        cols, rows = split_bounds(shapes[i], len(ranks), policy)
        result.append(MatrixSplit(ranks, cols, rows, costs))
    return result
