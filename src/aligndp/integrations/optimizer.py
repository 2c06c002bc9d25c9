"""The user's optimizer, rebuilt by ``aligndp.parallelize``; their lr schedulers moved onto it
([Note: trainer integrations])."""

from __future__ import annotations

import inspect

import torch
import torch.nn as nn

from aligndp.parallelize import parallelize


def parallelize_like(
    module: nn.Module,
    user_optimizer: torch.optim.Optimizer | None,
    *,
    optimizer: str | type[torch.optim.Optimizer] | None = None,
    **parallelize_kwargs,
):
    """``aligndp.parallelize(module, ...)`` building the optimizer ``user_optimizer`` describes.

    ``optimizer=None``: ``user_optimizer``'s class with its param groups and all their
    options (lr, betas, weight decay, ...). Otherwise ``optimizer`` replaces its class, and its
    first group's lr is used unless ``lr=`` is among ``parallelize_kwargs``."""
    if optimizer is None:
        if user_optimizer is None:
            raise ValueError(
                "the trainer built no optimizer to follow: return one from the trainer's "
                "optimizer hook, or pass optimizer='adamw' (or another name) to aligndp"
            )
        if isinstance(user_optimizer, torch.optim.lr_scheduler.LRScheduler):
            raise TypeError("expected an optimizer, got an lr scheduler")
        cls = type(user_optimizer)
        # a group holds every default, some of which the class sets itself (AdamW's
        # decoupled_weight_decay): the options are the keys its constructor takes
        takes = set(inspect.signature(cls.__init__).parameters) - {"self", "params"}
        groups = [
            {"params": g["params"], **{k: v for k, v in g.items() if k in takes}}
            for g in user_optimizer.param_groups
        ]
        return parallelize(module, optimizer=cls, param_groups=groups, **parallelize_kwargs)
    if parallelize_kwargs.get("lr") is None and user_optimizer is not None:
        parallelize_kwargs["lr"] = user_optimizer.param_groups[0]["lr"]
    return parallelize(module, optimizer=optimizer, **parallelize_kwargs)


def move_scheduler(
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    old: torch.optim.Optimizer,
    new: torch.optim.Optimizer,
) -> None:
    """Point ``scheduler`` (made on ``old``) at ``new``, whose param groups correspond to
    ``old``'s one for one; each group keeps the lr and initial lr the scheduler set."""
    if scheduler.optimizer is not old:
        return
    if len(new.param_groups) != len(old.param_groups):
        raise ValueError(
            f"{type(scheduler).__name__} was made on {len(old.param_groups)} param group(s), "
            f"aligndp's optimizer has {len(new.param_groups)}: keep the trainer's optimizer "
            "(optimizer=None) or build the scheduler on aligndp's"
        )
    # torch wraps an optimizer's step when a scheduler is made on it, to check that the
    # scheduler steps after the optimizer; a no-op scheduler makes the same wrap on ``new``
    torch.optim.lr_scheduler.LambdaLR(new, lambda _: 1.0)
    for ours, theirs in zip(new.param_groups, old.param_groups):
        ours["lr"] = theirs["lr"]
        ours["initial_lr"] = theirs.get("initial_lr", theirs["lr"])
    scheduler.optimizer = new
