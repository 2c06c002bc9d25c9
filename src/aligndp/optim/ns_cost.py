"""What one Newton–Schulz part costs on a device: a fixed cost per part plus its flops.

[Note: Newton–Schulz device cost]
The flops model (``m²·(2·cols + rows)`` multiply-adds per iteration, optim/muon.py) balanced
1b at D = 64 to 1.036 on paper; one H200 measured 1.680 (benchmarks/results/
rehearse_2026-12-03.md): at D = 64 a rank's share is a few ms of small GEMMs, and each part
pays for its kernel launches, casts and the small GEMMs' low rate whatever its size. So the
time of one part is ``iterations · (fixed_s + madds · s_per_madd)``: a matrix cut into k
parts pays the fixed cost k times, and splitting stops where it no longer pays.
:meth:`NewtonSchulzCost.policy` turns a device's figures into the split planner's
:class:`~aligndp.plan.split.SplitPolicy` (costs in seconds of one iteration, owners balanced
in the same units, a part worth at least :data:`PART_OVER_FIXED` fixed costs);
``benchmarks/ns_calibrate.py`` measures a device and fits the two figures
(:func:`fit_ns_cost`). :data:`FLOPS_NS_COST` is the flops model itself (one unit per
multiply-add, no fixed cost), kept for hand-worked plans.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence

from aligndp.plan.split import SplitPolicy, wide

__all__ = [
    "CPU_NS_COST",
    "FLOPS_NS_COST",
    "FLOPS_SPLIT",
    "H200_NS_COST",
    "PART_OVER_FIXED",
    "NewtonSchulzCost",
    "fit_ns_cost",
    "ns_cost_for",
    "part_madds",
]

PART_OVER_FIXED = 2.0
"""A split part must cost at least this many fixed costs: below it the part's launches (and
its collectives, not in the model) outweigh the flops it takes off the owner."""


def part_madds(m: int, cols: int, rows: int) -> float:
    """Multiply-adds of one iteration of a part: ``cols`` columns of an m-row matrix (wide
    orientation) in ``X Xᵀ`` and ``B X`` (m²·cols each) and ``rows`` rows of ``A·A``."""
    return float(m * m * (2 * cols + rows))


@dataclasses.dataclass(frozen=True)
class NewtonSchulzCost:
    """One device's Newton–Schulz time ([Note: Newton–Schulz device cost])."""

    fixed_s: float
    """Seconds one part pays per iteration whatever its size: kernel launches, casts, the
    small GEMMs' lost rate (0 in the flops model)."""
    s_per_madd: float
    """Seconds per multiply-add of the part's GEMMs (1 / the sustained bf16 rate in
    multiply-adds per second; 1.0 in the flops model, whose unit is one multiply-add)."""
    source: str
    """Where the two figures come from: the device, the command and date of the calibration,
    or that they are a guess."""

    def __post_init__(self) -> None:
        if not (self.fixed_s >= 0 and self.s_per_madd > 0):
            raise ValueError(
                f"a Newton-Schulz cost needs fixed_s >= 0 and s_per_madd > 0, got fixed_s="
                f"{self.fixed_s}, s_per_madd={self.s_per_madd}; fit them with "
                "benchmarks/ns_calibrate.py"
            )

    def seconds(self, m: int, cols: int, rows: int, iterations: int = 1) -> float:
        """Modelled seconds of one part (a whole matrix: every column and row)."""
        return iterations * (self.fixed_s + part_madds(m, cols, rows) * self.s_per_madd)

    def part_cost(self, shape: Sequence[int], cols: int, rows: int) -> float:
        """One iteration of a part of a matrix of ``shape`` (a ``PartCost``)."""
        m, _ = wide(shape)
        return self.seconds(m, cols, rows)

    def whole_cost(self, shape: Sequence[int]) -> float:
        """One iteration on a whole param of ``shape`` (an ``OwnerCost``); params that are
        not 2-D are not orthogonalised and count their numel as multiply-adds, so they still
        spread across ranks."""
        if len(shape) == 2:
            m, n = wide(shape)
            return self.seconds(m, n, m)
        return float(math.prod(shape)) * self.s_per_madd

    @property
    def min_part_cost(self) -> float:
        """Fewest cost units of one split part: :data:`PART_OVER_FIXED` fixed costs; the flops
        model, with no fixed cost, keeps its 2^24 multiply-adds."""
        return PART_OVER_FIXED * self.fixed_s if self.fixed_s > 0 else 2.0**24 * self.s_per_madd

    def policy(self, **overrides) -> SplitPolicy:
        """The split policy that plans with this cost: parts and whole params (owners too) in
        this cost's units, ``min_part_cost`` from the fixed cost; ``overrides`` are
        :class:`SplitPolicy` fields."""
        fields = dict(
            part_cost=self.part_cost, cost=self.whole_cost, min_part_cost=self.min_part_cost
        )
        return SplitPolicy(**{**fields, **overrides})


