"""Checks of what a user hands to ``aligndp.parallelize``, before anything touches it.

Without them a tensor passed as the model fails deep inside as an ``AttributeError``, and an
optimizer instance passed where a class is expected prints its multi-line repr.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn as nn

from aligndp.optim.registry import known_optimizers
from aligndp.runtime.fake_world import gather_objects

__all__ = [
    "check_parallelize_inputs",
    "check_master_weights",
    "check_device_ids",
    "take_torch_ddp_kwargs",
    "TorchDDPArgs",
    "TORCH_DDP_KEYWORDS",
]


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {type(value).__name__} of shape {tuple(value.shape)}"
    return f"a {type(value).__module__}.{type(value).__qualname__}"


def check_parallelize_inputs(model: object, optimizer: object) -> None:
    """Raise a one-line TypeError unless ``model`` is an unwrapped module and ``optimizer`` a
    name or an optimizer class."""
    from aligndp.runtime.ddp import DataParallel

    if isinstance(model, DataParallel):
        raise TypeError(
            "aligndp.parallelize got a model it already wrapped; pass the original module "
            "(model.module) or keep using the wrapped one"
        )
    if not isinstance(model, nn.Module):
        hint = " (the model, not one of its tensors)" if isinstance(model, torch.Tensor) else ""
        raise TypeError(f"aligndp.parallelize wraps an nn.Module{hint}, got {_describe(model)}")
    for name, m in model.named_modules():  # the layers torch gives sparse gradients
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse and m.weight.requires_grad:
            raise ValueError(  # ZeroRedundancyOptimizer's type for sparse params
                f"{name}.weight gets sparse gradients ({type(m).__name__}(sparse=True)); aligndp "
                "reduces gradients in dense flat buffers in every sharding: build it with "
                "sparse=False"
            )
    if not any(p.requires_grad for p in model.parameters()):  # torch DDP's RuntimeError
        raise RuntimeError(
            "the module has no trainable params (requires_grad=True): nothing to "
            "data-parallelise; run it without a wrapper"
        )
    if isinstance(optimizer, torch.optim.Optimizer):
        settings = {
            k: v
            for k, v in optimizer.defaults.items()
            if k in ("lr", "weight_decay", "momentum", "betas")
        }
        kwargs = ", ".join(f"{k}={v!r}" for k, v in settings.items())
        raise TypeError(
            "optimizer= takes a name or an optimizer class, got an instance of "
            f"{type(optimizer).__name__}: aligndp "
            "builds the optimizer over its own buffers. Pass "
            f"optimizer=torch.optim.{type(optimizer).__name__} "
            f"and its settings as keywords ({kwargs})"
        )
    if not isinstance(optimizer, str) and not (
        isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer)
    ):
        raise TypeError(
            f"optimizer= takes a name ({', '.join(known_optimizers())}) or a "
            f"torch.optim.Optimizer class, got {_describe(optimizer)}"
        )


def check_master_weights(master_weights: object, sharding: object) -> None:
    """Raise unless ``master_weights`` is None or a bool that ``sharding`` can honour: fp32
    masters are kept only by ``sharding="zero1"`` ([Note: master weights] in
    aligndp/optim/sharded.py)."""
    if master_weights is not None and not isinstance(master_weights, bool):
        raise TypeError(
            f"master_weights= takes None, True or False, got {_describe(master_weights)} "
            f"({master_weights!r})"
        )
    if master_weights is True and sharding == "none":
        raise ValueError(
            "master_weights=True asks for fp32 master copies of 16-bit params, but "
            "sharding='none' steps every param in its own dtype with the torch optimizer (as "
            "torch DDP does) and keeps no masters: use sharding='zero1' (which keeps them), "
            "or fp32 params, or leave master_weights=None"
        )


def check_fp8_param_gather(
    fp8_param_gather: object, *, wgrad: object, sharding: object, master_weights: object
) -> None:
    """Raise unless ``fp8_param_gather`` is a bool and, when True, the run can gather FP8
    weights ([Note: FP8 param gather] in aligndp/runtime/gather_codec.py): the ``fp8-tensor``
    recipe (one scale per tensor serves the forward and the dgrad GEMM), ``sharding="zero1"``
    (only sharded params are gathered) and fp32 masters (the gather encodes them)."""
    if not isinstance(fp8_param_gather, bool):
        raise TypeError(
            f"fp8_param_gather= takes True or False, got {_describe(fp8_param_gather)} "
            f"({fp8_param_gather!r})"
        )
    if not fp8_param_gather:
        return
    if wgrad != "fp8-tensor":
        raise ValueError(
            f"fp8_param_gather=True needs wgrad='fp8-tensor' (per-tensor scales: one gathered "
            f"payload feeds the forward and the dgrad GEMM), got wgrad={wgrad!r}; use "
            "wgrad='fp8-tensor' or drop fp8_param_gather"
        )
    if sharding != "zero1":
        raise ValueError(
            f"fp8_param_gather=True gathers sharded params, but sharding={sharding!r} gathers "
            "none: use sharding='zero1' or drop fp8_param_gather"
        )
    if master_weights is False:
        raise ValueError(
            "fp8_param_gather=True encodes each gathered weight from its fp32 master on its "
            "owner, but master_weights=False keeps none: leave master_weights at None or True"
        )


# ---- torch DDP's constructor keywords ----

TORCH_DDP_ACCEPTED = (
    "find_unused_parameters",
    "gradient_as_bucket_view",
    "static_graph",
    "check_reduction",
    "skip_all_reduce_unused_params",
    "batched_grad_copy",
)
"""torch DDP flags for what aligndp always does (unused params are found every step and not
stepped, grads are bucket views, any graph may change, unused params cost nothing extra):
accepted as bools and change nothing."""

TORCH_DDP_REFUSED = {
    "mixed_precision": "parallelize(grad_dtype=torch.float32) reduces bf16 params' gradients "
    "in fp32, master_weights=True keeps fp32 masters under sharding='zero1', and "
    "model.register_comm_hook(None, default_hooks.bf16_compress_hook) reduces in bf16",
    "delay_all_reduce_named_params": "aligndp reduces every trainable param in its buckets; "
    "freeze a param (requires_grad_(False)) to keep it out, or overlap=False to reduce "
    "everything at the end of backward",
    "param_to_hook_all_reduce": "aligndp reduces every trainable param in its buckets; "
    "overlap=False reduces everything at the end of backward",
    "bucket_cap_mb_list": "aligndp's buckets have one size: bucket_cap_mb= (or bucket_numel=)",
}
"""torch DDP keywords aligndp has no meaning for (when not None), and what to use instead."""

TORCH_DDP_KEYWORDS = (
    ("device_ids", "output_device", "dim", "init_sync", "bucket_cap_mb", "device_mesh")
    + ("forward_sync_buffers",)
    + TORCH_DDP_ACCEPTED
    + tuple(TORCH_DDP_REFUSED)
)
"""Every keyword of ``torch.nn.parallel.DistributedDataParallel`` that ``parallelize`` takes
besides its own ``process_group`` and ``broadcast_buffers``."""


@dataclasses.dataclass(frozen=True)
class TorchDDPArgs:
    """What torch DDP's keywords mean for ``parallelize`` (:func:`take_torch_ddp_kwargs`)."""

    bucket_numel: int | None
    """``bucket_cap_mb`` in elements of the gradient dtype, else parallelize's bucket_numel."""
    process_group: dist.ProcessGroup | None
    """``device_mesh``'s group (1-D mesh), else parallelize's process_group."""
    broadcast_at_wrap: bool
    """``init_sync``: copy rank 0's params and buffers to every rank when wrapping."""
    broadcast_buffers: bool
    """``forward_sync_buffers`` if given, else ``broadcast_buffers`` (None: True, torch's)."""


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name}= takes True or False (as in torch DDP), got {value!r}")


