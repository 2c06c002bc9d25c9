"""``parallelize()``: the one door. A short pipeline of named build steps (aligndp/build.py):

    inputs -> plan -> buffers, buckets and the wrapper (DataParallel) -> the buckets'
    masters -> optimizer parts -> the optimizer -> the first (FP8) gather

[Note: one plan request] (aligndp/plan/request.py): :func:`plan_request` is the one place a
model and parallelize's arguments become a :class:`~aligndp.plan.request.PlanRequest`;
``parallelize`` hands it to ``DataParallel`` and ``aligndp layout`` prints what it plans.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from aligndp.build import (
    attach_masters,
    build_optimizer,
    first_gather,
    gather_codec,
    optimizer_parts,
    read_inputs,
)
from aligndp.optim.base import DataParallelOptimizer
from aligndp.optim.groups import ParamGroupsArg
from aligndp.optim.registry import resolve_optimizer
from aligndp.optim.whole_matrix import WholeMatrixSpec
from aligndp.plan.fused import fused_wgrad_modules
from aligndp.plan.request import SHARDINGS, PlanRequest, modes_for_sharding
from aligndp.plan.routing import MuonFilter, Routing, route_params
from aligndp.plan.spec import (
    DEFAULT_BUCKET_NUMEL,
    DEFAULT_START_ALIGNMENT,
    ParamSpec,
    Requirement,
    numel_cost,
)
from aligndp.plan.split import SplitPolicy
from aligndp.runtime.ddp import DataParallel

__all__ = ["parallelize", "plan_request", "SHARDINGS"]


def _wgrad_requirements(wgrad: str | None) -> list[Requirement]:
    """The registered recipe's requirements (aligndp.lowp.recipes; ValueError naming the
    registered recipes for an unknown one); None is the ``none`` recipe."""
    from aligndp.lowp.recipes import wgrad_requirements

    return wgrad_requirements("none" if wgrad is None else wgrad)


def _fp8_gather_dtypes(model: nn.Module) -> dict[str, torch.dtype]:
    """The weights ``fp8_param_gather`` gathers in FP8 ([Note: FP8 param gather] in
    aligndp/runtime/gather_codec.py): those of the layers converted to ``fp8-tensor``."""
    from aligndp.lowp.fp8_gather import Fp8TensorGatherCodec, fp8_gathered_weights

    names = fp8_gathered_weights(model)
    if not names:
        raise ValueError(
            "fp8_param_gather=True, but no trainable weight of the model is in a layer "
            "converted to fp8-tensor, so nothing would be gathered in FP8: convert first "
            "(aligndp.lowp.convert_to_mxfp8(model, backend='fp8-tensor'; layers='all' converts "
            "every layer it can run, `aligndp train --wgrad-layers all`) or drop fp8_param_gather"
        )
    return dict.fromkeys(names, Fp8TensorGatherCodec.dtype)


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
    fp8_param_gather: bool = False,
    split: SplitPolicy | bool | None = None,
) -> tuple[PlanRequest, Routing | None]:
    """The plan :func:`parallelize` asks for, and the routing of a whole-matrix optimizer.

    Pure in the model's shapes (a model on the meta device will do): the trainable params,
    the sharding's modes (whole-matrix params layerwise under zero1), the wgrad recipe's and
    fused modules' requirements, the whole-matrix optimizer's owner cost and split policy
    (``split``: None the optimizer's, False none, or a :class:`SplitPolicy`) and, with
    ``fp8_param_gather``, the weights gathered in FP8.
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
        gather_dtypes=_fp8_gather_dtypes(model) if fp8_param_gather else {},
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
    fp8_param_gather: bool = False,
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
    inputs = read_inputs(
        model,
        optimizer=optimizer,
        sharding=sharding,
        lr=lr,
        process_group=process_group,
        mesh=mesh,
        bucket_numel=bucket_numel,
        wgrad=wgrad,
        grad_dtype=grad_dtype,
        max_grad_norm=max_grad_norm,
        overlap=overlap,
        start_alignment=start_alignment,
        check_finite=check_finite,
        on_nonfinite=on_nonfinite,
        broadcast_buffers=broadcast_buffers,
        overlap_param_gather=overlap_param_gather,
        param_groups=param_groups,
        collectives=collectives,
        master_weights=master_weights,
        fp8_param_gather=fp8_param_gather,
        optimizer_kwargs=optimizer_kwargs,
    )
    request, routing = plan_request(model, **inputs.plan)
    ddp = DataParallel(  # buffers from the plan, one group per bucket, the wrapper
        model,
        process_group=inputs.process_group,
        mesh=mesh,
        config=inputs.config,
        plan=request,
        gather_codec=gather_codec(model, fp8_param_gather),
    )
    attach_masters(ddp, inputs)  # each bucket's masters of this rank's owned pieces
    parts = optimizer_parts(ddp, inputs, routing)
    optimizer = build_optimizer(ddp, parts, inputs, routing)
    first_gather(ddp)  # last: FP8 gathers read the masters
    return ddp, optimizer