FLOPS_NS_COST = NewtonSchulzCost(0.0, 1.0, "flops only: one unit per multiply-add, no fixed cost")
"""The flops model: what the planner balanced before devices were measured; hand-worked plans
(tests) use it."""

FLOPS_SPLIT = FLOPS_NS_COST.policy(cost=None)
"""The flops model's split policy, owners balanced by the request's own cost (Muon's
``newton_schulz_cost``, the same multiply-adds)."""

CPU_NS_COST = NewtonSchulzCost(
    fixed_s=1.395e-03,
    s_per_madd=8.3147e-12,
    source="CPU (x86_64), bf16, OMP_NUM_THREADS=1, torch 2.13.0+cpu: benchmarks/"
    "ns_calibrate.py --device cpu, 2026-12-07, 46 part shapes of 1b/gpt2-small (fitted / "
    "measured 0.52-1.69; benchmarks/results/rehearse_ns_2026-12-07.md)",
)
"""The CPU the project's tests run on (an indication: its cores are shared)."""

H200_NS_COST = NewtonSchulzCost(
    fixed_s=3.0e-05,
    s_per_madd=2.0 / 650e12,
    source="an estimate: 30 us per part per iteration (about six kernel launches and "
    "casts) and 650 TFLOP/s bf16; measured on an H100 on 2026-12-07 it planned the best "
    "balance of three costs (1b at D = 64: 1.079 against 1.237 for the fitted figures; "
    "benchmarks/results/rehearse_ns_2026-12-07.md), so it stays until an H200 fit does better",
)
"""One H200 (the GPU the job is planned for by default)."""


def ns_cost_for(device: str) -> NewtonSchulzCost:
    """The default cost of a device type: ``cpu``, ``cuda`` (an H200's figures) or
    ``flops`` (the flops model)."""
    known = {"cpu": CPU_NS_COST, "cuda": H200_NS_COST, "flops": FLOPS_NS_COST}
    if device not in known:
        raise ValueError(f"no Newton-Schulz cost for {device!r}: choose one of {', '.join(known)}")
    return known[device]


def fit_ns_cost(
    samples: Iterable[tuple[float, float]], *, source: str, relative: bool = True
) -> NewtonSchulzCost:
    """Least-squares ``fixed_s`` and ``s_per_madd`` from ``(madds, seconds)`` of one iteration
    of parts of several sizes. ``relative``: each sample's error relative to its time (the
    small parts, which fix the fixed cost, weigh as much as the large ones). A negative
    intercept is refitted through zero (no fixed cost measurable)."""
    xs, ys = [], []
    for x, y in samples:
        xs.append(float(x))
        ys.append(float(y))
    if len(xs) < 2 or len(set(xs)) < 2:
        raise ValueError(f"fitting needs timings of at least 2 part sizes, got {len(set(xs))}")
    w = [1.0 / (y * y) if relative else 1.0 for y in ys]
    sw = sum(w)
    sx = sum(wi * x for wi, x in zip(w, xs))
    sy = sum(wi * y for wi, y in zip(w, ys))
    sxx = sum(wi * x * x for wi, x in zip(w, xs))
    sxy = sum(wi * x * y for wi, x, y in zip(w, xs, ys))
    det = sw * sxx - sx * sx
    slope = (sw * sxy - sx * sy) / det
    fixed = (sy - slope * sx) / sw
    if fixed < 0 or slope <= 0:
        fixed, slope = 0.0, sxy / sxx
    return NewtonSchulzCost(fixed_s=fixed, s_per_madd=slope, source=source)
