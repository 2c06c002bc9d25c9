"""The named build steps of ``parallelize()``, each a function of its inputs.

    read_inputs   parallelize's arguments -> Inputs (checked, torch DDP's keywords taken,
                  the optimizer resolved and its options checked by torch)
    plan_request  the model's shapes + Inputs -> PlanRequest ([Note: one plan request])
    DataParallel  model + PlanRequest -> buffers, the param index, one group per bucket and
                  the wrapper over them (aligndp/runtime/ddp.py)
    attach_masters  the wrapper + Inputs -> each bucket's masters of this rank's owned pieces
                  (``bucket.masters``, [Note: masters with the buckets] in
                  aligndp/runtime/masters.py)
    optimizer_parts  the wrapper + Inputs -> the optimizer parts (ZeRO-1, whole-matrix,
                  replicated), stepping the buckets' masters
    build_optimizer  parts -> the one torch-optimizer face over them
    first_gather  the wrapper -> FP8 gathers run once, so the first forward reads gathered
                  weights (last: it reads the masters)

Each step reads only what the step before returned; nothing below calls back up here while
building. [Note: one plan request] (aligndp/plan/request.py): :func:`plan_request` is the one
place a model and parallelize's arguments become a
:class:`~aligndp.plan.request.PlanRequest`; ``aligndp layout`` prints what it plans.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn as nn

from aligndp.optim.base import DataParallelOptimizer, check_max_grad_norm, check_options
from aligndp.optim.composite import CompositeOptimizer, OptimizerPart, ReplicatedPart
from aligndp.optim.groups import ParamGroup, ParamGroupsArg, resolve_param_groups
from aligndp.optim.registry import resolve_optimizer
from aligndp.optim.sharded import ShardedOptimizer, ShardedPart, check_elementwise
from aligndp.optim.whole_matrix import WholeMatrixPart, WholeMatrixSpec, split_kwargs, torch_groups
from aligndp.plan.routing import Routing
from aligndp.plan.spec import (
    DEFAULT_BUCKET_NUMEL,
    Mode,
)
from aligndp.runtime.ddp import DataParallel, DDPConfig
from aligndp.runtime.gather_codec import GatherCodec
from aligndp.runtime.masters import bucket_masters
from aligndp.runtime.mesh import data_parallel_groups
from aligndp.user_input import (
    check_fp8_param_gather,
    check_master_weights,
    check_parallelize_inputs,
    take_torch_ddp_kwargs,
)

__all__ = [
    "Inputs",
    "read_inputs",
    "gather_codec",
    "attach_masters",
    "optimizer_parts",
    "build_optimizer",
    "first_gather",
]


@dataclasses.dataclass(frozen=True)
class Inputs:
    """parallelize()'s arguments, checked and resolved: what the later steps read."""

    sharding: str
    """``"none"`` or ``"zero1"``."""
    spec: WholeMatrixSpec | None
    """The whole-matrix optimizer (Muon), or None for an elementwise one."""
    opt_class: type[torch.optim.Optimizer] | None
    """The elementwise torch optimizer (None next to a whole-matrix ``spec``)."""
    options: dict
    """Options of ``opt_class``, or of the whole-matrix optimizer (lr in, ``fused`` chosen)."""
    adamw_options: dict
    """Options of the AdamW next to a whole-matrix optimizer (empty without one)."""
    groups: list[ParamGroup]
    """The user's param groups over the trainable params."""
    master_weights: bool
    """fp32 masters of 16-bit params in the zero1 parts (``master_weights`` None: True)."""
    max_grad_norm: float | None
    process_group: dist.ProcessGroup | None
    """The data-parallel group (``device_mesh``'s when torch DDP's keyword named one)."""
    config: DDPConfig
    """The wrapper's settings."""
    plan: dict
    """Keyword arguments of :func:`plan_request` besides the model."""


