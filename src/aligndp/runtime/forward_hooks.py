"""The forward pre-hook and hook of :class:`~aligndp.runtime.ddp.DataParallel`: the step's
bookkeeping around the wrapped module's forward ([Note: compiled forward] in DESIGN.md).

``torch.compile(model)`` runs module hooks outside Dynamo and traces only ``forward``; both
hooks are also ``torch.compiler.disable`` (recursive, a skip Dynamo caches on their code), so
a traced caller of the wrapper runs them eagerly too. ``model.forward(x)`` called directly (no
hooks) runs both itself.
"""

from __future__ import annotations

import torch

from aligndp.runtime.join import join_forward

__all__ = ["before_forward", "after_forward"]


@torch.compiler.disable
def before_forward(dp, args: tuple) -> None:
    """Step states, arming and joins before the module's forward."""
    if dp._replaced:
        raise RuntimeError(
            "this DataParallel was replaced by a newer wrap of the same module; use the new one"
        )
    dp._in_call = True
    if dp._join_config.enable:
        join_forward(dp)  # [Note: join] in join.py: the buffers from an active rank
    elif dp._join_scaled is not None:
        dp._join_scaled.factor = 1.0
    if dp.config.broadcast_buffers and dp.world_size > 1 and not dp._join_config.enable:
        dp._broadcast_buffers()
    if torch.is_grad_enabled():
        dp.reducer._reopen()  # before autograd accumulates into a ShardedGrad
        dp.reducer.landing.arm()  # [Note: gradient as bucket view]
    dp.compiled_overlap.enter()  # Dynamo splits the graph at buckets: [Note: compiled overlap]


@torch.compiler.disable
def after_forward(dp, args: tuple, out: object) -> object:
    """The end-of-backward watch of one rank, and gathers a forward left unwaited."""
    dp._in_call = False
    dp.compiled_overlap.leave()
    if dp.reducer.collecting and torch.is_grad_enabled():
        dp.reducer.landing.watch(dp.reducer, out)
    gather = dp.param_gather
    if gather.in_flight:
        dp.reducer.note_unwaited(gather.pending_params())
        gather.wait_all()
    return out
