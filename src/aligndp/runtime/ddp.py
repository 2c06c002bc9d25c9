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
left, waited, agreed with the other ranks in one small all-reduce (step_agreement.py) and
published ``param.grad`` (the reduced view, or a ``ShardedGrad`` in sharded modes). A
gradient arriving in REDUCED reopens the buffers first (``_reopen``), as torch accumulates
into ``param.grad``.

[Note: bucket readiness] (DESIGN.md), as the code does it:
Each param's autograd hook fires once per backward; a fused-wgrad layer marks its weight
once per use. Readiness hints are the counts of the last synchronised backward: a bucket
launches as soon as each of its params has fired as often as last time, and a bucket with a
param that had no gradient last time waits for the end of backward, so a param used for
the first time can never arrive after its bucket's collective started. Buckets launch
strictly in index order (bucket i waits for 0..i-1), so every rank issues the same sequence.
The first synchronised backward launches everything at its end.

[Note: lazy zeroing]
``zero_grad`` zeroes [Note: gradient as bucket view]'s buffers where autograd adds into the
views ([Note: deferring buckets are not zeroed] in grad_landing.py) and marks the other
params' ``main_grad`` stale: a first gradient is *copied* into its view, later ones added; a
view still stale at its bucket's launch (an unused param) is zeroed then. A param is stale
(unused) until something writes it; a fused wgrad kernel handed a stale view overwrites it
([Note: write, not accumulate] in aligndp/plan/fused.py). Padding is never written: zero.

[Note: gradient as bucket view]
Where a buffer's grad dtype is its params' dtype, ``forward`` (grad enabled) makes each param's
``param.grad`` its ``main_grad`` view when it is None (``Landing.arm``, grad_landing.py), as
torch DDP's ``gradient_as_bucket_view``: autograd's AccumulateGrad adds into the buffer
itself, and the post-accumulate hook only counts (identity check, its bucket's countdown: no
copy, no Python work per element). The hook copies only off this path: a param whose grad
dtype differs, a backward whose forward bypassed the wrapper, ``create_graph=True`` (autograd
replaces ``param.grad``). A fused-wgrad layer's weight is never armed: the layer returns no
autograd gradient, yet torch runs the weight's post-accumulate hook with ``param.grad`` as it
is; were that the view, the weight would arrive twice, and its bucket would never defer.
Zeroing whole buffers at ``zero_grad`` writes every element once; the copy it replaces read
and wrote them, and issued one kernel and one Python hook body per param. A param without a
gradient in the step shows ``param.grad`` None again after the reduction, as in torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
import torch.distributed as dist
import torch.nn as nn

from aligndp.plan.fused import fused_wgrad_modules
from aligndp.plan.request import PlanRequest, plan_buffers
from aligndp.plan.slots import BufferLayout
from aligndp.plan.spec import (
    Mode,
    ParamSpec,
    Requirement,
)
from aligndp.runtime.agreement import check_ranks_agree, prepare_side_group
from aligndp.runtime.bucket import make_buckets
from aligndp.runtime.buffer import FlatBuffer
from aligndp.runtime.collective_backends import make_collectives
from aligndp.runtime.collectives import Collectives, broadcast_by_dtype
from aligndp.runtime.compiled_overlap import CompiledOverlap
from aligndp.runtime.ddp_config import NONFINITE_ACTIONS, DDPConfig
from aligndp.runtime.forward_hooks import after_forward, before_forward
from aligndp.runtime.gather_codec import GatherCodec
from aligndp.runtime.join import Joinable, JoinableModel
from aligndp.runtime.mesh import MeshCollectives, data_parallel_groups
from aligndp.runtime.param_gather import ParamGather
from aligndp.runtime.pickling import reduce_wrapper
from aligndp.runtime.reducer import GradReducer
from aligndp.runtime.step_agreement import ReducedGrads
from aligndp.runtime.step_state import (
    BucketRef,
    ParamIndex,
    RoundReport,
    StepState,
    param_index,
)
from aligndp.runtime.wrapped_param import attach_to_module, binding, claim_params

__all__ = ["DDPConfig", "DataParallel", "BucketRef", "StepState", "NONFINITE_ACTIONS"]

_DEFAULT_CONFIG = DDPConfig()