def read_inputs(
    model: nn.Module,
    *,
    optimizer: str | type[torch.optim.Optimizer],
    sharding: str,
    lr: float | None,
    process_group: dist.ProcessGroup | None,
    mesh: object | None,
    bucket_numel: int | None,
    wgrad: str | None,
    grad_dtype: torch.dtype | None,
    max_grad_norm: float | None,
    overlap: bool,
    start_alignment: int,
    check_finite: bool,
    on_nonfinite: str,
    broadcast_buffers: bool | None,
    overlap_param_gather: bool,
    param_groups: ParamGroupsArg,
    collectives: str,
    master_weights: bool | None,
    fp8_param_gather: bool,
    optimizer_kwargs: dict,
) -> Inputs:
    """Step 1: check parallelize's arguments and resolve them (before anything is wrapped,
    what torch refuses, such as a misspelt optimizer keyword, is raised as torch raises it)."""
    check_parallelize_inputs(model, optimizer)
    check_master_weights(master_weights, sharding)
    check_fp8_param_gather(
        fp8_param_gather, wgrad=wgrad, sharding=sharding, master_weights=master_weights
    )
    check_max_grad_norm(max_grad_norm)
    kwargs = dict(optimizer_kwargs)
    torch_ddp = take_torch_ddp_kwargs(
        model,
        kwargs,
        bucket_numel=bucket_numel,
        default_bucket_numel=DEFAULT_BUCKET_NUMEL,
        grad_dtype=grad_dtype,
        process_group=process_group,
        broadcast_buffers=broadcast_buffers,
    )
    found = resolve_optimizer(optimizer)
    spec = found if isinstance(found, WholeMatrixSpec) else None
    muon_filter = kwargs.pop("muon_filter", None) if spec is not None else None
    split = kwargs.pop("split", None) if spec is not None else None
    if lr is not None:
        kwargs["lr"] = lr
    options, adamw_options = _checked_options(model, found, spec, optimizer, sharding, kwargs)
    plan = {
        "optimizer": optimizer,
        "sharding": sharding,
        "dp_size": _shard_size(torch_ddp.process_group, mesh),
        "bucket_numel": torch_ddp.bucket_numel,
        "wgrad": wgrad,
        "grad_dtype": grad_dtype,
        "start_alignment": start_alignment,
        "muon_filter": muon_filter,
        "fp8_param_gather": fp8_param_gather,
        "split": split,
    }
    config = DDPConfig(
        overlap=overlap,
        bucket_numel=torch_ddp.bucket_numel,
        grad_dtype=grad_dtype,
        start_alignment=start_alignment,
        check_finite=check_finite,
        on_nonfinite=on_nonfinite,
        broadcast_at_wrap=torch_ddp.broadcast_at_wrap,
        broadcast_buffers=torch_ddp.broadcast_buffers,
        overlap_param_gather=overlap_param_gather,
        collectives=collectives,
    )
    return Inputs(
        sharding=sharding,
        spec=spec,
        opt_class=None if spec is not None else found,
        options=options,
        adamw_options=adamw_options,
        groups=resolve_param_groups(model, param_groups),
        master_weights=master_weights is not False,  # None: zero1's default, fp32 masters
        max_grad_norm=max_grad_norm,
        process_group=torch_ddp.process_group,
        config=config,
        plan=plan,
    )


def _checked_options(
    model: nn.Module,
    found: WholeMatrixSpec | type[torch.optim.Optimizer],
    spec: WholeMatrixSpec | None,
    optimizer: str | type[torch.optim.Optimizer],
    sharding: str,
    kwargs: dict,
) -> tuple[dict, dict]:
    """The optimizer's options and the AdamW's next to a whole-matrix one, each built once by
    torch over a probe tensor (its own errors) and given ``fused=True`` where it applies."""
    if spec is None:
        if sharding == "zero1":
            check_elementwise(found, kwargs)
        else:
            check_options(found, kwargs)
        if _use_fused_kernels(model, found, kwargs):
            kwargs["fused"] = True
        return kwargs, {}
    whole_kwargs, adamw_kwargs = split_kwargs(spec, str(optimizer), kwargs)
    check_options(spec.optimizer_class, whole_kwargs)
    check_options(torch.optim.AdamW, adamw_kwargs)
    if _use_fused_kernels(model, torch.optim.AdamW, adamw_kwargs):
        adamw_kwargs["fused"] = True
    return whole_kwargs, adamw_kwargs


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