def _bucket_numel_of_mb(mb: object, dtypes: set[torch.dtype]) -> int:
    """torch's bucket_cap_mb (MiB) in elements of the widest gradient dtype, so that no bucket
    is larger than ``mb`` MiB."""
    if isinstance(mb, bool) or not isinstance(mb, (int, float)) or not mb > 0:
        raise ValueError(f"bucket_cap_mb must be a positive number of MiB, got {mb!r}")
    return max(1, int(mb * 2**20) // max(d.itemsize for d in dtypes))


def check_device_ids(device_ids: object, output_device: object, device: torch.device) -> None:
    """torch DDP's ``device_ids``/``output_device``: each may only name the one CUDA device
    the module's params are on (aligndp never moves a module or its inputs)."""

    def as_device(d: object) -> torch.device:
        if isinstance(d, bool) or not isinstance(d, (int, str, torch.device)):
            raise TypeError(f"a device is an int, a str or a torch.device, got {d!r}")
        return torch.device("cuda", d) if isinstance(d, int) else torch.device(d)

    named = {}
    if device_ids is not None:
        if not isinstance(device_ids, (list, tuple)) or len(device_ids) != 1:
            raise ValueError(
                f"device_ids={device_ids!r}: torch DDP and aligndp take None or the one device "
                "of the module ([rank's device]); one process drives one device"
            )
        named[f"device_ids={device_ids!r}"] = device_ids[0]
    if output_device is not None:
        named[f"output_device={output_device!r}"] = output_device
    for what, d in named.items():
        dev = as_device(d)
        same = dev.type == device.type and dev.index in (None, device.index)
        if device.type != "cuda" or not same:
            raise ValueError(
                f"{what} names {dev}, but the module's params are on {device}: "
                + (
                    "torch DDP takes device_ids/output_device for single-device CUDA modules "
                    "only; leave them out (None) for this module"
                    if device.type != "cuda"
                    else f"move the module to {dev} before wrapping (module.to({str(dev)!r})) "
                    "or leave them out"
                )
            )


def _agree(error: Exception | None, group: dist.ProcessGroup | None) -> None:
    """Raise ``error`` of any rank on every rank (one ``all_gather_object``), as its type."""
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        mine = None if error is None else (isinstance(error, TypeError), str(error))
        errors = gather_objects(mine, group)
        bad = [(r, e) for r, e in enumerate(errors) if e is not None]
        if bad:
            cls = TypeError if bad[0][1][0] else ValueError
            raise cls("; ".join(f"rank {r}: {msg}" for r, (_, msg) in bad))
    elif error is not None:
        raise error


def take_torch_ddp_kwargs(
    model: nn.Module,
    kwargs: dict,
    *,
    bucket_numel: int | None,
    default_bucket_numel: int | None,
    grad_dtype: torch.dtype | None,
    process_group: dist.ProcessGroup | None,
    broadcast_buffers: bool | None,
) -> TorchDDPArgs:
    """Pop torch DDP's constructor keywords out of ``kwargs`` (parallelize's
    ``**optimizer_kwargs``) and return their meaning; refuse, before anything is wrapped,
    those aligndp has no meaning for, naming the alternative."""
    taken = {k: kwargs.pop(k) for k in TORCH_DDP_KEYWORDS if k in kwargs}
    for name in TORCH_DDP_ACCEPTED:
        if name in taken:
            _check_bool(name, taken[name])
    for name, instead in TORCH_DDP_REFUSED.items():
        value = taken.get(name)
        if value is not None and not (isinstance(value, (list, tuple)) and not value):
            raise ValueError(f"{name}= of torch DDP has no aligndp equivalent: {instead}")
    if taken.get("dim", 0) != 0:
        raise ValueError(
            f"dim={taken['dim']!r}: torch DDP scatters inputs along dim only for a module on "
            "several devices; aligndp drives one device per process and never splits inputs: "
            "leave dim out"
        )
    for name in ("init_sync", "forward_sync_buffers"):
        if taken.get(name) is not None:
            _check_bool(name, taken[name])
    mesh = taken.get("device_mesh")
    if mesh is not None:
        if process_group is not None:
            raise ValueError("pass process_group= or device_mesh=, not both (as torch DDP)")
        if getattr(mesh, "ndim", None) != 1:
            raise ValueError(
                f"device_mesh= must be a 1-D DeviceMesh (the data-parallel dimension), got "
                f"{mesh!r}: pass it as mesh= (aligndp's replicate x shard mesh), or "
                "process_group=mesh.get_group('dp') for a mesh of several"
            )
        process_group = mesh.get_group()
    mb = taken.get("bucket_cap_mb")
    if mb is not None:
        if bucket_numel != default_bucket_numel:
            raise TypeError(
                f"pass bucket_cap_mb={mb!r} (torch's MiB) or bucket_numel={bucket_numel!r} "
                "(elements), not both"
            )
        trainable = {p.dtype for p in model.parameters() if p.requires_grad} or {torch.float32}
        bucket_numel = _bucket_numel_of_mb(mb, {grad_dtype} if grad_dtype else trainable)
    if "device_ids" in taken or "output_device" in taken:
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        error = None
        try:
            check_device_ids(taken.get("device_ids"), taken.get("output_device"), device)
        except (TypeError, ValueError) as e:
            error = e
        _agree(error, process_group)  # a device that one rank names wrongly: all raise
    forward_sync = taken.get("forward_sync_buffers")
    if broadcast_buffers is not None:
        _check_bool("broadcast_buffers", broadcast_buffers)
    return TorchDDPArgs(
        bucket_numel=bucket_numel,
        process_group=process_group,
        broadcast_at_wrap=taken.get("init_sync", True),
        broadcast_buffers=next(b for b in (forward_sync, broadcast_buffers, True) if b is not None),
    )
