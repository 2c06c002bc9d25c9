"""DataParallel: gradient hooks, bucket readiness, overlapped bucket collectives.

Timeline of one synchronised backward (NCCL runs collectives on its own stream, gloo on its
own threads, so a launched collective overlaps the rest of backward):

    backward (default stream) ── grads of bucket 0 ready ── grads of bucket 1 ready ── ... end
                                   │ launch collective 0        │ launch collective 1        │
    comm (NCCL stream / gloo)      └──── reduce bucket 0 ─────┘ └──── reduce bucket 1 ──── ┘
    end of backward (autograd callback): launch what is left, wait for all, agree, publish.

``buckets_in_flight()`` lists the buckets launched and not yet waited for.

[Note: step states] (DESIGN.md): IDLE after ``zero_grad``; ACCUMULATING while gradients
arrive; REDUCED once a synchronised backward ended — its autograd callback launched what was
left, waited, agreed with the other ranks in one small all-reduce (step_flags.py) and published
``param.grad`` (the reduced view, or a ``ShardedGrad`` in sharded modes). A gradient arriving
in REDUCED reopens the buffers first (``_reopen``), as torch accumulates into ``param.grad``.

[Note: bucket readiness] (DESIGN.md), as the code does it:
Each param's autograd hook fires once per backward; a fused-wgrad layer marks its weight
once per use. Readiness hints are the counts of the last synchronised backward: a bucket
launches as soon as each of its params has fired as often as last time, and a bucket with a
param that had no gradient last time waits for the end of backward, so a param used for
the first time can never arrive after its bucket's collective started. Buckets launch
strictly in index order (bucket i waits for 0..i-1), so every rank issues the same sequence.
The first synchronised backward launches everything at its end.

[Note: lazy zeroing]
``zero_grad`` zeroes each buffer of [Note: gradient as bucket view] in one op (autograd adds
into those views) and only marks the other params' ``main_grad`` stale: such a param's first
gradient of the step is *copied* into its view, later ones added; a view still stale when its
bucket is launched — an unused param — is zeroed then. Either way a param is stale (unused)
until something writes it. A fused wgrad kernel handed a stale view overwrites it
([Note: write, not accumulate] in aligndp/plan/fused.py). Padding is never written, so it
stays zero.

[Note: gradient as bucket view]
Where a buffer's grad dtype is its params' dtype, ``forward`` (grad enabled) makes each param's
``param.grad`` its ``main_grad`` view when it is None (:meth:`GradSync.arm`), as torch DDP's
``gradient_as_bucket_view``: autograd's AccumulateGrad adds into the buffer itself, and the
post-accumulate hook only counts (identity check, readiness counter: no copy, no Python work
per element). The hook copies only off this path: a param whose grad dtype differs, a backward
whose forward bypassed the wrapper, ``create_graph=True`` (autograd replaces ``param.grad``).
Zeroing whole buffers at ``zero_grad`` writes every element once; the copy it replaces read
and wrote them, and issued one kernel and one Python hook body per param. A param without a
gradient in the step shows ``param.grad`` None again after the reduction, as in torch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections.abc import Iterable, Iterator, Mapping

import torch
import torch.distributed as dist
import torch.nn as nn

from aligndp.plan.fused import fused_wgrad_modules
from aligndp.plan.request import PlanRequest, plan_buffers
from aligndp.plan.slots import BufferLayout
from aligndp.plan.spec import (
    DEFAULT_BUCKET_NUMEL,
    DEFAULT_START_ALIGNMENT,
    Mode,
    ParamSpec,
    Requirement,
    check_bucket_numel,
    check_grad_dtype,
)
from aligndp.runtime.agreement import check_ranks_agree, prepare_side_group
from aligndp.runtime.buffer import FlatBuffer
from aligndp.runtime.collective_backends import (
    DEFAULT_COLLECTIVES,
    check_collectives_name,
    make_collectives,
)
from aligndp.runtime.grad_sync import GradSync
from aligndp.runtime.mesh import MeshCollectives, data_parallel_groups
from aligndp.runtime.param_gather import ParamGather
from aligndp.runtime.step_state import BucketRef, GradSlot, ParamIndex, StepState, param_index
from aligndp.runtime.wrapped_param import binding, claim_params

__all__ = ["DDPConfig", "DataParallel", "BucketRef", "StepState", "NONFINITE_ACTIONS"]

NONFINITE_ACTIONS = ("raise", "skip")


@dataclasses.dataclass(frozen=True)
class DDPConfig:
    """Settings of the data-parallel wrapper."""

    bucket_numel: int | None = DEFAULT_BUCKET_NUMEL
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
    """Count every param's non-finite (NaN/Inf) local gradient elements before its bucket's
    collective: one pass over each bucket, on the device, no host sync there. The counts ride
    on the end-of-backward agreement, which is then read on the host once per step, and every
    rank acts per ``on_nonfinite``."""
    on_nonfinite: str = "raise"
    """With ``check_finite``: ``"raise"`` a FloatingPointError naming the params on every
    rank, or ``"skip"`` the optimizer step on every rank (params and state untouched)."""
    broadcast_at_wrap: bool = True
    """Copy rank 0's params and buffers to every rank when wrapping."""
    broadcast_buffers: bool = True
    """Copy rank 0's module buffers (BatchNorm statistics, ...) to every rank at the start of
    every forward through the wrapper, as torch DDP's ``broadcast_buffers=True``."""
    collectives: str = DEFAULT_COLLECTIVES
    """Name of the collectives backend that reduces and gathers the buckets and allocates the
    buffers ([Note: collectives seam] in aligndp/runtime/collectives.py): ``"torch"`` is
    torch.distributed on the process group; others are registered with
    ``aligndp.register_collectives``."""

    def __post_init__(self) -> None:
        check_bucket_numel(self.bucket_numel)
        check_grad_dtype(self.grad_dtype)
        if self.on_nonfinite not in NONFINITE_ACTIONS:
            raise ValueError(
                f"on_nonfinite must be one of {NONFINITE_ACTIONS}, got {self.on_nonfinite!r}"
            )
        check_collectives_name(self.collectives)


