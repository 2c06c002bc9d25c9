"""DataParallel: gradient hooks, bucket readiness, overlapped bucket collectives.

Timeline of one synchronised backward (NCCL runs collectives on its own stream, gloo on its
own threads, so a launched collective overlaps the rest of backward):

    backward (default stream) ── grads of bucket 0 ready ── grads of bucket 1 ready ── ... end
                                   │ launch collective 0        │ launch collective 1        │
    comm (NCCL stream / gloo)      └──── reduce bucket 0 ─────┘ └──── reduce bucket 1 ──── ┘
    end of backward (autograd callback): launch what is left, wait for all, agree, publish.

[Note: step states]
A ``DataParallel`` is always in one of three :class:`StepState` s:

- ``IDLE`` (after ``zero_grad``): every ``main_grad`` counts as zero ([Note: lazy zeroing]),
  no ``param.grad`` is set.
- ``ACCUMULATING``: gradients are arriving — backward passes under ``no_sync()`` add into the
  buffers locally; a synchronised backward also launches bucket collectives as buckets fill.
- ``REDUCED``: a synchronised backward has finished (torch DDP's contract: reduction is done
  when ``backward()`` returns). Its autograd end-of-backward callback launched every bucket not
  yet launched, waited for all of them and then *agreed* with the other ranks in one small
  all-reduce of per-param flags (``_agree``): which params got a gradient on any rank, and
  which raised a problem (non-finite values, a stale read). Gradients are then *published*:
  a replicated param's ``param.grad`` is its reduced ``main_grad`` view (so
  ``clip_grad_norm_``, ``GradScaler.unscale_`` and logging see and edit the real thing); a
  sharded or layer-wise param's ``param.grad`` is a :class:`~aligndp.grads.ShardedGrad` that
  refuses every use with the alternative. A param no rank used keeps ``param.grad = None``,
  so the optimizer leaves it untouched, as torch DDP with ``find_unused_parameters=True``.

Transitions: ``zero_grad`` → IDLE from anywhere. A gradient arriving in IDLE or REDUCED → 
ACCUMULATING; from REDUCED this *reopens* the buffers so the next reduction adds to the
visible gradient, as torch accumulates into ``param.grad`` without ``zero_grad``: a replicated
view keeps its value (or takes ``param.grad`` if the user replaced it, zero if the user
dropped it), a sharded view keeps ``dp_size`` × its own shard and zeros elsewhere, so the next
mean over ranks is old mean + new mean. A forward through the wrapper with grad enabled
reopens as well, before autograd would accumulate into a ``ShardedGrad``. ``step()`` in
ACCUMULATING (only ``no_sync`` backwards so far) runs the reduction first.

[Note: bucket readiness]
Each param's autograd hook fires once per backward; a fused-wgrad layer marks its weight
once per use. Readiness hints are the counts of the last synchronised backward: a bucket
launches as soon as each of its params has fired as often as last time, and a bucket with a
param that had no gradient last time waits for the end of backward, so a param used for
the first time can never arrive after its bucket's collective started. Buckets launch
strictly in index order (bucket i waits for 0..i-1), so every rank issues the same sequence.
The first synchronised backward launches everything at its end.

[Note: lazy zeroing]
``zero_grad`` does not write the buffers; it marks every param's ``main_grad`` stale. A
param's first gradient of the step is *copied* into its view, later ones added; a view still
stale when its bucket is launched — an unused param — is zeroed then, and so is one handed to
a fused wgrad kernel. Padding is never written, so it stays zero.
"""
from __future__ import annotations

import contextlib
import dataclasses
import enum
import weakref
from collections.abc import Iterable, Iterator, Mapping

import torch
import torch.distributed as dist
import torch.nn as nn

from aligndp.buffer import FlatBuffer
from aligndp.collectives import all_reduce_mean, reduce_scatter_mean
from aligndp.fused import fused_wgrad_modules
from aligndp.grads import ShardedGrad, same_storage
from aligndp.layout import DEFAULT_START_ALIGNMENT, BufferLayout, Mode, ParamSpec, Requirement, plan_buffers