class DataParallel(nn.Module, JoinableModel):
    """Wrap an unmodified module; keep its grads in aligned flat buffers reduced by bucket.

    ``modes`` maps param names to a :class:`~aligndp.plan.spec.Mode` (default: every param
    replicated, i.e. plain DDP). Params are grouped into one buffer per (mode, param dtype).
    Sharded and layerwise buffers also hold the params (``param.data`` becomes a view).
    ``plan`` (a :class:`~aligndp.plan.request.PlanRequest`, as ``aligndp.parallelize`` builds)
    replaces ``modes`` and the config's planning fields. ``mesh``: a torch ``DeviceMesh``
    instead of ``process_group`` ([Note: replicate x shard mesh] in mesh.py): ``dp_size`` and
    ``rank`` are then the shard group's, ``process_group``/``world_size`` every rank's.
    ``gather_codec``: how low-precision ``gather_dtype`` gathers encode ([Note: FP8 param gather]).

    A thin module over three parts built here once: ``index`` (the
    :class:`~aligndp.runtime.step_state.ParamIndex`), ``buckets`` (one
    :class:`~aligndp.runtime.bucket.Bucket` per bucket, [Note: the bucket]) and
    ``reducer`` (the :class:`~aligndp.runtime.reducer.GradReducer`: hooks, step states,
    agreement), plus ``param_gather`` over the buckets; the methods below forward to them.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        process_group: dist.ProcessGroup | None = None,
        mesh: object | None = None,
        config: DDPConfig = _DEFAULT_CONFIG,
        modes: Mapping[str, Mode] | None = None,
        requirements: Iterable[Requirement] = (),
        plan: PlanRequest | None = None,
        gather_codec: GatherCodec | None = None,
    ) -> None:
        super().__init__()
        Joinable.__init__(self)  # torch's Join: [Note: join] in runtime/join.py
        if not isinstance(module, nn.Module):
            raise TypeError(f"DataParallel wraps an nn.Module, got {type(module).__name__}")
        if not dist.is_initialized():
            raise ValueError(
                "torch.distributed is not initialised: call dist.init_process_group() first"
            )
        self.module = module
        groups = data_parallel_groups(process_group, mesh)
        self.process_group = process_group = groups.world
        self.world_size = dist.get_world_size(process_group)
        self.world_rank = dist.get_rank(process_group)
        self.config = config
        self._collectives = make_collectives(config.collectives, group=groups.shard)
        if groups.replicas > 1:
            self._collectives = MeshCollectives(self._collectives, groups)
        self.dp_size, self.rank = self._collectives.dp_size, self._collectives.rank
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not named:  # torch DDP's RuntimeError
            raise RuntimeError(
                "the module has no trainable params (requires_grad=True): "
                "nothing to data-parallelise; run it without a wrapper"
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
        self.plan_request = plan  # what torch.save(model) keeps (runtime/pickling.py)
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
                    allocator=self._collectives,
                )
                for layout in layouts
            ]
        self.param_names: dict[nn.Parameter, str] = {p: n for n, p in named}
        self.params: list[nn.Parameter] = [p for _, p in named]
        """Trainable params in registration order (the order of the agreement flags)."""
        self.index: ParamIndex = param_index(self.flat_buffers, self.params, rank=self.rank)
        """The one param -> (buffer, bucket, slot, owned piece) index, built here once and
        shared with the param gather and the optimizer parts."""
        self.bucket_refs: list[BucketRef] = list(self.index.refs)
        self.buckets = make_buckets(self.index, collectives=self._collectives, codec=gather_codec)
        """One per bucket, in launch order: readiness, landing, reduce, masters and gather
        ([Note: the bucket])."""
        self.data_touched: set[nn.Parameter] = set()
        """Params whose ``.data`` was used since the optimizer's last step (see
        wrapped_param.WrappedParameter)."""
        self.param_gather = ParamGather(
            self.buckets,
            index=self.index,
            module=module,
            collectives=self._collectives,
            overlap=config.overlap_param_gather,
        )
        """The order of the param all-gathers after each step; the optimizer calls into it."""
        self._comm_hook: str | None = None
        self.reducer = GradReducer(
            self.index,
            self.buckets,
            params=self.params,
            names=self.param_names,
            config=config,
            collectives=self._collectives,
            rank=self.world_rank,
            device=self.device,
            eager_zero=claim_params(self, self.params),
            fused={m.weight for _, m in fused},
        )
        self.reducer.param_gather = self.param_gather  # the sink's param_writes() counts its writes
        """Gradient hooks, step states and the agreement ([Note: step states])."""
        collecting = self.reducer.collecting  # [Note: one rank collects at the end]: no hooks
        hooks = [] if collecting else zip(self.params, self.reducer.hooks, self.reducer.pre_hooks)
        self._hooks = [
            h
            for p, hook, pre in hooks
            for h in (p.register_hook(pre), p.register_post_accumulate_grad_hook(hook))
        ]
        # state_dict() waits for gathers, layers write to the reducer: [Note: dropped wrappers]
        attach_to_module(self, self._hooks, self.reducer, self.param_gather, [m for _, m in fused])
        self._in_call = False  # between our forward pre-hook and hook ([Note: compiled forward])
        self.compiled_overlap = CompiledOverlap.of(self)  # [Note: compiled overlap]
        self.register_forward_pre_hook(before_forward)
        self.register_forward_hook(after_forward, always_call=True)  # also when forward raises

    @property
    def collectives(self) -> Collectives:
        """The backend that reduces, gathers and allocates ([Note: collectives seam])."""
        return self._collectives

    @collectives.setter
    def collectives(self, value: Collectives) -> None:
        self._collectives = self.reducer.collectives = self.param_gather.collectives = value
        for bucket in self.buckets:
            bucket.collectives = value

    # ---- ownership of the module's params (wrapping again replaces the old wrapper) ----
    @property
    def _replaced(self) -> bool:
        return self.reducer.replaced

    @_replaced.setter
    def _replaced(self, value: bool) -> None:
        self.reducer.replaced = value

    # ---- the gradient reducer's public face ([Note: step states]) ----
    @property
    def state(self) -> StepState:
        return self.reducer.state

    @property
    def nonfinite(self) -> str | None:
        """The last reduction's agreed message when a gradient was not finite, else None."""
        return self.reducer.nonfinite

    @property
    def last_round(self) -> RoundReport | None:
        """What the last synchronised backward did."""
        return self.reducer.last_round

    def finish_grad_sync(self) -> ReducedGrads:
        """Wait for param gathers in flight (a step writes the shards), launch what is left,
        wait, agree, publish ``param.grad`` (by itself at the end of every synchronised
        backward) and return the reduced gradients' view ([Note: reduced grads view])."""
        return self.reducer.grads_for_step()

    def no_sync(self):
        """Accumulate gradients locally (micro-batches); the next backward outside syncs them."""
        return self.reducer.no_sync()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Same as ``opt.zero_grad()`` ([Note: lazy zeroing])."""
        self.reducer.zero_grad(set_to_none)

    def zero_grad_buffer(self) -> None:
        """Start a new step: every ``main_grad`` counts as zero, every ``param.grad`` dropped."""
        self.reducer.zero_grad_buffer()

    def buckets_in_flight(self) -> list[BucketRef]:
        """Buckets whose gradient collective was launched and not yet waited for."""
        return self.reducer.buckets_in_flight()

    def main_grad_view(self, param: nn.Parameter) -> torch.Tensor:
        """``param.main_grad`` (the view, zeroed first if stale: a touch counts as a gradient)."""
        return self.reducer.main_grad_view(param)

    # ---- params and buffers ----
    def _broadcast_from_rank0(self) -> None:
        with torch.no_grad():
            for t in list(self.module.parameters()) + list(self.module.buffers()):
                dist.broadcast(t.data, src=self.global_rank(0), group=self.process_group)

    def global_rank(self, rank: int) -> int:
        """The global rank of ``rank`` of ``process_group``."""
        group = self.process_group
        return dist.get_global_rank(group, rank) if group is not None else rank

    def _broadcast_buffers(self, src: int = 0) -> None:
        """Rank ``src``'s module buffers to every rank, one broadcast per dtype (none without
        buffers)."""
        buffers = list(self.module.buffers())
        broadcast_by_dtype(buffers, src=self.global_rank(src), group=self.process_group)

    @property
    def layouts(self) -> list[BufferLayout]:
        return [buf.layout for buf in self.flat_buffers]

    def buffers_for(self, mode: Mode) -> list[FlatBuffer]:
        return [b for b in self.flat_buffers if b.layout.mode is mode]

    def wait_for_params(self) -> None:
        """Wait for every param all-gather still in flight (``overlap_param_gather=True``). Any
        read of a param already waits for its own gather ([Note: reads wait for the gather] in
        param_gather.py); call this before reading through an alias taken before the step (a
        view, a ``data_ptr()``) or to end the step's communication. A no-op otherwise."""
        self.param_gather.wait_all()

    # [Note: compiled forward] (DESIGN.md): the step's bookkeeping runs in the wrapper's own
    # forward pre-hook and hook, which Dynamo never traces; forward is the module's call alone
    def forward(self, *args, **kwargs):
        if not self._in_call:  # model.forward(...) itself: the hooks did not run
            before_forward(self, args)
            out = None
            try:
                out = self.module(*args, **kwargs)
            finally:  # as the always_call hook: no stale in-call mark after an error
                after_forward(self, args, out)
            return out
        return self.module(*args, **kwargs)

    def __reduce_ex__(self, protocol):  # torch.save(model): runtime/pickling.py
        return reduce_wrapper(self)

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
