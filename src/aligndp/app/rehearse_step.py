"""One rank's step of a rehearsed job, measured on whatever process group is initialised.

:func:`measure_step` builds the job of :class:`RehearsalOptions` (a GPT preset, the
``parallelize`` settings), wraps it, and runs one warm-up step, one probed step (collectives
and memory: [Note: one probe on every backend] in rehearse_probe.py) and the timed steps,
without the probe. It runs on gloo, NCCL or the fake backend alike ([Note: rehearsal] in
rehearse.py), which is how the tests hold a rehearsal against a real run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import time

import torch

from aligndp.app.rehearse_cost import CommModel
from aligndp.app.rehearse_probe import CollectiveRecord, StepProbe
from aligndp.optim.ns_cost import NewtonSchulzCost, ns_cost_for
from aligndp.optim.registry import whole_matrix_spec
from aligndp.runtime.fake_world import is_fake, moving_nothing

__all__ = ["DTYPES", "RehearsalOptions", "StepMeasurement", "measure_step"]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclasses.dataclass(frozen=True)
class RehearsalOptions:
    """The job a rehearsal plays, and how it measures; checked in ``__post_init__``."""

    preset: str = "demo"
    """GPT preset (aligndp.models.gpt.PRESETS)."""
    config: object | None = None
    """A ``GPTConfig`` to build instead of the preset (tests, shapes of one's own)."""
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
    """With every rank: how many ranks run the step on the device (0: none, the plan and the
    Newton–Schulz timings only)."""
    bucket_numel: int | None = None
    """Elements per bucket; None: parallelize's default."""
    ns_repeats: int = 3
    """Timings of each Newton–Schulz part shape (the median is kept)."""
    comm: CommModel = CommModel()
    collectives: str = "torch"
    """The collectives backend parallelize uses (``DDPConfig.collectives``)."""
    ns_cost: NewtonSchulzCost | None = None
    """The Newton–Schulz cost a layer-wise Muon plan is balanced by
    ([Note: Newton–Schulz device cost] in optim/ns_cost.py); None: the rehearsed device's
    (``ns_cost_for(device)``)."""

    def __post_init__(self) -> None:
        from aligndp.models.gpt import PRESETS

        if self.config is None and self.preset not in PRESETS:
            raise ValueError(f"unknown preset {self.preset!r}: choose one of {', '.join(PRESETS)}")
        if self.dp_size < 1:
            raise ValueError(f"--nproc must be >= 1, got {self.dp_size}")
        if self.replicas < 1 or self.dp_size % self.replicas:
            raise ValueError(
                f"--replicas {self.replicas} must divide --nproc {self.dp_size} (each replica "
                "shards over dp / replicas ranks)"
            )
        for rank in self.ranks or ():
            if not 0 <= rank < self.dp_size:
                raise ValueError(f"--rank {rank} is outside 0..{self.dp_size - 1} (--nproc)")
        for name in ("batch_size", "steps", "ns_repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.sample < 0:
            raise ValueError(
                f"--sample must be >= 0 (0: plan and Newton-Schulz only), got {self.sample}"
            )
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
                return GPT(self.config if self.config is not None else PRESETS[self.preset])
        finally:
            torch.set_default_dtype(old)

    def parallelize_kwargs(self) -> dict:
        kwargs = dict(
            optimizer=self.optimizer,
            sharding=self.sharding,
            lr=1e-4,
            wgrad=None if self.wgrad == "none" else self.wgrad,
            fp8_param_gather=self.fp8_param_gather,
            collectives=self.collectives,
        )
        if self.bucket_numel is not None:
            kwargs["bucket_numel"] = self.bucket_numel
        spec = whole_matrix_spec(self.optimizer)
        if spec is not None and spec.split is not None:
            kwargs["split"] = self.split_policy
        return kwargs

    @property
    def split_policy(self):
        """The split policy of a layer-wise Muon plan: :attr:`ns_cost`'s."""
        return (self.ns_cost or ns_cost_for(self.device)).policy()


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
    probe_peak: int
    """The probe's peak of live tensor storage (any device): equal to ``peak_allocated`` on
    the CPU; on CUDA it leaves out the allocator's rounding and the waits it was paused in."""
    layouts: list


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def _timed_gather(ddp, spent: list[float]):
    """Add the seconds spent in the param gather's launches and waits to ``spent[0]``, once:
    a timed method calling another (``launch_rest`` its ``launch_bucket``, ``wait_all`` its
    ``wait``) is counted by the outer call alone."""
    gather = ddp.param_gather
    names = ("launch_stepped", "launch_rest", "launch_bucket", "wait", "wait_all")
    originals = {n: getattr(gather, n) for n in names}
    inside = [False]

    def timed(fn):
        def call(*args, **kwargs):
            if inside[0]:
                return fn(*args, **kwargs)
            inside[0] = True
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - t0
                inside[0] = False

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
    if device.type == "cuda":  # an earlier rehearsal's model, freed (its hooks make cycles)
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    probe = StepProbe()
    probe.__enter__()  # left after the probed step: the timed steps run without it
    inside = True
    try:
        model = options.model(device)
        mesh = aligndp.replica_mesh(options.replicas, device.type) if options.replicas > 1 else None
        ddp, opt = aligndp.parallelize(model, mesh=mesh, **options.parallelize_kwargs())
        step_fn = torch.compile(ddp) if options.compile else ddp
        cfg = model.cfg
        gen = torch.Generator().manual_seed(1)
        shape = (options.batch_size, (options.seq_len or cfg.seq_len) + 1)
        tokens = torch.randint(cfg.vocab_size, shape, generator=gen)
        x, y = tokens[:, :-1].to(device), tokens[:, 1:].to(device)
        autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=options.autocast)
        totals = dict.fromkeys(("forward", "backward", "optimizer", "gather"), 0.0)
        # step 0 warms up, step 1 is probed (collectives and memory), the rest are timed; on
        # the fake backend the timed steps' collectives move nothing (runtime/fake_world.py)
        quiet = moving_nothing if is_fake() else contextlib.nullcontext
        for step in range(options.steps + 2):
            if step == 1:
                probe.start_step()
            if step == 2:
                probe.recording, inside = False, False
                probe.__exit__(None, None, None)
            spent = [0.0]
            with _timed_gather(ddp, spent), quiet() if step >= 2 else contextlib.nullcontext():
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
            if step >= 2:
                for phase, (a, b) in zip(
                    ("forward", "backward", "optimizer"), zip(marks, marks[1:])
                ):
                    totals[phase] += (b - a) / options.steps
                totals["gather"] += spent[0] / options.steps
    finally:
        if inside:
            probe.__exit__(None, None, None)
    if device.type == "cuda":
        allocated = torch.cuda.max_memory_allocated(device)
        reserved = torch.cuda.max_memory_reserved(device)
    else:
        allocated = reserved = probe.peak_bytes
    measured = StepMeasurement(
        seconds=totals,
        collectives=list(probe.collectives),
        peak_allocated=allocated,
        peak_reserved=reserved,
        probe_peak=probe.peak_bytes,
        layouts=ddp.layouts,
    )
    del model, ddp, opt, step_fn, loss, x, y
    gc.collect()  # the next rehearsal in this process starts from an empty device
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return measured
