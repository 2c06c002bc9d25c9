"""The learning-rate schedule of ``aligndp train``: linear warm-up, then cosine decay to a tenth of
the peak, as a torch :class:`~torch.optim.lr_scheduler.LambdaLR` stepping the optimizer that
:func:`aligndp.parallelize` returns (a ``torch.optim.Optimizer``: any torch scheduler steps it
the same way, e.g. ``OneCycleLR(optimizer, max_lr=3e-3, total_steps=N)`` then
``scheduler.step()`` after each ``optimizer.step()``).

LambdaLR of a closed form rather than ``SequentialLR(LinearLR, CosineAnnealingLR)``: the two give
the same values (tests/test_schedule.py checks it), but CosineAnnealingLR's ``eta_min`` is one
absolute lr for every param group (a group built with its own lr would decay to another group's
floor), and a resumed or extended run places a closed form at any step with ``last_epoch``.
"""

from __future__ import annotations

import functools
import math

__all__ = ["lr_factor", "warmup_cosine"]


def lr_factor(step: int, steps: int) -> float:
    """Multiplier of the peak lr at ``step`` (0-based) of ``steps``.

    Linear warm-up over the first ``min(20, steps // 10)`` steps (so the first step is not
    taken at full lr from random init), then cosine decay from 1 to 0.1 at the last step.
    """
    warmup = min(20, steps // 10)
    if step < warmup:
        return (step + 1) / warmup
    decay_steps = max(1, steps - 1 - warmup)
    progress = min(1.0, (step - warmup) / decay_steps)
    return 0.1 + 0.45 * (1.0 + math.cos(math.pi * progress))


def warmup_cosine(optimizer, *, steps: int, peak_lrs: list[float], start_step: int = 0):
    """A LambdaLR of :func:`lr_factor` over ``steps``, placed at ``start_step`` (a resumed run:
    the lr it sets is the one step ``start_step`` trains at; step it after each optimizer step).

    ``peak_lrs``: each param group's lr as built, read before a checkpoint was loaded (a loaded
    optimizer carries the scaled lr of its last step); they become the groups' ``initial_lr``,
    torch's record of the peak a scheduler scales.
    """
    from torch.optim.lr_scheduler import LambdaLR

    for group, peak in zip(optimizer.param_groups, peak_lrs):
        group["initial_lr"] = peak
    return LambdaLR(optimizer, functools.partial(lr_factor, steps=steps), last_epoch=start_step - 1)
