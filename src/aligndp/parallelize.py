"""``parallelize()``: the one door. Routes params, derives requirements, builds DDP + optimizer."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from aligndp.optim.base import DataParallelOptimizer, resolve_optimizer_class
from aligndp.optim.composite import CompositeOptimizer, ReplicatedPart
from aligndp.optim.groups import ParamGroupsArg, resolve_param_groups
from aligndp.plan.layout import DEFAULT_START_ALIGNMENT, Requirement
from aligndp.runtime.ddp import DataParallel, DDPConfig
from aligndp.user_input import check_parallelize_inputs

__all__ = ["parallelize", "SHARDINGS", "WGRAD_RECIPES"]

SHARDINGS = ("none", "zero1")
WGRAD_RECIPES = (None, "none", "fp8", "mxfp8")


def _wgrad_requirements(wgrad: str | None) -> list[Requirement]:
    if wgrad not in WGRAD_RECIPES:
        raise ValueError(f"unknown wgrad recipe {wgrad!r}: choose one of none, fp8, mxfp8")
    if wgrad in (None, "none"):
        return []
    from aligndp.lowp.recipes import wgrad_requirements

    return wgrad_requirements(wgrad)


def _use_fused_kernels(model: nn.Module, opt_class: type, optimizer_kwargs: dict) -> bool:
    """On CUDA, torch's fused kernel for AdamW/Adam/SGD unless the caller picked an
    implementation (``fused``/``foreach``): same maths as torch's default foreach path, one
    launch per tensor list instead of several, and what torch DDP users run."""
    if "fused" in optimizer_kwargs or "foreach" in optimizer_kwargs:
        return False
    if opt_class not in (torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD):
        return False
    return any(p.is_cuda for p in model.parameters())


def parallelize(
    model: nn.Module,
    *,
    optimizer: str | type[torch.optim.Optimizer] = "adamw",
    sharding: str = "none",
    lr: float | None = None,
    process_group: dist.ProcessGroup | None = None,
    bucket_numel: int | None = None,
    wgrad: str | None = None,
    grad_dtype: torch.dtype | None = None,
    max_grad_norm: float | None = None,
    overlap: bool = True,
    start_alignment: int = DEFAULT_START_ALIGNMENT,
    check_finite: bool = False,
    on_nonfinite: str = "raise",
    broadcast_buffers: bool = True,
    overlap_param_gather: bool = False,
    param_groups: ParamGroupsArg = None,
    **optimizer_kwargs,
) -> tuple[DataParallel, DataParallelOptimizer]:
    """Wrap ``model`` for data parallelism over ``process_group`` and build its optimizer.

    Args:
        optimizer: ``"adamw"`` (default), ``"adam"``, ``"sgd"``, a torch optimizer class, or
            ``"muon"``: ``torch.optim.Muon`` on the hidden 2-D matrices, ``torch.optim.AdamW``
            on the rest (aligndp/plan/routing.py; ``muon_filter=`` overrides). ``lr`` goes to both;
            other kwargs go to Muon (momentum, nesterov, ns_steps, adjust_lr_fn, weight_decay,
            ...) and ``adamw_<x>`` ones to AdamW (adamw_lr, adamw_betas, adamw_weight_decay,
            ...). With ``sharding="zero1"`` each matrix is stepped whole by one owner rank
            (layer-wise buffers) and AdamW is ZeRO-1.
        sharding: ``"none"`` (replicated, plain DDP) or ``"zero1"`` (sharded optimizer state).
        lr: learning rate; None keeps the torch optimizer's default.
        bucket_numel: elements per bucket; None uses :class:`DDPConfig`'s default (40 M).
        wgrad: ``"fp8"``/``"mxfp8"`` declares that fused wgrad kernels write into the
            gradient buffers, so every buffer of every mode is planned for them.
        grad_dtype: gradient buffer dtype (None: each param's dtype).
        max_grad_norm: clip the global gradient 2-norm to this (None: no clipping).
        overlap: launch bucket collectives during backward.
        start_alignment: param start alignment in elements; consumers' requirements win.
        check_finite: check every gradient for NaN/Inf before it is reduced; the ranks agree
            at the end of backward and all do ``on_nonfinite``: ``"raise"`` a FloatingPointError
            naming the params, or ``"skip"`` the optimizer step (params and state untouched).
        broadcast_buffers: copy rank 0's module buffers to every rank at each forward (torch
            DDP's default), so BatchNorm statistics agree.
        param_groups: torch's ``[{"params": [...], **options}, ...]`` (params or their names) or
            a callable ``(name, param) -> options``; every trainable param in exactly one group.
            Works in every mode; with ``optimizer="muon"`` each group is cut into its Muon and
            AdamW params.
        overlap_param_gather: zero1: all-gather updated params during the next forward
            (each module waits for its own buckets) instead of at the end of ``step()``.
        optimizer_kwargs: passed to the torch optimizer (torch's defaults otherwise; on CUDA
            AdamW/Adam/SGD get ``fused=True`` unless ``fused`` or ``foreach`` is given).

    Usage reads like torch DDP: ``loss.backward(); opt.step(); opt.zero_grad()``;
    ``with model.no_sync():`` for micro-batches; ``model.module`` is the wrapped module.
    """
    check_parallelize_inputs(model, optimizer)
    if sharding not in SHARDINGS:
        raise ValueError(f"unknown sharding {sharding!r}: choose one of {', '.join(SHARDINGS)}")
    if max_grad_norm is not None and not max_grad_norm > 0:
        raise ValueError(f"max_grad_norm must be > 0 or None, got {max_grad_norm!r}")
    requirements = _wgrad_requirements(wgrad)
    config_kwargs = dict(
        overlap=overlap,
        grad_dtype=grad_dtype,
        start_alignment=start_alignment,
        check_finite=check_finite,
        on_nonfinite=on_nonfinite,
        broadcast_buffers=broadcast_buffers,
    )
    if bucket_numel is not None:
        config_kwargs["bucket_numel"] = bucket_numel
    config = DDPConfig(**config_kwargs)
    if lr is not None:
        optimizer_kwargs["lr"] = lr

    groups = resolve_param_groups(model, param_groups)
    cuda = any(p.is_cuda for p in model.parameters())
    if isinstance(optimizer, str) and optimizer.lower() == "muon":
        from aligndp.optim.layerwise import parallelize_muon  # routing: aligndp/plan/routing.py

        return parallelize_muon(
            model,
            sharding=sharding,
            process_group=process_group,
            config=config,
            requirements=requirements,
            max_grad_norm=max_grad_norm,
            groups=groups,
            overlap_param_gather=overlap_param_gather,
            adamw_fused=cuda and not ({"adamw_fused", "adamw_foreach"} & set(optimizer_kwargs)),
            **optimizer_kwargs,
        )
    opt_class = resolve_optimizer_class(optimizer)
    if _use_fused_kernels(model, opt_class, optimizer_kwargs):
        optimizer_kwargs["fused"] = True
    if sharding == "zero1":
        from aligndp.optim.sharded import ShardedOptimizer, check_elementwise
        from aligndp.plan.layout import Mode

        check_elementwise(opt_class, optimizer_kwargs)  # before wrapping: refuse early
        modes = {n: Mode.SHARDED for g in groups for n in g.names}
        ddp = DataParallel(
            model,
            process_group=process_group,
            config=config,
            modes=modes,
            requirements=requirements,
        )
        return ddp, ShardedOptimizer(
            ddp,
            opt_class,
            groups=groups,
            max_grad_norm=max_grad_norm,
            overlap_param_gather=overlap_param_gather,
            **optimizer_kwargs,
        )
    ddp = DataParallel(model, process_group=process_group, config=config, requirements=requirements)
    named = dict(model.named_parameters())
    inner = opt_class(
        [{"params": [named[n] for n in g.names], **g.options} for g in groups], **optimizer_kwargs
    )
    return ddp, CompositeOptimizer(ddp, [ReplicatedPart(ddp, inner)], max_grad_norm=max_grad_norm)