__all__ = ["DDPConfig", "DataParallel", "BucketRef", "StepState", "NONFINITE_ACTIONS"]

NONFINITE_ACTIONS = ("raise", "skip")

_OWNER: "weakref.WeakKeyDictionary[nn.Parameter, weakref.ref]" = weakref.WeakKeyDictionary()
"""param -> the DataParallel whose hooks take its gradients (one owner at a time)."""


@dataclasses.dataclass(frozen=True)
class DDPConfig:
    """Settings of the data-parallel wrapper."""

    bucket_numel: int | None = 40_000_000
    """Target elements per bucket (one collective each); None puts each buffer in one bucket."""
    overlap: bool = True
    """Launch each bucket's collective during backward as soon as it is ready; False waits
    for the end of backward and launches everything there."""
    grad_dtype: torch.dtype | None = None
    """dtype of the gradient buffers; None keeps each param's dtype (fp32 for bf16 params
    gives fp32 gradient accumulation and reduction)."""
    start_alignment: int = DEFAULT_START_ALIGNMENT
    """Param start alignment in elements; requirements of active consumers can only raise it."""
    check_finite: bool = False
    """Check every bucket's local grads for NaN/Inf before its collective (on the device, no
    sync); the ranks agree at the end of backward and all act per ``on_nonfinite``."""
    on_nonfinite: str = "raise"
    """With ``check_finite``: ``"raise"`` a FloatingPointError naming the params on every
    rank, or ``"skip"`` the optimizer step on every rank (params and state untouched)."""
    broadcast_at_wrap: bool = True
    """Copy rank 0's params and buffers to every rank when wrapping."""
    broadcast_buffers: bool = True
    """Copy rank 0's module buffers (BatchNorm statistics, ...) to every rank at the start of
    every forward through the wrapper, as torch DDP's ``broadcast_buffers=True``."""

    def __post_init__(self) -> None:
        if self.bucket_numel is not None and (not isinstance(self.bucket_numel, int) or self.bucket_numel <= 0):
            raise ValueError(
                f"bucket_numel must be a positive number of elements or None (one bucket), got {self.bucket_numel!r}"
            )
        if self.grad_dtype is not None and not (
            isinstance(self.grad_dtype, torch.dtype) and self.grad_dtype.is_floating_point
        ):
            raise TypeError(f"grad_dtype must be a floating torch.dtype or None, got {self.grad_dtype!r}")
        if self.on_nonfinite not in NONFINITE_ACTIONS:
            raise ValueError(f"on_nonfinite must be one of {NONFINITE_ACTIONS}, got {self.on_nonfinite!r}")


@dataclasses.dataclass(frozen=True)
class BucketRef:
    """One bucket of one buffer."""

    buffer: int
    bucket: int


class StepState(enum.Enum):
    """Where a :class:`DataParallel` is in its step ([Note: step states])."""

    IDLE = "idle"
    ACCUMULATING = "accumulating"
    REDUCED = "reduced"


@dataclasses.dataclass
class _Slot:
    """Where one trainable param lives: its buffer, bucket, ``main_grad`` view, and the
    ``[lo, hi)`` of its flattened elements this rank owns after a reduce-scatter (sharded and
    layer-wise buffers; ``None`` when replicated)."""

    index: int
    ref: BucketRef
    view: torch.Tensor
    owned: tuple[int, int] | None
    sharded_grad: ShardedGrad | None


@dataclasses.dataclass(frozen=True)
class RoundReport:
    """What the last synchronised backward did (for tests, logs and benchmarks)."""

    launched_during_backward: int
    """Buckets whose collective started before the end of backward (overlap)."""
    buckets: int
    used: int
    """Params that had a gradient on at least one rank."""