class DataParallel(GradSync, nn.Module):
    """Wrap an unmodified module; keep its grads in aligned flat buffers reduced by bucket.

    ``modes`` maps param names to a :class:`~aligndp.plan.spec.Mode` (default: every param
    replicated, i.e. plain DDP). Params are grouped into one buffer per (mode, param dtype).
    Sharded and layerwise buffers also hold the params (``param.data`` becomes a view).
    ``plan`` (a :class:`~aligndp.plan.request.PlanRequest`, as ``aligndp.parallelize`` builds)
    replaces ``modes`` and the config's planning fields. ``mesh``: a torch ``DeviceMesh``
    instead of ``process_group`` ([Note: replicate x shard mesh] in mesh.py): ``dp_size`` and
    ``rank`` are then the shard group's, ``process_group``/``world_size`` every rank's.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        process_group: dist.ProcessGroup | None = None,
        mesh: object | None = None,
        config: DDPConfig = DDPConfig(),
        modes: Mapping[str, Mode] | None = None,
        requirements: Iterable[Requirement] = (),
        plan: PlanRequest | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"DataParallel wraps an nn.Module, got {type(module).__name__}")
        if not dist.is_initialized():
            raise ValueError(
                "torch.distributed is not initialised: call dist.init_process_group() first"
            )
        self.module = module
        groups = data_parallel_groups(process_group, mesh)
        self.process_group = process_group = groups.world
        self.world_size, self.world_rank = (
            dist.get_world_size(process_group),
            dist.get_rank(process_group),
        )
        self.config = config
        self.collectives = make_collectives(config.collectives, group=groups.shard)
        """The backend that reduces, gathers and allocates ([Note: collectives seam])."""
        if groups.replicas > 1:
            self.collectives = MeshCollectives(self.collectives, groups)
        self.dp_size, self.rank = self.collectives.dp_size, self.collectives.rank
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError(
                "the module has no trainable params (requires_grad=True): "
                "nothing to data-parallelise"
            )
        devices = {p.device for _, p in named}
        if len(devices) > 1:
            where = {str(d): [n for n, p in named if p.device == d][:3] for d in devices}
            raise ValueError(
                f"the module's params live on {len(devices)} devices ({where}): data "
                "parallelism needs one device per rank; call module.to(device) before wrapping"
            )
        self.device = devices.pop()
        if self.device.type == "meta":
            raise ValueError(
                "the module's params are on the meta device: materialise it first "
                "(module.to_empty(device=...), then initialise it), then wrap it"
            )
        modes = dict(modes or {})
        unknown = set(modes) - {n for n, _ in named}
        if unknown:
            raise ValueError(
                f"modes name params that are not trainable params of the module: {sorted(unknown)}"
            )
        fused = fused_wgrad_modules(module)
        self.requirements = tuple(requirements) + tuple(
            r for _, m in fused for r in m.wgrad_requirements()
        )

        # [Note: one plan request] (aligndp/plan/request.py): ``plan`` is what parallelize()
        # and `aligndp layout` plan; without one, config and modes make the request
        specs = [ParamSpec(n, tuple(p.shape), p.dtype) for n, p in named]
        if plan is None:
            plan = PlanRequest(
                specs=tuple(specs),
                dp_size=self.dp_size,
                modes=modes,
                bucket_numel=config.bucket_numel,
                start_alignment=config.start_alignment,
                grad_dtype=config.grad_dtype,
            )
        elif modes:
            raise ValueError("give modes inside the plan request, not next to it")
        layouts = plan_buffers(
            plan.bind(specs, dp_size=self.dp_size, requirements=self.requirements)
        )
        if self.world_size > 1:
            # [Note: ranks agree] in agreement.py, before any shape-dependent collective
            check_ranks_agree(module.named_parameters(), layouts, group=process_group)
            prepare_side_group(process_group)
        if config.broadcast_at_wrap and self.world_size > 1:
            self._broadcast_from_rank0()
        by_name = dict(named)
        with binding():
            self.flat_buffers: list[FlatBuffer] = [
                FlatBuffer(
                    layout,
                    [by_name[s.name] for s in sorted(layout.params, key=lambda s: s.index)],
                    with_param_data=layout.mode is not Mode.REPLICATED,
                    allocator=self.collectives,
                )
                for layout in layouts
            ]
        self.param_names: dict[nn.Parameter, str] = {p: n for n, p in named}
        self.params: list[nn.Parameter] = [p for _, p in named]
        """Trainable params in registration order (the order of the agreement flags)."""
        self.index: ParamIndex = param_index(self.flat_buffers, self.params, rank=self.rank)
        """The one param -> (buffer, bucket, slot, owned piece) index, built here once and
        shared with the param gather and the optimizer parts."""
        self._slot: Mapping[nn.Parameter, GradSlot] = self.index.slots
        self.bucket_refs: list[BucketRef] = list(self.index.refs)
        self._init_grad_sync()
        self.data_touched: set[nn.Parameter] = set()
        """Params whose ``.data`` was used since the optimizer's last step (see
        wrapped_param.WrappedParameter)."""
        self.param_gather = ParamGather(self.index, module=module, collectives=self.collectives)
        """The all-gather of sharded params after each step; the optimizer calls into it."""
        self._joined: _Join | None = None
        self._replaced = False
        self._comm_hook: str | None = None
        self._claim_params(fused)

    # ---- ownership of the module's params (wrapping again replaces the old wrapper) ----
    def _claim_params(self, fused) -> None:
        self._eager_zero: set[nn.Parameter] = claim_params(self, self.params)
        me = weakref.ref(self)

        def hook(param: nn.Parameter, _me=me) -> None:
            owner = _me()
            if owner is not None and not owner._replaced:
                owner._on_grad(param)

        self._hooks = [p.register_post_accumulate_grad_hook(hook) for p in self.params]
        gather = self.param_gather  # state_dict() reads the params: their gathers first
        self._hooks.append(
            self.module.register_state_dict_pre_hook(lambda *_a, **_k: gather.wait_all())
        )
        for _, m in fused:
            m.bind_grad_sink(self)

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
        """Rank 0's module buffers to every rank, one broadcast per dtype (none without buffers)."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for b in self.module.buffers():
            by_dtype.setdefault(b.dtype, []).append(b)
        for tensors in by_dtype.values():
            flat = torch.cat([t.reshape(-1) for t in tensors])
            dist.broadcast(flat, src=self._src, group=self.process_group)
            offset = 0
            for t in tensors:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()

    @property
    def layouts(self) -> list[BufferLayout]:
        return [buf.layout for buf in self.flat_buffers]

    def buffers_for(self, mode: Mode) -> list[FlatBuffer]:
        return [b for b in self.flat_buffers if b.layout.mode is mode]

    def wait_for_params(self) -> None:
        """Wait for every param all-gather still in flight (``overlap_param_gather=True``). Any
        read of a param already waits for its own gather ([Note: reads wait for the gather] in
        wrapped_param.py); call this before reading through an alias taken before the step (a
        view, a ``data_ptr()``) or to end the step's communication. A no-op otherwise."""
        self.param_gather.wait_all()

    # [Note: compiled forward]: torch.compile runs this frame eagerly (the bookkeeping: step
    # states, arming, gathers) and compiles the module's own forward inside it
    @torch.compiler.disable(recursive=False)
    def forward(self, *args, **kwargs):
        if self._replaced:
            raise RuntimeError(
                "this DataParallel was replaced by a newer wrap of the same module; use the new one"
            )
        if self._joined is not None:
            self._joined.forward()
        if self.config.broadcast_buffers and self.world_size > 1:
            self._broadcast_buffers()
        if torch.is_grad_enabled():
            self._reopen()  # before autograd accumulates into a ShardedGrad
            self.arm()  # [Note: gradient as bucket view]
        out = self.module(*args, **kwargs)
        gather = self.param_gather
        if gather.in_flight:
            self._unwaited |= gather.pending_params()
            gather.wait_all()
        return out

    @contextlib.contextmanager
    def join(self) -> Iterator[None]:
        """Uneven inputs: train inside ``with model.join():``. When one rank runs out of batches
        while others still train, every rank raises the same ``ValueError`` at its next forward
        (one tiny all-reduce per forward while inside) instead of hanging."""
        self._joined = joined = _Join(self)
        try:
            yield
        finally:
            self._joined = None
        joined.leave()  # only after a normal exit: after an error the peers are out of step

    def register_comm_hook(self, state: object, hook) -> None:
        """torch DDP's ``register_comm_hook``, once, for torch's own compression hooks with
        ``sharding="none"``; other hooks and sharded modes are refused ([Note: comm hooks] in
        aligndp/runtime/comm_hooks.py)."""
        from aligndp.runtime.comm_hooks import with_comm_hook

        if self._comm_hook is not None:
            raise RuntimeError(f"register_comm_hook can only be called once; {self._comm_hook}")
        self.collectives = with_comm_hook(self.collectives, state, hook, layouts=self.layouts)
        self._comm_hook = f"{getattr(hook, '__qualname__', hook)} is registered"

    def remove_hooks(self) -> None:
        """Detach from the module (hooks and fused-wgrad sinks); buffers stay bound."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        for _, m in fused_wgrad_modules(self.module):
            m.bind_grad_sink(None)


class _Join:
    """The bookkeeping of :meth:`DataParallel.join`: one flag all-reduce per forward."""

    def __init__(self, model: DataParallel) -> None:
        self.model = model

    def _still_training(self, flag: int) -> int:
        t = torch.tensor([flag], dtype=torch.int32, device=self.model.device)
        self.model.collectives.all_reduce_sum(t)
        return int(t.item())

    def _message(self, training: int) -> str:
        ws = self.model.world_size
        return (
            f"uneven inputs: {ws - training} of {ws} rank(s) ran out of batches while "
            f"{training} still train; give every rank the same number of batches (e.g. "
            "DistributedSampler(drop_last=True), or drop the last incomplete batch)"
        )

    def forward(self) -> None:
        training = self._still_training(1)
        if training < self.model.world_size:
            raise ValueError(self._message(training))

    def leave(self) -> None:
        training = self._still_training(0)
        if training:
            raise ValueError(self._message(training))
