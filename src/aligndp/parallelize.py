"""``parallelize()``: the one door. Routes params, derives requirements, builds DDP + optimizer.

[Note: one plan request] (aligndp/plan/request.py): :func:`plan_request` is the one place a
model and parallelize's arguments become a :class:`~aligndp.plan.request.PlanRequest`;
``parallelize`` hands it to ``DataParallel`` and ``aligndp layout`` prints what it plans.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from aligndp.optim.base import DataParallelOptimizer, check_max_grad_norm, check_options
from aligndp.optim.composite import CompositeOptimizer, OptimizerPart, ReplicatedPart
from aligndp.optim.groups import ParamGroup, ParamGroupsArg, resolve_param_groups
from aligndp.optim.registry import resolve_optimizer
from aligndp.optim.sharded import ShardedOptimizer, ShardedPart, check_elementwise
from aligndp.optim.whole_matrix import WholeMatrixPart, WholeMatrixSpec, split_kwargs, torch_groups
from aligndp.plan.fused import fused_wgrad_modules
from aligndp.plan.request import SHARDINGS, PlanRequest, modes_for_sharding
from aligndp.plan.routing import MuonFilter, Routing, route_params
from aligndp.plan.spec import (
    DEFAULT_BUCKET_NUMEL,
    DEFAULT_START_ALIGNMENT,
    Mode,
    ParamSpec,
    Requirement,
    numel_cost,
)
from aligndp.plan.split import SplitPolicy
from aligndp.runtime.ddp import DataParallel, DDPConfig
from aligndp.runtime.mesh import data_parallel_groups
from aligndp.user_input import check_master_weights, check_parallelize_inputs, take_torch_ddp_kwargs

__all__ = ["parallelize", "plan_request", "SHARDINGS"]


def _wgrad_requirements(wgrad: str | None) -> list[Requirement]:
    """The registered recipe's requirements (aligndp.lowp.recipes; ValueError naming the
    registered recipes for an unknown one); None is the ``none`` recipe."""
    from aligndp.lowp.recipes import wgrad_requirements

    return wgrad_requirements("none" if wgrad is None else wgrad)


def _shard_size(process_group: dist.ProcessGroup | None, mesh: object | None) -> int:
    """The plan's dp_size: the ranks that shard among themselves (a mesh's shard dim)."""
    if not dist.is_initialized():
        return 1
    return dist.get_world_size(data_parallel_groups(process_group, mesh).shard)


def _use_fused_kernels(model: nn.Module, opt_class: type, optimizer_kwargs: dict) -> bool:
    """On CUDA, torch's fused kernel for AdamW/Adam/SGD unless the caller picked an
    implementation (``fused``/``foreach``): same maths as torch's default foreach path, one
    launch per tensor list instead of several, and what torch DDP users run. The one decision
    for the elementwise optimizer alone and for the AdamW next to a whole-matrix one."""
    if "fused" in optimizer_kwargs or "foreach" in optimizer_kwargs:
        return False
    if opt_class not in (torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD):
        return False
    return any(p.is_cuda for p in model.parameters())


def plan_request(
    model: nn.Module,
    *,
    optimizer: str | type[torch.optim.Optimizer] = "adamw",
    sharding: str = "none",
    dp_size: int = 1,
    bucket_numel: int | None = DEFAULT_BUCKET_NUMEL,
    wgrad: str | None = None,
    grad_dtype: torch.dtype | None = None,
    start_alignment: int = DEFAULT_START_ALIGNMENT,
    muon_filter: MuonFilter | None = None,
    split: SplitPolicy | bool | None = None,
) -> tuple[PlanRequest, Routing | None]:
    """The plan :func:`parallelize` asks for, and the routing of a whole-matrix optimizer.

    Pure in the model's shapes (a model on the meta device will do): the trainable params,
    the sharding's modes (whole-matrix params layerwise under zero1), the wgrad recipe's and
    fused modules' requirements and the whole-matrix optimizer's owner cost and split policy
    (``split``: None the optimizer's, False none, or a :class:`SplitPolicy`).
    """
    found = resolve_optimizer(optimizer)
    spec = found if isinstance(found, WholeMatrixSpec) else None
    routing = None
    if spec is not None:
        routing = route_params(
            model, muon_filter=muon_filter or spec.select, optimizer=str(optimizer).lower()
        )
    specs = tuple(ParamSpec.from_named_parameters(model.named_parameters()))
    requirements = list(_wgrad_requirements(wgrad))
    requirements += [r for _, m in fused_wgrad_modules(model) for r in m.wgrad_requirements()]
    whole = routing.whole if routing is not None else ()
    request = PlanRequest(
        specs=specs,
        dp_size=dp_size,
        modes=modes_for_sharding(sharding, [s.name for s in specs], whole=whole),
        requirements=tuple(dict.fromkeys(requirements)),
        bucket_numel=bucket_numel,
        start_alignment=start_alignment,
        grad_dtype=grad_dtype,
        owner_cost=spec.cost if spec is not None else numel_cost,
        split=_split_policy(spec, split),
    )
    return request, routing


def _split_policy(spec: WholeMatrixSpec | None, split: SplitPolicy | bool | None):
    if split is None or split is True:
        return spec.split if spec is not None else None
    if split is False:
        return None
    if not isinstance(split, SplitPolicy):
        raise TypeError(
            f"split must be None (the optimizer's policy), False or an aligndp.SplitPolicy, "
            f"got {split!r}"
        )
    if spec is None or spec.split is None:
        raise ValueError("split= shares a Muon matrix's step over ranks: use optimizer='muon'")
    return split


def parallelize(
    model: nn.Module,
    *,
    optimizer: str | type[torch.optim.Optimizer] = "adamw",
    sharding: str = "none",
    lr: float | None = None,
    process_group: dist.ProcessGroup | None = None,
    mesh: object | None = None,
    bucket_numel: int | None = DEFAULT_BUCKET_NUMEL,
    wgrad: str | None = None,
    grad_dtype: torch.dtype | None = None,
    max_grad_norm: float | None = None,
    overlap: bool = True,
    start_alignment: int = DEFAULT_START_ALIGNMENT,
    check_finite: bool = False,
    on_nonfinite: str = "raise",
    broadcast_buffers: bool | None = True,
    overlap_param_gather: bool = False,
    param_groups: ParamGroupsArg = None,
    collectives: str = "torch",
    master_weights: bool | None = None,
    **optimizer_kwargs,
) -> tuple[DataParallel, DataParallelOptimizer]:
    """Wrap ``model`` for data parallelism over ``process_group`` and build its optimizer.

    Args:
        optimizer: ``"adamw"`` (default), ``"adam"``, ``"sgd"``, a torch optimizer class, or
            a registered whole-matrix optimizer (aligndp/optim/registry.py) such as
            ``"muon"``: ``torch.optim.Muon`` on the hidden 2-D matrices, ``torch.optim.AdamW``
            on the rest (aligndp/plan/routing.py; ``muon_filter=`` overrides). ``lr`` goes to
            both, an AdamW-sized lr: Muon's update is scaled to AdamW's RMS
            (``adjust_lr_fn="match_rms_adamw"`` by default, [Note: one lr for Muon and AdamW] in
            aligndp/optim/muon.py); ``muon_lr=`` / ``adamw_lr=`` set one part's lr. Other kwargs
            go to Muon (momentum, nesterov, ns_steps, adjust_lr_fn, weight_decay, ...) and
            ``adamw_<x>`` ones to AdamW (adamw_betas, adamw_weight_decay, ...). With
            ``sharding="zero1"`` each matrix is stepped whole by one owner rank (layer-wise
            buffers, owners balanced by the optimizer's cost) and AdamW is ZeRO-1; ``split=``
            (Muon: None its default policy, False never, or an ``aligndp.SplitPolicy``) lets a
            group of ranks share one large matrix's Newton–Schulz where balance needs it
            ([Note: split Newton–Schulz] in aligndp/plan/split.py).
        sharding: ``"none"`` (replicated, plain DDP) or ``"zero1"`` (sharded optimizer state).
        lr: learning rate; None keeps the torch optimizer's default.
        process_group: the data-parallel group (None: the default group).
        mesh: instead of ``process_group``, a torch ``DeviceMesh`` over every rank: 1-D (the
            same as its group) or 2-D with dims named ``("replicate", "shard")``: sharded
            modes shard over the shard dim and all-reduce each owned shard across the
            replicate dim ([Note: replicate x shard mesh] in aligndp/runtime/mesh.py).
        bucket_numel: elements per bucket (default 40 M, as everywhere); None: one bucket per
            buffer.
        wgrad: a registered wgrad recipe (``aligndp.lowp.recipe_names()``: ``"none"``,
            ``"fp8"``, ``"mxfp8"``, ...) declares that its fused wgrad kernels write into the
            gradient buffers, so every buffer of every mode is planned for them.
        grad_dtype: gradient buffer dtype (None: each param's dtype).
        max_grad_norm: clip the global gradient 2-norm to this (None: no clipping).
        overlap: launch bucket collectives during backward.
        start_alignment: param start alignment in elements; consumers' requirements win.
        check_finite: check every gradient for NaN/Inf before it is reduced; the ranks agree
            at the end of backward and all do ``on_nonfinite``: ``"raise"`` a FloatingPointError
            naming the params, or ``"skip"`` the optimizer step (params and state untouched).
        broadcast_buffers: copy rank 0's module buffers to every rank at each forward (torch
            DDP's default; None: True), so BatchNorm statistics agree.
        param_groups: torch's ``[{"params": [...], **options}, ...]`` (params or their names) or
            a callable ``(name, param) -> options``; every trainable param in exactly one group.
            Works in every mode; with ``optimizer="muon"`` each group is cut into its Muon and
            AdamW params.
        overlap_param_gather: zero1: all-gather updated params during the next forward
            (each module waits for its own buckets) instead of at the end of ``step()``.
        collectives: the registered collectives backend (:class:`DDPConfig`'s ``collectives``).
        master_weights: how 16-bit (bf16/fp16) params are stepped ([Note: master weights] in
            aligndp/optim/sharded.py). None (default): ``sharding="zero1"`` keeps an fp32 master
            of each owned 16-bit param (state in fp32, cast back after every step) and
            ``"none"`` steps params in their dtype. False: every param is stepped in its own
            dtype in every mode, as torch DDP + the same torch optimizer does (bit for bit at
            dp 2 on gloo). True: fp32 masters; only ``sharding="zero1"`` keeps them
            (ValueError with ``"none"``).
        optimizer_kwargs: passed to the torch optimizer (torch's defaults otherwise; on CUDA
            AdamW/Adam/SGD get ``fused=True`` unless ``fused`` or ``foreach`` is given), and
            checked by building it before anything is wrapped (torch's own errors). torch
            DDP's constructor keywords are taken with their torch meaning
            (aligndp/user_input.py ``take_torch_ddp_kwargs``): ``bucket_cap_mb`` (MiB of the
            gradient dtype; instead of ``bucket_numel``), ``device_ids``/``output_device``
            naming the module's own device, ``init_sync``, ``forward_sync_buffers``, a 1-D
            ``device_mesh``, and the flags of what aligndp always does
            (``find_unused_parameters``, ``gradient_as_bucket_view``, ``static_graph``, ...);
            the rest (``mixed_precision``, ``delay_all_reduce_named_params``, ...) are refused
            naming the alternative.

    Usage reads like torch DDP: ``loss.backward(); opt.step(); opt.zero_grad()``;
    ``with model.no_sync():`` for micro-batches; ``model.module`` is the wrapped module;
    ``model.register_comm_hook(state, hook)`` takes torch's fp16/bf16 compression hooks
    (aligndp/runtime/comm_hooks.py).
    """
    check_parallelize_inputs(model, optimizer)
    check_master_weights(master_weights, sharding)
    check_max_grad_norm(max_grad_norm)
    torch_ddp = take_torch_ddp_kwargs(
        model,
        optimizer_kwargs,
        bucket_numel=bucket_numel,
        default_bucket_numel=DEFAULT_BUCKET_NUMEL,
        grad_dtype=grad_dtype,
        process_group=process_group,
        broadcast_buffers=broadcast_buffers,
    )
    bucket_numel, process_group = torch_ddp.bucket_numel, torch_ddp.process_group
    found = resolve_optimizer(optimizer)
    spec = found if isinstance(found, WholeMatrixSpec) else None
    muon_filter = optimizer_kwargs.pop("muon_filter", None) if spec is not None else None
    split = optimizer_kwargs.pop("split", None) if spec is not None else None
    if lr is not None:
        optimizer_kwargs["lr"] = lr
    # before wrapping, what torch refuses is raised as torch raises it (a misspelt keyword)
    if spec is None:
        if sharding == "zero1":
            check_elementwise(found, optimizer_kwargs)
        else:
            check_options(found, optimizer_kwargs)
        if _use_fused_kernels(model, found, optimizer_kwargs):
            optimizer_kwargs["fused"] = True
    else:
        whole_kwargs, adamw_kwargs = split_kwargs(spec, str(optimizer), optimizer_kwargs)
        check_options(spec.optimizer_class, whole_kwargs)
        check_options(torch.optim.AdamW, adamw_kwargs)
        if _use_fused_kernels(model, torch.optim.AdamW, adamw_kwargs):
            adamw_kwargs["fused"] = True
    request, routing = plan_request(
        model,
        optimizer=optimizer,
        sharding=sharding,
        dp_size=_shard_size(process_group, mesh),
        bucket_numel=bucket_numel,
        wgrad=wgrad,
        grad_dtype=grad_dtype,
        start_alignment=start_alignment,
        muon_filter=muon_filter,
        split=split,
    )
    config = DDPConfig(
        overlap=overlap,
        bucket_numel=bucket_numel,
        grad_dtype=grad_dtype,
        start_alignment=start_alignment,
        check_finite=check_finite,
        on_nonfinite=on_nonfinite,
        broadcast_at_wrap=torch_ddp.broadcast_at_wrap,
        broadcast_buffers=torch_ddp.broadcast_buffers,
        collectives=collectives,
    )
    groups = resolve_param_groups(model, param_groups)
    ddp = DataParallel(model, process_group=process_group, mesh=mesh, config=config, plan=request)
    gather = {"max_grad_norm": max_grad_norm, "overlap_param_gather": overlap_param_gather}
    masters = master_weights is not False  # None: zero1's default, fp32 masters
    if spec is None and sharding == "zero1":
        return ddp, ShardedOptimizer(
            ddp, found, groups=groups, master_weights=masters, **gather, **optimizer_kwargs
        )
    if spec is None:
        named = dict(model.named_parameters())
        inner = found(
            [{"params": [named[n] for n in g.names], **g.options} for g in groups],
            **optimizer_kwargs,
        )
        parts = [ReplicatedPart(ddp, inner, elementwise_state=True)]
    else:
        zero1 = sharding == "zero1"
        parts = _whole_matrix_parts(
            ddp, spec, routing, groups, zero1, whole_kwargs, adamw_kwargs, master_weights=masters
        )
    return ddp, CompositeOptimizer(ddp, parts, routing=routing, **gather)


def _whole_matrix_parts(
    ddp: DataParallel,
    spec: WholeMatrixSpec,
    routing: Routing,
    groups: list[ParamGroup],
    zero1: bool,
    whole_kwargs: dict,
    adamw_kwargs: dict,
    *,
    master_weights: bool,
) -> list[OptimizerPart]:
    """The whole-matrix part and the AdamW part; each of ``groups`` is cut into its
    whole-matrix and its AdamW params, with the same options. ``master_weights`` goes to the
    zero1 parts (the replicated ones step params in their dtype)."""
    named = dict(ddp.module.named_parameters())

    def cut(names: tuple[str, ...]) -> list[ParamGroup]:
        cut_groups = [
            ParamGroup(tuple(n for n in g.names if n in names), g.options) for g in groups
        ]
        return [g for g in cut_groups if g.names]

    parts: list[OptimizerPart] = []
    if routing.whole and zero1:
        whole = [(n, named[n]) for n in routing.whole]
        parts.append(
            WholeMatrixPart(
                ddp,
                whole,
                spec,
                groups=cut(routing.whole),
                options=whole_kwargs,
                master_weights=master_weights,
            )
        )
    elif routing.whole:
        tensors = {n: named[n] for n in routing.whole}
        inner = spec.optimizer_class(torch_groups(cut(routing.whole), tensors), **whole_kwargs)
        parts.append(ReplicatedPart(ddp, inner, elementwise_state=False))
    if routing.adamw and zero1:
        sharded = ddp.buffers_for(Mode.SHARDED)
        parts.append(
            ShardedPart(
                ddp,
                sharded,
                torch.optim.AdamW,
                groups=cut(routing.adamw),
                master_weights=master_weights,
                **adamw_kwargs,
            )
        )
    elif routing.adamw:
        tensors = {n: named[n] for n in routing.adamw}
        inner = torch.optim.AdamW(torch_groups(cut(routing.adamw), tensors), **adamw_kwargs)
        parts.append(ReplicatedPart(ddp, inner, elementwise_state=True))
    return parts