def gather_codec(model: nn.Module, fp8_param_gather: bool) -> GatherCodec | None:
    """The codec of ``fp8_param_gather`` ([Note: FP8 param gather] in
    aligndp/runtime/gather_codec.py; the api layer wires lowp's codec into the runtime)."""
    if not fp8_param_gather:
        return None
    from aligndp.lowp.fp8_gather import Fp8TensorGatherCodec

    return Fp8TensorGatherCodec(model)


def attach_masters(ddp: DataParallel, inputs: Inputs) -> None:
    """Step 4: each bucket that gathers params keeps the masters of this rank's owned pieces
    (fp32 copies of 16-bit params unless ``master_weights=False``, and of FP8-gathered ones;
    else the ``param_data`` views), which the optimizer parts step and its gather casts back."""
    for bucket in ddp.buckets:
        if bucket.gathers:
            bucket.keep_masters(
                bucket_masters(
                    bucket.buffer, bucket.slots, bucket.params, master_weights=inputs.master_weights
                )
            )


def first_gather(ddp: DataParallel) -> None:
    """Step 7, last (it reads the masters): with FP8 param gathers ([Note: FP8 param gather] in
    aligndp/runtime/gather_codec.py) every bucket is gathered once now, so that from the first
    forward on the layers read gathered weights; nothing to do otherwise."""
    if ddp.param_gather.coded is not None:
        ddp.param_gather.launch_rest()
        ddp.param_gather.wait_all()


def optimizer_parts(
    ddp: DataParallel, inputs: Inputs, routing: Routing | None
) -> list[OptimizerPart]:
    """Step 5: the optimizer parts over the wrapped model's buffers and their masters."""
    named = dict(ddp.module.named_parameters())
    if inputs.spec is not None:
        return _whole_matrix_parts(
            ddp,
            inputs.spec,
            routing,
            inputs.groups,
            inputs.sharding == "zero1",
            inputs.options,
            inputs.adamw_options,
        )
    if inputs.sharding == "zero1":
        sharded = ShardedPart(
            ddp,
            ddp.buffers_for(Mode.SHARDED),
            inputs.opt_class,
            groups=inputs.groups,
            **inputs.options,
        )
        return [sharded]
    inner = inputs.opt_class(
        [{"params": [named[n] for n in g.names], **g.options} for g in inputs.groups],
        **inputs.options,
    )
    return [ReplicatedPart(ddp, inner, elementwise_state=True)]


def build_optimizer(
    ddp: DataParallel, parts: list[OptimizerPart], inputs: Inputs, routing: Routing | None
) -> DataParallelOptimizer:
    """Step 6: the one torch-optimizer face over ``parts`` (ZeRO-1 alone: a
    :class:`~aligndp.optim.sharded.ShardedOptimizer`, which shows its masters)."""
    if inputs.spec is None and inputs.sharding == "zero1":
        return ShardedOptimizer(ddp, parts[0], max_grad_norm=inputs.max_grad_norm)
    return CompositeOptimizer(ddp, parts, routing=routing, max_grad_norm=inputs.max_grad_norm)


def _whole_matrix_parts(
    ddp: DataParallel,
    spec: WholeMatrixSpec,
    routing: Routing,
    groups: list[ParamGroup],
    zero1: bool,
    whole_kwargs: dict,
    adamw_kwargs: dict,
) -> list[OptimizerPart]:
    """The whole-matrix part and the AdamW part; each of ``groups`` is cut into its
    whole-matrix and its AdamW params, with the same options."""
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
                **adamw_kwargs,
            )
        )
    elif routing.adamw:
        tensors = {n: named[n] for n in routing.adamw}
        inner = torch.optim.AdamW(torch_groups(cut(routing.adamw), tensors), **adamw_kwargs)
        parts.append(ReplicatedPart(ddp, inner, elementwise_state=True))
    return parts
