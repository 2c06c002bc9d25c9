"""`aligndp rehearse`: one process plays rank r of a D-rank job, on torch's fake process group.

[Note: rehearsal]
:func:`rehearse` initialises the fake backend as rank r of D ranks and runs the real job on
this device: the plan, the buffers, ``parallelize``'s wrapper and optimizer, forward,
backward and the optimizer step with their kernels; collectives are launched and counted
(:class:`~aligndp.app.rehearse_probe.StepProbe`), and move nothing. What aligndp decides from
other ranks' answers at wrap time is answered in one place
([Note: rehearsal on the fake process group] in runtime/fake_world.py).
:func:`~aligndp.app.rehearse_step.measure_step` is the part that runs on *any* process
group, so the tests run it on gloo at D = 2, 3, 4 and a 2 x 2 mesh and compare the
collectives and memory with the rehearsal's.

With ``ranks=None`` (``--rank all``) the plan is made once (on the meta device: it is pure)
and every rank gets its analytical memory and, for layer-wise optimizers, its Newton–Schulz
time, measured on the device once per distinct part shape
(:func:`~aligndp.app.rehearse_cost.rank_ns_seconds`); the full step runs on the device for a
sample of ranks only (rank 0; layer-wise: also the slowest and the fastest by Newton–Schulz,
up to ``sample``), and the others take the sampled rank 0's forward, backward and collectives, with
its optimizer time moved by their Newton–Schulz difference. The report says which ranks ran.
A rank whose analytical memory exceeds what the device holds is not run: it does not fit.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

import torch
import torch.distributed as dist

from aligndp.app.rehearse_cost import analytic_bytes, predicted_step, rank_ns_seconds
from aligndp.app.rehearse_probe import CollectiveRecord
from aligndp.app.rehearse_step import RehearsalOptions, StepMeasurement, measure_step
from aligndp.optim.registry import whole_matrix_spec
from aligndp.plan.request import plan_buffers
from aligndp.plan.spec import Mode, max_over_mean
from aligndp.runtime.fake_world import init_fake_world

__all__ = [
    "RehearsalOptions",
    "RankReport",
    "Rehearsal",
    "measure_step",
    "plan_layouts",
    "rehearse",
    "rehearse_rank",
]


@dataclasses.dataclass
class RankReport:
    """One rank of a rehearsal."""

    rank: int
    ran: bool
    """The step ran on the device for this rank (else: [Note: rehearsal]'s sampling)."""
    analytic: dict[str, int]
    """Bytes by the plan: params, grads, masters, optimizer_state."""
    fits: bool = True
    peak_allocated: int | None = None
    peak_reserved: int | None = None
    seconds: dict[str, float] = dataclasses.field(default_factory=dict)
    ns_seconds: float | None = None
    """Measured Newton–Schulz seconds of this rank's matrices and parts (layer-wise)."""
    collectives: list[CollectiveRecord] = dataclasses.field(default_factory=list)
    predicted: dict[str, float] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["collectives"] = [
            {**dataclasses.asdict(c), "ranks": [c.ranks[0], c.ranks[-1], len(c.ranks)]}
            for c in self.collectives
        ]
        return out


@dataclasses.dataclass
class Rehearsal:
    """The result of :func:`rehearse`."""

    options: RehearsalOptions
    ranks: list[RankReport]
    sampled: str
    """How the step's compute was sampled (which ranks ran it)."""
    ns_max_over_mean: float | None = None
    """Layer-wise, every rank: max / mean of the measured Newton–Schulz seconds."""

    def to_dict(self) -> dict:
        opts = dataclasses.asdict(self.options)
        return {
            "options": opts,
            "sampled": self.sampled,
            "ns_max_over_mean": self.ns_max_over_mean,
            "ranks": [r.to_dict() for r in self.ranks],
        }


def plan_layouts(options: RehearsalOptions) -> list:
    """The run's plan, made from the preset on the meta device (what ``parallelize`` plans)."""
    from aligndp.parallelize import plan_request

    kwargs = options.parallelize_kwargs()
    request, _ = plan_request(
        options.model("meta"),
        optimizer=kwargs["optimizer"],
        sharding=kwargs["sharding"],
        dp_size=options.dp_size // options.replicas,
        bucket_numel=kwargs.get("bucket_numel", plan_request.__kwdefaults__["bucket_numel"]),
        wgrad=kwargs["wgrad"],
        fp8_param_gather=options.fp8_param_gather,
        split=kwargs.get("split"),
    )
    return plan_buffers(request)


def _device_bytes(device: str) -> int:
    if device == "cuda":
        free, _ = torch.cuda.mem_get_info()
        return free
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def rehearse_rank(options: RehearsalOptions, rank: int) -> StepMeasurement:
    """Run ``options``' step as ``rank`` on the fake process group (made and destroyed here)."""
    if dist.is_initialized():
        raise ValueError(
            "rehearse() makes its own fake process group: call it where torch.distributed is "
            "not initialised"
        )
    init_fake_world(rank, options.dp_size)
    try:
        return measure_step(options)
    finally:
        dist.destroy_process_group()


def rehearse(options: RehearsalOptions) -> Rehearsal:
    """Rehearse ``options.ranks`` (None: every rank) of the job ([Note: rehearsal])."""
    layouts = plan_layouts(options)
    shard = options.dp_size // options.replicas
    all_ranks = list(range(options.dp_size)) if options.ranks is None else list(options.ranks)
    state = 1 if whole_matrix_spec(options.optimizer) is not None else 2
    if options.optimizer == "sgd":
        state = 0
    ns = _ns_by_shard_rank(options, layouts)

    def ns_of(rank: int) -> float | None:
        return ns[rank % shard] if ns else None

    reports = {
        r: RankReport(
            rank=r,
            ran=False,
            analytic=analytic_bytes(layouts, r % shard, state_per_element=state),
            ns_seconds=ns_of(r),
        )
        for r in all_ranks
    }
    room = _device_bytes(options.device)
    for report in reports.values():
        report.fits = sum(report.analytic.values()) <= room
    run = _sample(all_ranks, ns_of, options.sample) if options.ranks is None else all_ranks
    for r in run:
        report = reports[r]
        if not report.fits:
            continue
        got = rehearse_rank(options, r)
        report.ran = True
        report.peak_allocated, report.peak_reserved = got.peak_allocated, got.peak_reserved
        report.seconds, report.collectives = got.seconds, got.collectives
    base = next((reports[r] for r in run if reports[r].ran), None)
    for report in reports.values():
        if not report.ran and base is not None and report.fits:
            report.seconds = dict(base.seconds)
            if report.ns_seconds is not None and base.ns_seconds is not None:
                report.seconds["optimizer"] += report.ns_seconds - base.ns_seconds
            report.collectives = base.collectives
        if report.seconds:
            report.predicted = predicted_step(report.seconds, report.collectives, options.comm)
    ran = [r for r in run if reports[r].ran]
    if options.ranks is None and not run:
        how = "--sample 0: the plan and the Newton-Schulz timings only, no step was run"
    elif options.ranks is None and base is None:
        how = f"no sampled rank's plan fits in {options.device}'s free memory: the step was not run"
    elif options.ranks is None:
        how = (
            f"step ran on {options.device} for rank(s) {ran} of {options.dp_size}; the others "
            f"take rank {base.rank if base else '-'}'s forward, backward and collectives"
            + (", their optimizer time moved by their measured Newton-Schulz" if ns else "")
        )
    else:
        how = f"step ran on {options.device} for every rank asked: {ran}"
    skipped = [r for r in run if not reports[r].fits]
    if skipped:
        how += f"; rank(s) {skipped} not run: the plan needs more than the device's free memory"
    ratio = max_over_mean([ns_of(r) for r in all_ranks]) if ns and options.ranks is None else None
    return Rehearsal(options, [reports[r] for r in all_ranks], how, ratio)


def _ns_by_shard_rank(options: RehearsalOptions, layouts: Sequence) -> list[float]:
    """Measured Newton–Schulz seconds of each rank of the shard group (layer-wise only)."""
    if not options.layerwise:
        return []
    device = torch.device(options.device)
    out = [0.0] * (options.dp_size // options.replicas)
    for lo in layouts:
        if lo.mode is Mode.LAYERWISE:
            times = rank_ns_seconds(lo, device=device, repeats=options.ns_repeats)
            out = [a + b for a, b in zip(out, times)]
    return out


def _sample(ranks: list[int], ns_of, count: int) -> list[int]:
    """At most ``count`` ranks: rank 0, and with a layer-wise optimizer (the only mode whose
    ranks step different work) the slowest and fastest by Newton–Schulz, the middle and the
    last rank. DDP and ZeRO-1 ranks run the same kernels on same-sized shards: rank 0 alone."""
    if ns_of(ranks[0]) is None:
        return [ranks[0]][:count]
    picked = [ranks[0], max(ranks, key=ns_of), min(ranks, key=ns_of)]
    picked += [ranks[len(ranks) // 2], ranks[-1]]
    return list(dict.fromkeys(picked))[:count]