class DataParallel(nn.Module):
    """Wrap an unmodified module; keep its grads in aligned flat buffers reduced by bucket.

    ``modes`` maps param names to a :class:`~aligndp.layout.Mode` (default: every param
    replicated, i.e. plain DDP). Params are grouped into one buffer per (mode, param dtype).
    Sharded and layerwise buffers also hold the params (``param.data`` becomes a view).
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        process_group: dist.ProcessGroup | None = None,
        config: DDPConfig = DDPConfig(),
        modes: Mapping[str, Mode] | None = None,
        requirements: Iterable[Requirement] = (),
    ) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"DataParallel wraps an nn.Module, got {type(module).__name__}")
        if not dist.is_initialized():
            raise ValueError("torch.distributed is not initialised: call dist.init_process_group() first")
        self.module = module
        self.process_group = process_group
        self.config = config
        self.dp_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("the module has no trainable params (requires_grad=True): nothing to data-parallelise")
        devices = {p.device for _, p in named}
        if len(devices) > 1:
            where = {str(d): [n for n, p in named if p.device == d][:3] for d in devices}
            raise ValueError(
                f"the module's params live on {len(devices)} devices ({where}): data parallelism needs one "
                "device per rank; call module.to(device) before wrapping"
            )
        self.device = devices.pop()
        if self.device.type == "meta":
            raise ValueError(f"the module's params are on the meta device: materialise it first "
                             "(module.to_empty(device=...), then initialise it), then wrap it")
        modes = dict(modes or {})
        unknown = set(modes) - {n for n, _ in named}
        if unknown:
            raise ValueError(f"modes name params that are not trainable params of the module: {sorted(unknown)}")
        fused = fused_wgrad_modules(module)
        self.requirements = tuple(requirements) + tuple(r for _, m in fused for r in m.wgrad_requirements())

        if config.broadcast_at_wrap and self.dp_size > 1:
            self._broadcast_from_rank0()

        layouts = plan_buffers(
            [ParamSpec(n, tuple(p.shape), p.dtype) for n, p in named], modes=modes, dp_size=self.dp_size,
            bucket_numel=config.bucket_numel, requirements=self.requirements,
            start_alignment=config.start_alignment, grad_dtype=config.grad_dtype,
        )
        by_name = dict(named)
        self.flat_buffers: list[FlatBuffer] = [
            FlatBuffer(layout, [by_name[s.name] for s in sorted(layout.params, key=lambda s: s.index)],
                       with_param_data=layout.mode is not Mode.REPLICATED)
            for layout in layouts
        ]
        self.param_names: dict[nn.Parameter, str] = {p: n for n, p in named}
        self.params: list[nn.Parameter] = [p for _, p in named]
        """Trainable params in registration order (the order of the agreement flags)."""
        self._slot: dict[nn.Parameter, _Slot] = {}
        position = {p: k for k, p in enumerate(self.params)}
        for i, buf in enumerate(self.flat_buffers):
            for p, s, g in zip(buf.params, buf.slots, buf.main_grads):
                owned = None
                if buf.layout.mode is not Mode.REPLICATED:
                    lo, hi = buf.layout.shard_range(s.bucket, self.rank)
                    owned = (min(max(lo - s.start, 0), s.numel), min(max(hi - s.start, 0), s.numel))
                self._slot[p] = _Slot(position[p], BucketRef(i, s.bucket), g, owned,
                                      ShardedGrad(p) if owned is not None else None)
        self.bucket_refs: list[BucketRef] = [
            BucketRef(i, b) for i, buf in enumerate(self.flat_buffers) for b in range(len(buf.layout.buckets))
        ]
        self._bucket_params = {ref: [p for p in self.params if self._slot[p].ref == ref] for ref in self.bucket_refs}
        self._position = {ref: k for k, ref in enumerate(self.bucket_refs)}

        self.state = StepState.IDLE
        self._expected: dict[nn.Parameter, int] | None = None  # readiness hints ([Note: bucket readiness])
        self._fired: dict[nn.Parameter, int] = dict.fromkeys(self.params, 0)
        self._stale: set[nn.Parameter] = set(self.params)  # [Note: lazy zeroing]
        self._used: set[nn.Parameter] = set()  # had a gradient on this rank since the last reduction
        self._published: set[nn.Parameter] = set()  # param.grad set by us ([Note: step states])
        self._problems: dict[str, set[nn.Parameter]] = {"late": set(), "stale_read": set()}
        self._nonfinite: torch.Tensor | None = None
        self._works: dict[BucketRef, dist.Work | None] = {}
        self._next_launch = 0
        self._launched_in_backward = 0
        self._sync_enabled = True
        self._callback_queued = False
        self._unwaited: set[nn.Parameter] = set()
        self._param_gather = None
        self._joined: _Join | None = None
        self.nonfinite: str | None = None
        """The agreed message of the last reduction when a gradient was not finite, else None."""
        self.last_round: RoundReport | None = None
        self.reductions = 0
        """Counts reductions and zero_grads: what optimizers bound to the gradients is valid while it is unchanged."""
        self._replaced = False
        self._claim_params(fused)

    # ---- ownership of the module's params (wrapping again replaces the old wrapper) ----
    def _claim_params(self, fused) -> None:
        me = weakref.ref(self)
        for p in self.params:
            old = _OWNER.get(p)
            old = old() if old is not None else None
            if old is not None and old is not self:
                old.remove_hooks()
                old._replaced = True
            _OWNER[p] = me

        def hook(param: nn.Parameter, _me=me) -> None:
            owner = _me()
            if owner is not None and not owner._replaced:
                owner._on_grad(param)

        self._hooks = [p.register_post_accumulate_grad_hook(hook) for p in self.params]
        for _, m in fused:
            m.bind_grad_sink(self)

    # ---- the GradSink protocol ([Note: fused wgrad] in aligndp/fused.py) ----
    def main_grad(self, param: nn.Parameter) -> torch.Tensor | None:
        slot = self._slot.get(param)
        if slot is None:
            return None
        self._reopen()
        self._take(param)
        return slot.view

    def mark_ready(self, param: nn.Parameter) -> None:
        self._queue_end_of_backward()
        self._reopen()
        self._arrived(param)

    # ---- hooks ----
    def _on_grad(self, param: nn.Parameter) -> None:
        grad = param.grad
        if grad is None:
            return
        self._queue_end_of_backward()
        view = self._slot[param].view
        if param in self._published:  # accumulated by autograd on top of the visible grad
            self._published.discard(param)
            if not same_storage(grad, view):
                view.copy_(grad.view_as(view))
        else:
            self._reopen()
            if param in self._stale:
                self._stale.discard(param)
                view.copy_(grad.view_as(view))
            else:
                view.add_(grad.view_as(view))
        param.grad = None
        self._reopen()
        self._arrived(param)

    def _arrived(self, param: nn.Parameter) -> None:
        self.state = StepState.ACCUMULATING
        self._used.add(param)
        if param in self._unwaited:
            self._problems["stale_read"].add(param)
        if not self._sync_enabled:
            return
        self._fired[param] += 1
        if self._position[self._slot[param].ref] < self._next_launch:
            self._problems["late"].add(param)  # only a fused layer used more often than last time
        elif self._expected is not None and self.config.overlap:
            self._launch_ready()
            self._launched_in_backward = self._next_launch

    def _queue_end_of_backward(self) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        self._callback_queued = False
        if self._sync_enabled and not self._replaced:
            self.finish_grad_sync()

    def _take(self, param: nn.Parameter) -> None:
        """Zero a stale view before something accumulates into or reads it."""
        if param in self._stale:
            self._stale.discard(param)
            self._slot[param].view.zero_()

    @torch.no_grad()
    def _reopen(self) -> None:
        """REDUCED -> ACCUMULATING: make the buffers hold the visible grads again ([Note: step states])."""
        if self.state is not StepState.REDUCED:
            return
        self.state = StepState.ACCUMULATING
        for p in list(self._published):
            slot, grad = self._slot[p], p.grad
            flat = slot.view.view(-1)
            if grad is None:  # dropped by the user (model.zero_grad(), p.grad = None)
                flat.zero_()
            elif slot.owned is None:
                if not same_storage(grad, slot.view):
                    slot.view.copy_(grad.view_as(slot.view))
                self._used.add(p)
            else:  # own shard x dp_size, zeros elsewhere: the next mean adds the new mean to it
                lo, hi = slot.owned
                flat[:lo].zero_()
                flat[hi:].zero_()
                flat[lo:hi].mul_(self.dp_size)
                self._used.add(p)
            p.grad = None
        self._published.clear()

    # ---- readiness and collectives ----
    def _bucket_ready(self, ref: BucketRef) -> bool:
        assert self._expected is not None
        return all(0 < self._expected[p] <= self._fired[p] for p in self._bucket_params[ref])

    def _launch_ready(self) -> None:
        while self._next_launch < len(self.bucket_refs) and self._bucket_ready(self.bucket_refs[self._next_launch]):
            self._launch(self.bucket_refs[self._next_launch])

    def _launch(self, ref: BucketRef) -> None:
        assert ref == self.bucket_refs[self._next_launch], "buckets launch in index order"
        buf = self.flat_buffers[ref.buffer]
        for p in self._bucket_params[ref]:
            self._take(p)
        if self.config.check_finite:
            self._check_finite(ref)
        grad = buf.bucket_grad(ref.bucket)
        if self.dp_size == 1:
            self._works[ref] = None
        elif buf.layout.mode is Mode.REPLICATED:
            self._works[ref] = all_reduce_mean(grad, group=self.process_group)
        else:
            self._works[ref] = reduce_scatter_mean(grad, group=self.process_group)
        self._next_launch += 1

    def _check_finite(self, ref: BucketRef) -> None:
        """Count non-finite local gradient elements per param, on the device (no sync)."""
        if self._nonfinite is None:
            self._nonfinite = torch.zeros(len(self.params), dtype=torch.int32, device=self.device)
        params = self._bucket_params[ref]
        index = torch.tensor([self._slot[p].index for p in params], device=self.device)
        counts = torch.stack([(~torch.isfinite(self._slot[p].view)).sum() for p in params])
        self._nonfinite.index_add_(0, index, counts.to(torch.int32))

    def finish_grad_sync(self) -> None:
        """Reduce what has accumulated (launch every bucket not yet launched, wait for all),
        agree with the other ranks and publish ``param.grad``; a no-op unless ACCUMULATING.
        Runs by itself at the end of every synchronised backward."""
        if self.state is not StepState.ACCUMULATING:
            return
        while self._next_launch < len(self.bucket_refs):
            self._launch(self.bucket_refs[self._next_launch])
        for work in self._works.values():
            if work is not None:
                work.wait()
        used, nonfinite, problems = self._agree()
        self.last_round = RoundReport(self._launched_in_backward, len(self.bucket_refs), len(used))
        self._expected = dict(self._fired)
        self._reset_round()
        self.reductions += 1
        self.state = StepState.REDUCED
        for p in used:
            slot = self._slot[p]
            if slot.sharded_grad is not None:
                p.grad = slot.sharded_grad
            else:
                p.grad = slot.view if slot.view.dtype == p.dtype else slot.view.to(p.dtype)
            self._published.add(p)
        self.nonfinite = None
        if nonfinite:
            self.nonfinite = (
                f"non-finite (NaN/Inf) gradient elements before the reduction: {nonfinite}; "
                + ("the optimizer step is skipped on every rank" if self.config.on_nonfinite == "skip" else
                   "lower the learning rate or check the loss, then call opt.zero_grad() to drop this step "
                   "(or parallelize(..., on_nonfinite='skip') to skip such steps on every rank)")
            )
            if self.config.on_nonfinite == "raise":
                raise FloatingPointError(self.nonfinite)
        if problems:
            raise RuntimeError(problems)

    def _agree(self) -> tuple[list[nn.Parameter], str, str]:
        """One all-reduce of per-param flags: used on any rank, non-finite elements, problems."""
        n = len(self.params)
        flags = [1 if p in self._used else 0 for p in self.params]
        for kind in ("late", "stale_read"):
            flags += [1 if p in self._problems[kind] else 0 for p in self.params]
        local = torch.tensor(flags, dtype=torch.int32, device=self.device)
        if self.config.check_finite:
            counts = self._nonfinite if self._nonfinite is not None else torch.zeros(n, dtype=torch.int32,
                                                                                     device=self.device)
            on_rank = torch.zeros(self.dp_size, dtype=torch.int32, device=self.device)
            on_rank[self.rank] = counts.sum()
            local = torch.cat([local, counts, on_rank])
        if self.dp_size > 1:
            dist.all_reduce(local, group=self.process_group)
        values = local.tolist()
        used = [p for p, v in zip(self.params, values[:n]) if v]
        late = [self.param_names[p] for p, v in zip(self.params, values[n:2 * n]) if v]
        stale = [self.param_names[p] for p, v in zip(self.params, values[2 * n:3 * n]) if v]
        nonfinite = ", ".join(f"{self.param_names[p]!r}: {v} element(s)" for p, v in
                              zip(self.params, values[3 * n:4 * n]) if v)
        if nonfinite:
            ranks = [r for r, v in enumerate(values[4 * n:]) if v]
            nonfinite = f"{nonfinite} on " + ", ".join(f"rank {r}" for r in ranks)
        problems = []
        if late:
            problems.append(f"params {late[:5]} received a gradient after their bucket's collective started "
                            "(a fused-wgrad layer used more often than in the previous step); that contribution "
                            "is lost: call opt.zero_grad() and repeat the step, or build the model so every "
                            "fused layer is used the same number of times per step")
        if stale:
            problems.append(f"params {stale[:5]} were read in forward before their all-gather was waited for "
                            "(read outside their own module's forward, e.g. F.linear(x, self.head.weight) or a "
                            "tied weight), so the forward used stale values: use overlap_param_gather=False, or "
                            "call the module that owns them")
        return used, nonfinite, "; ".join(problems)

    def _reset_round(self) -> None:
        self._fired = dict.fromkeys(self._fired, 0)
        self._works.clear()
        self._next_launch = 0
        self._launched_in_backward = 0
        self._used = set()
        self._problems = {"late": set(), "stale_read": set()}
        self._nonfinite = None
        self._unwaited = set()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (micro-batches); the next backward outside syncs them."""
        previous = self._sync_enabled
        self._sync_enabled = False
        try:
            yield
        finally:
            self._sync_enabled = previous

    def zero_grad_buffer(self) -> None:
        """Start a new step (-> IDLE): every ``main_grad`` counts as zero ([Note: lazy zeroing]),
        every ``param.grad`` is dropped."""
        self._stale = set(self.params)
        for p in self.params:
            p.grad = None
        self._published.clear()
        self._reset_round()
        self._callback_queued = False
        self.nonfinite = None
        self.reductions += 1
        self.state = StepState.IDLE

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Same as ``opt.zero_grad()``. ``set_to_none=False`` keeps zero gradients visible, so
        params unused in the next step are still stepped (with zero gradient), as in torch."""
        self.zero_grad_buffer()
        if not set_to_none:
            self._used = set(self.params)
            self.state = StepState.ACCUMULATING

    def reduced_grad(self, param: nn.Parameter) -> torch.Tensor:
        """The ``main_grad`` view of ``param`` after a reduction (this rank's shard is valid in
        sharded and layer-wise buffers); for optimizers, which read it without reopening."""
        return self._slot[param].view

    def has_grad(self, param: nn.Parameter) -> bool:
        """Whether ``param`` has a reduced gradient to step with (some rank used it)."""
        return param in self._published

    # ---- params and buffers ----
    def _broadcast_from_rank0(self) -> None:
        with torch.no_grad():
            for t in list(self.module.parameters()) + list(self.module.buffers()):
                dist.broadcast(t.data, src=self._src, group=self.process_group)

    @property
    def _src(self) -> int:
        return dist.get_global_rank(self.process_group, 0) if self.process_group is not None else 0

    @torch.no_grad()
    def _broadcast_buffers(self) -> None:
        """Rank 0's module buffers to every rank, one broadcast per dtype."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for b in self.module.buffers():
            by_dtype.setdefault(b.dtype, []).append(b)
        for tensors in by_dtype.values():
            flat = torch.cat([t.reshape(-1) for t in tensors])
            dist.broadcast(flat, src=self._src, group=self.process_group)
            offset = 0
            for t in tensors:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()

    @property
    def layouts(self) -> list[BufferLayout]:
        return [buf.layout for buf in self.flat_buffers]

    def buffers_for(self, mode: Mode) -> list[FlatBuffer]:
        return [b for b in self.flat_buffers if b.layout.mode is mode]

    def attach_param_gather(self, gather) -> None:
        """The optimizer's :class:`~aligndp.param_gather.ParamGather`: forward checks that
        every gathered param it used was waited for, and ``state_dict()`` waits for all."""
        self._param_gather = gather
        self._hooks.append(self.module.register_state_dict_pre_hook(lambda *_a, **_k: gather.wait_all()))

    def forward(self, *args, **kwargs):
        if self._replaced:
            raise RuntimeError("this DataParallel was replaced by a newer wrap of the same module; use the new one")
        if self._joined is not None:
            self._joined.forward()
        if self.config.broadcast_buffers and self.dp_size > 1 and any(True for _ in self.module.buffers()):
            self._broadcast_buffers()
        if torch.is_grad_enabled():
            self._reopen()  # before autograd accumulates into a ShardedGrad
        out = self.module(*args, **kwargs)
        gather = self._param_gather
        if gather is not None and gather.in_flight:
            self._unwaited |= gather.pending_params()
            gather.wait_all()
        return out

    @contextlib.contextmanager
    def join(self) -> Iterator[None]:
        """Uneven inputs: train inside ``with model.join():``. When one rank runs out of batches
        while others still train, every rank raises the same ``ValueError`` at its next forward
        (one tiny all-reduce per forward while inside) instead of hanging."""
        self._joined = _Join(self)
        try:
            yield
        finally:
            joined, self._joined = self._joined, None
            joined.leave()

    def remove_hooks(self) -> None:
        """Detach from the module (hooks and fused-wgrad sinks); buffers stay bound."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        for _, m in fused_wgrad_modules(self.module):
            m.bind_grad_sink(None)


class _Join:
    """The bookkeeping of :meth:`DataParallel.join`: forwards counted, one flag all-reduce each."""

    def __init__(self, model: DataParallel) -> None:
        self.model = model
        self.forwards = 0

    def _still_training(self, flag: int) -> int:
        t = torch.tensor([flag], dtype=torch.int32, device=self.model.device)
        dist.all_reduce(t, group=self.model.process_group)
        return int(t.item())

    def _message(self, training: int) -> str:
        ws = self.model.dp_size
        return (f"uneven inputs: {ws - training} of {ws} rank(s) ran out of batches while {training} still "
                "train; give every rank the same number of batches (e.g. DistributedSampler(drop_last=True), "
                "or drop the last incomplete batch)")

    def forward(self) -> None:
        self.forwards += 1
        training = self._still_training(1)
        if training < self.model.dp_size:
            raise ValueError(self._message(training))

    def leave(self) -> None:
        training = self._still_training(0)
        if training:
            raise ValueError(self._message(training))
