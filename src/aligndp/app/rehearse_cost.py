"""A rehearsal's models: communication time, analytical memory, Newton–Schulz on the device.

[Note: communication model]
A collective of ``S`` bytes over ``n`` ranks costs ``latency · ceil(log2 n) + traffic / bw``,
where ``traffic`` is the ring's bytes per rank (nccl-tests' "bus bytes"): ``2(n-1)/n · S`` for
an all-reduce, ``(n-1)/n · S`` for a reduce-scatter or all-gather (``S`` the whole buffer), and
``S`` for a broadcast, scatter or gather; ``bw`` and ``latency`` are those of the group's
slowest link: within a node when every rank of the group sits in one node of
``ranks_per_node`` consecutive ranks, else across nodes. The latency term is a tree's depth
(NCCL switches to trees and hierarchical rings at scale), so it stays finite at 1,024 ranks.

Defaults (every one printed and overridable): within an H100/H200 node over NVLink 4,
NCCL's all-reduce bus bandwidth is about 480 GB/s at 8 GPUs for buffers of 1 GB and more
(NVIDIA's nccl-tests figures for DGX H100; the project measured 283 GB/s at 132 MB on 2 H200
on 2026-11-30, benchmarks/results/run_all_2gpu_2026-11-30c/run_all.md, where 2 ranks use
fewer NVLink lanes and a smaller buffer): we use 360 GB/s and 10 µs. Across nodes, one
400 Gb/s InfiniBand NDR link per GPU gives at most 50 GB/s; NCCL reaches about 40-45 GB/s of
bus bandwidth: we use 40 GB/s and 25 µs.

Predicted step time: without overlap, compute (forward + backward + optimizer) plus every
collective's time; with overlap, the collectives launched in backward hide under the backward
compute (as far as it lasts) and the rest are added.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Iterable, Sequence

import torch

from aligndp.plan.slots import BufferLayout
from aligndp.plan.spec import Mode

__all__ = [
    "CommModel",
    "Link",
    "collective_seconds",
    "analytic_bytes",
    "predicted_step",
    "ns_part_seconds",
    "rank_ns_parts",
    "rank_ns_seconds",
]


@dataclasses.dataclass(frozen=True)
class Link:
    """One link class of the communication model."""

    gbps: float
    """Bus bandwidth in GB/s (1e9 bytes per second), as nccl-tests reports busbw."""
    latency_us: float
    """Latency of one step of a collective, in microseconds."""

    def __post_init__(self) -> None:
        if not (self.gbps > 0 and self.latency_us >= 0):
            raise ValueError(
                f"a link needs bandwidth > 0 GB/s and latency >= 0 us, got {self.gbps} GB/s, "
                f"{self.latency_us} us"
            )

    @classmethod
    def parse(cls, text: str, *, flag: str) -> Link:
        """``"360,10"`` -> Link(360 GB/s, 10 us)."""
        try:
            gbps, latency = (float(x) for x in text.split(","))
        except ValueError:
            raise ValueError(
                f"{flag} {text!r}: write GBPS,LATENCY_US, e.g. {flag} 360,10"
            ) from None
        return cls(gbps, latency)


@dataclasses.dataclass(frozen=True)
class CommModel:
    """Bandwidth and latency per link class ([Note: communication model])."""

    intra: Link = Link(360.0, 10.0)
    """Within a node: NVLink 4 (H100/H200)."""
    inter: Link = Link(40.0, 25.0)
    """Across nodes: 400 Gb/s InfiniBand NDR, one link per GPU."""
    ranks_per_node: int = 8
    """GPUs per node; a node holds consecutive ranks."""

    def __post_init__(self) -> None:
        if self.ranks_per_node < 1:
            raise ValueError(f"--ranks-per-node must be >= 1, got {self.ranks_per_node}")

    def link(self, ranks: Sequence[int]) -> Link:
        nodes = {r // self.ranks_per_node for r in ranks}
        return self.intra if len(nodes) <= 1 else self.inter

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


_TRAFFIC = {"all_reduce": lambda n: 2 * (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n}
_TRAFFIC["all_gather"] = _TRAFFIC["reduce_scatter"]


def collective_seconds(kind: str, ranks: Sequence[int], nbytes: int, model: CommModel) -> float:
    """Modelled time of one collective ([Note: communication model]); 0 for a group of one."""
    n = len(ranks)
    if n <= 1:
        return 0.0
    link = model.link(ranks)
    traffic = _TRAFFIC.get(kind, lambda n: 1.0)(n) * nbytes
    return link.latency_us * 1e-6 * math.ceil(math.log2(n)) + traffic / (link.gbps * 1e9)


def predicted_step(
    compute: dict[str, float], collectives: Iterable, model: CommModel
) -> dict[str, float]:
    """Step seconds at D with and without overlap, and the communication alone."""
    by_phase: dict[str, float] = {}
    for c in collectives:
        t = collective_seconds(c.kind, c.ranks, c.bytes, model)
        by_phase[c.phase] = by_phase.get(c.phase, 0.0) + t
    comm = sum(by_phase.values())
    work = compute["forward"] + compute["backward"] + compute["optimizer"]
    hidden = min(by_phase.get("backward", 0.0), compute["backward"])
    return {"comm_s": comm, "no_overlap_s": work + comm, "overlap_s": work + comm - hidden}


def analytic_bytes(layouts: Sequence[BufferLayout], rank: int, *, state_per_element: int) -> dict:
    """What a rank holds by the plan: params (a sharded or layer-wise buffer whole, padding
    included; replicated params as the module holds them), grads (every buffer whole), and per
    owned element an fp32 master (16-bit params in sharded modes) and ``state_per_element``
    fp32 optimizer values (AdamW 2, Muon 1); replicated buffers hold state for every element."""
    params = grads = masters = state = 0
    for lo in layouts:
        held = lo.numel if lo.mode is Mode.REPLICATED else lo.padded_numel  # no param buffer
        params += held * lo.param_dtype.itemsize
        grads += lo.padded_numel * lo.grad_dtype.itemsize
        if lo.mode is Mode.REPLICATED:
            owned = sum(p.numel for p in lo.params)
        else:
            owned = sum(piece.numel for piece in lo.owned_pieces(rank))
            if lo.param_dtype.itemsize < 4:
                masters += owned * 4
        state += owned * 4 * state_per_element
    return {"params": params, "grads": grads, "masters": masters, "optimizer_state": state}


_NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # torch.optim.Muon's quintic (a, b, c)


def ns_part_seconds(
    m: int, cols: int, rows: int, *, device: torch.device, ns_steps: int = 5, repeats: int = 3
) -> float:
    """Measured seconds of one rank's part of a Newton–Schulz orthogonalisation on ``device``:
    ``cols`` columns of an m-row bf16 matrix (its wide orientation) and ``rows`` rows of
    ``B``: ``ns_steps`` times one iteration of the split step's three GEMMs
    (aligndp/optim/split_ns.py), a whole matrix being the part with every column and row;
    communication is not in it. On a GPU the ``ns_steps`` iterations are launched back to back
    between two synchronisations, as the step launches them (a synchronisation per iteration
    would add its latency to every part), after one warm-up, and the median of ``repeats``
    timings is kept; on a CPU, where nothing runs ahead, one iteration is timed and
    multiplied, and the fastest of ``repeats`` is kept (other work on the cores only adds
    time: the median of three read up to 4x apart on a busy 2-core machine)."""
    from aligndp.optim.split_ns import NS_DTYPE, apply_b, b_rows, gram_part

    a, b, c = _NS_COEFFICIENTS
    x = torch.randn(m, cols, device=device, dtype=NS_DTYPE) / math.sqrt(m * cols)
    full_b = torch.randn(m, m, device=device, dtype=NS_DTYPE) / m

    def run() -> None:
        gram = gram_part(x).to(NS_DTYPE)
        b_rows(gram, 0, rows, b, c)
        apply_b(x, full_b, a)

    chained = device.type == "cuda"  # a GPU's first launch compiles and allocates; a CPU's not
    times = []
    for i in range(repeats + chained):
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(ns_steps if chained else 1):
            run()
        _sync(device)
        if i or not chained:
            times.append(time.perf_counter() - t0)
    if chained:
        return statistics.median(times)
    return min(times) * ns_steps


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def rank_ns_parts(layout: BufferLayout) -> list[list[tuple[int, int, int]]]:
    """Per rank, its Newton–Schulz parts ``(m, cols, rows)`` of a layer-wise buffer: whole
    2-D matrices it owns, and its part of each split one."""
    parts: list[list[tuple[int, int, int]]] = [[] for _ in range(layout.dp_size)]
    for p in layout.params:
        if p.owner is None or len(p.shape) != 2:
            continue
        m, n = min(p.shape), max(p.shape)
        if p.split is None:
            parts[p.owner].append((m, n, m))
            continue
        s = p.split
        for j, rank in enumerate(s.ranks):
            parts[rank].append((m, s.cols[j + 1] - s.cols[j], s.rows[j + 1] - s.rows[j]))
    return parts


def rank_ns_seconds(
    layout: BufferLayout, *, device: torch.device, ns_steps: int = 5, repeats: int = 3
) -> list[float]:
    """Measured Newton–Schulz seconds of every rank of a layer-wise buffer: each distinct part
    shape timed once on ``device`` (:func:`ns_part_seconds`), summed over each rank's parts."""
    cache: dict[tuple[int, int, int], float] = {}
    out = []
    for mine in rank_ns_parts(layout):
        total = 0.0
        for part in mine:
            if part not in cache:
                cache[part] = ns_part_seconds(
                    *part, device=device, ns_steps=ns_steps, repeats=repeats
                )
            total += cache[part]
        out.append(total)
    return out
