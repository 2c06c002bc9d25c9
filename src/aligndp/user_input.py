"""Checks of what a user hands to ``aligndp.parallelize``, before anything touches it.

Without them a tensor passed as the model fails deep inside as an ``AttributeError``, and an
optimizer instance passed where a class is expected prints its multi-line repr.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from aligndp.optim.registry import known_optimizers

__all__ = ["check_parallelize_inputs", "check_master_weights"]


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
