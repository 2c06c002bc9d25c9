"""`aligndp rehearse`: one process plays rank r of a D-rank job, on torch's fake process group.

[Note: rehearsal]
:func:`rehearse` initialises the fake backend as rank r of D ranks and runs the real job on
this device: the plan, the buffers, ``parallelize``'s wrapper and optimizer, forward,
backward and the optimizer step with their kernels; collectives are launched and counted
(:class:`~aligndp.app.rehearse_probe.StepProbe`), and move nothing. What aligndp decides from
other ranks' answers at wrap time is answered in one place ([Note: rehearsal on the fake
process group] in runtime/fake_world.py). :func:`measure_step` is the part that runs on
*any* process group, so the tests run it on gloo at D = 2, 3, 4 and a 2 x 2 mesh and compare
the collectives and memory with the rehearsal's.

With ``ranks=None`` (``--rank all``) the plan is made once (on the meta device: it is pure)
and every rank gets its analytical memory and, for layer-wise optimizers, its Newton–Schulz
time, measured on the device once per distinct part shape
(:func:`~aligndp.app.rehearse_cost.rank_ns_seconds`); the full step runs on the device for a
sample of ranks only (rank 0, the slowest and the fastest by Newton–Schulz, up to
``sample``), and the others take the sampled rank 0's forward, backward and collectives, with
its optimizer time moved by their Newton–Schulz difference. The report says which ranks ran.
A rank whose analytical memory exceeds what the device holds is not run: it does not fit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from aligndp.app.rehearse_cost import (
    CommModel,
    analytic_bytes,
    predicted_step,
    rank_ns_seconds,
)
from aligndp.app.rehearse_probe import CollectiveRecord, StepProbe
from aligndp.optim.registry import whole_matrix_spec
from aligndp.plan.request import plan_buffers
from aligndp.plan.spec import Mode, max_over_mean

__all__ = ["RehearsalOptions", "RankReport", "Rehearsal", "measure_step", "rehearse"]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclasses.dataclass(frozen=True)
class RehearsalOptions:
    """The job a rehearsal plays, and how it measures; checked in ``__post_init__``."""

    preset: str = "demo"
    """GPT preset (aligndp.models.gpt.PRESETS)."""
    dp_size: int = 8
    """Ranks of the rehearsed job (every replica's)."""
    replicas: int = 1
    """Replicas of a (replicas, dp_size / replicas) mesh ([Note: replicate x shard mesh])."""
    ranks: tuple[int, ...] | None = (0,)
    """Ranks to rehearse; None: all (the step itself runs for a sample, [Note: rehearsal])."""
    sharding: str = "none"
    """``none`` (DDP) or ``zero1`` (ZeRO-1; layer-wise for a whole-matrix optimizer)."""
    optimizer: str = "adamw"
    wgrad: str = "none"
    fp8_param_gather: bool = False
    batch_size: int = 1
    seq_len: int | None = None
    """Tokens per sequence; None: the preset's."""
    dtype: str = "fp32"
    """Param dtype the model is built in: ``fp32`` or ``bf16``."""
    autocast: bool = False
    """Forward and backward under bf16 autocast."""
    compile: bool = False
    device: str = "cpu"
    steps: int = 1
    """Timed steps after one warm-up step."""
    sample: int = 3
    """With every rank: how many ranks run the step on the device."""
    bucket_numel: int | None = None
    """Elements per bucket; None: parallelize's default."""
    ns_repeats: int = 3
    """Timings of each Newton–Schulz part shape (the median is kept)."""
    comm: CommModel = CommModel()

    def __post_init__(self) -> None:
        from aligndp.models.gpt import PRESETS

        if self.preset not in PRESETS:
            raise ValueError(f"unknown preset {self.preset!r}: choose one of {', '.join(PRESETS)}")
        if self.dp_size < 1:
            raise ValueError(f"--dp must be >= 1, got {self.dp_size}")
        if self.replicas < 1 or self.dp_size % self.replicas:
            raise ValueError(
                f"--replicas {self.replicas} must divide --dp {self.dp_size} (each replica "
                "shards over dp / replicas ranks)"
            )
        for rank in self.ranks or ():
            if not 0 <= rank < self.dp_size:
                raise ValueError(f"--rank {rank} is outside 0..{self.dp_size - 1} (--dp)")
        for name in ("batch_size", "steps", "sample", "ns_repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"--device must be cpu or cuda, got {self.device!r}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda: no CUDA device is visible; use --device cpu")

    @property
    def layerwise(self) -> bool:
        return self.sharding == "zero1" and whole_matrix_spec(self.optimizer) is not None

    def model(self, device: torch.device | str) -> torch.nn.Module:
        """The preset on ``device`` in :attr:`dtype` (seeded: every rank builds the same)."""
        from aligndp.models.gpt import GPT, PRESETS

        torch.manual_seed(0)
        old = torch.get_default_dtype()
        torch.set_default_dtype(DTYPES[self.dtype])
        try:
            with torch.device(device):
                return GPT(PRESETS[self.preset])
        finally:
            torch.set_default_dtype(old)

    def parallelize_kwargs(self) -> dict:
        kwargs = dict(
            optimizer=self.optimizer,
            sharding=self.sharding,
            lr=1e-4,
            wgrad=None if self.wgrad == "none" else self.wgrad,
            fp8_param_gather=self.fp8_param_gather,
        )
        if self.bucket_numel is not None:
            kwargs["bucket_numel"] = self.bucket_numel
        return kwargs


@dataclasses.dataclass
class StepMeasurement:
    """What :func:`measure_step` measured of one rank."""

    seconds: dict[str, float]
    """Mean seconds per timed step: forward, backward, optimizer (its param gather
    included) and gather (the param gather's own part of it)."""
    collectives: list[CollectiveRecord]
    """Every collective of the last timed step, in launch order."""
    peak_allocated: int
    peak_reserved: int
    layouts: list


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def _timed_gather(ddp, spent: list[float]):
    """Add the seconds spent in the param gather's launches and waits to ``spent[0]``."""
    gather = ddp.param_gather
    names = ("launch_stepped", "launch_rest", "launch_bucket", "wait", "wait_all")
    originals = {n: getattr(gather, n) for n in names}

    def timed(fn):
        def call(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - t0

        return call

    for n, fn in originals.items():
        setattr(gather, n, timed(fn))
    try:
        yield
    finally:
        for n in names:
            delattr(gather, n)


def measure_step(options: RehearsalOptions) -> StepMeasurement:
    """Build, wrap and step ``options``' job on the process group already initialised (gloo,
    NCCL or fake) as this rank: one warm-up step, then ``options.steps`` timed ones."""
    import aligndp

    device = (
        torch.device(options.device, torch.cuda.current_device())
        if (options.device == "cuda")
        else torch.device("cpu")
    )
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    probe = StepProbe()
    with probe:
        model = options.model(device)
        mesh = aligndp.replica_mesh(options.replicas, device.type) if options.replicas > 1 else None
        ddp, opt = aligndp.parallelize(model, mesh=mesh, **options.parallelize_kwargs())
        step_fn = torch.compile(ddp) if options.compile else ddp
        cfg = model.cfg
        seq_len = options.seq_len or cfg.seq_len
        gen = torch.Generator().manual_seed(1)
        tokens = torch.randint(cfg.vocab_size, (options.batch_size, seq_len + 1), generator=gen)
        x, y = tokens[:, :-1].to(device), tokens[:, 1:].to(device)
        totals = dict.fromkeys(("forward", "backward", "optimizer", "gather"), 0.0)
        autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=options.autocast)
        for step in range(options.steps + 1):
            timed = step > 0
            if timed:
                probe.start_step()
            spent = [0.0]
            with _timed_gather(ddp, spent):
                marks = [time.perf_counter()]
                for phase in ("forward", "backward", "optimizer"):
                    probe.phase = phase
                    if phase == "forward":
                        with autocast:
                            loss = step_fn(x, y)
                    elif phase == "backward":
                        loss.backward()
                    else:
                        opt.step()
                        opt.zero_grad()
                    _sync(device)
                    marks.append(time.perf_counter())
            if timed:
                for phase, (a, b) in zip(
                    ("forward", "backward", "optimizer"), zip(marks, marks[1:])
                ):
                    totals[phase] += (b - a) / options.steps
                totals["gather"] += spent[0] / options.steps
        probe.recording = False
    if device.type == "cuda":
        allocated = torch.cuda.max_memory_allocated(device)
        reserved = torch.cuda.max_memory_reserved(device)
    else:
        allocated = reserved = probe.peak_bytes
    return StepMeasurement(
        seconds=totals,
        collectives=list(probe.collectives),
        peak_allocated=allocated,
        peak_reserved=reserved,
        layouts=ddp.layouts,
    )


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
    dist.init_process_group("fake", store=dist.HashStore(), rank=rank, world_size=options.dp_size)
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
    run = _sample(all_ranks, ns_of, options.sample) if options.ranks is None else all_ranks
    room = _device_bytes(options.device)
    for r in run:
        report = reports[r]
        if sum(report.analytic.values()) > room:
            report.fits = False
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
    if options.ranks is None:
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
    """``count`` ranks: rank 0, the slowest and fastest by Newton–Schulz (when known), the
    middle and the last rank."""
    picked = [ranks[0]]
    if ns_of(ranks[0]) is not None:
        picked += [max(ranks, key=ns_of), min(ranks, key=ns_of)]
    picked += [ranks[len(ranks) // 2], ranks[-1]]
    return list(dict.fromkeys(picked))[:count]
