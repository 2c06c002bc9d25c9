"""Uneven inputs under torch's ``Join``: :class:`DataParallel` is a ``Joinable``.

[Note: join]
As with torch DDP and ``ZeroRedundancyOptimizer``, ``with Join([model, opt]):`` (the model
first) or ``with model.join(...):`` lets ranks run out of batches at different times: a rank
that ran out loops in ``Join.__exit__`` and, once per forward of the others, runs the join
hooks' ``main_hook``, which shadow that iteration's collectives so the others never wait:

* every forward of an active rank (the model is the first joinable): torch's notify all-reduce
  (ones; the joined ranks' zeros), then one int32 sum over the ranks (:func:`join_forward`) —
  slot 0 counts the ranks whose backward will sync (grad enabled, not ``no_sync``), slot
  ``1 + r`` is 1 where rank r is still active. A joined rank sends zeros and learns from it
  whether a backward follows, which rank's buffers to take, and how many ranks train.
* the module buffers' broadcast (``broadcast_buffers``), from the highest active rank;
* a synchronised backward: the joined rank's ``reducer.shadow_backward()`` reduces zero
  gradients through every bucket in launch order and runs the agreement, so the reduction
  averages the active ranks' gradients; the joined rank ends REDUCED with the same gradients;
* the optimizer step: the joined rank steps too (optim/join.py) — a zero1 shard must still
  step and all-gather, the others need its params; the global-norm all-reduce of
  ``max_grad_norm`` runs as on the others.

The shadow assumes torch's loop: each forward with grad outside ``no_sync`` is followed by its
backward, and each synchronised backward by one ``opt.step()`` before the next forward
(``no_sync`` micro-batches and forwards without grad may come between two steps, not between
a backward and its step).

``divide_by_initial_world_size=False`` divides by the ranks still active (slots ``1 + r``
summed) instead of the group size: :class:`JoinCollectives` scales each bucket before the
mean. At the end the ``post_hook`` broadcasts params and buffers from the highest rank that
joined last, as torch DDP's ``_sync_final_model``. Refused (RuntimeError, at ``model.join()``
or the first forward, on every rank): a replicate x shard mesh and an FP8 param gather
(their extra collectives are not shadowed); the model after another joinable (ValueError).
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, Joinable, JoinHook

from aligndp.runtime.collectives import Collectives, Work, broadcast_by_dtype

__all__ = ["JoinableModel", "JoinCollectives", "join_forward", "join_refusal"]

_INSTEAD = (
    "give every rank the same number of batches instead (DistributedSampler(drop_last=True), "
    "or drop the last incomplete batch)"
)


def _check_bools(**values: object) -> None:
    for name, value in values.items():
        if not isinstance(value, bool):
            raise TypeError(f"join({name}=...) takes a bool, got {value!r}")


def join_refusal(model) -> str | None:
    """Why ``model`` cannot train on under ``Join`` (None: it can)."""
    if model.collectives.replicas > 1:
        why = "a replicate x shard mesh (its replica all-reduces are not shadowed)"
    elif model.param_gather.coded is not None:
        why = "an FP8 param gather (its scale exchange is not shadowed)"
    else:
        return None
    return f"uneven inputs under Join are not supported with {why}; {_INSTEAD}"


class JoinCollectives:
    """The model's collectives with each gradient mean scaled by ``factor`` first
    (``divide_by_initial_world_size=False``: ``dp_size / active ranks``); all else as ``inner``."""

    def __init__(self, inner: Collectives) -> None:
        self.inner = inner
        self.factor = 1.0

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def all_reduce_mean(self, bucket: torch.Tensor) -> Work:
        if self.factor != 1.0:
            bucket.mul_(self.factor)
        return self.inner.all_reduce_mean(bucket)

    def reduce_scatter_mean(self, bucket: torch.Tensor) -> Work:
        if self.factor != 1.0:
            bucket.mul_(self.factor)
        return self.inner.reduce_scatter_mean(bucket)


class _JoinStep:
    """What one forward's sum told the ranks (the last one seen on this rank)."""

    def __init__(self, syncing: int, active: list[int]) -> None:
        self.syncing, self.active = syncing, active


def _agree(model, syncing: bool, active: bool) -> _JoinStep:
    """The int32 sum of :func:`join_forward`: ``[ranks syncing, active one-hot...]``."""
    flags = torch.zeros(1 + model.world_size, dtype=torch.int32, device=model.device)
    flags[0] = int(syncing)
    flags[1 + model.world_rank] = int(active)
    model.collectives.all_reduce_sum(flags)  # [Note: collectives seam]
    values = flags.tolist()
    return _JoinStep(values[0], [r for r, v in enumerate(values[1:]) if v])


def _sync_buffers(model, step: _JoinStep) -> None:
    if model.will_sync_module_buffers():
        model._broadcast_buffers(src=max(step.active))


def join_forward(model) -> None:
    """An active rank's part before its forward under ``Join`` ([Note: join])."""
    config, scaled = model._join_config, model._join_scaled
    if not config.is_first_joinable:
        raise ValueError(
            "Join(...) lists the DataParallel after another joinable: its forward must notify "
            "the join first; put the model first: Join([model, opt])"
        )
    refusal = join_refusal(model)
    if refusal is not None:
        raise RuntimeError(refusal)
    Join.notify_join_context(model)  # raises with throw_on_early_termination
    syncing = torch.is_grad_enabled() and model.reducer._sync_enabled
    step = _agree(model, syncing, True)
    if scaled is not None:
        scaled.factor = model.dp_size / len(step.active)
    _sync_buffers(model, step)


class _ModelJoinHook(JoinHook):
    def __init__(self, model) -> None:
        self.model = model

    def main_hook(self) -> None:
        """A joined rank's shadow of one forward of the others (and its backward and step)."""
        model = self.model
        step = _agree(model, False, False)
        _sync_buffers(model, step)
        model._join_shadowed = bool(step.syncing)
        if not step.syncing:
            return
        model.reducer.shadow_backward()
        opt = model._join_optimizer() if model._join_optimizer is not None else None
        if opt is not None and not opt._join_config.enable:  # not in the Join: step it here
            opt.step()

    def post_hook(self, is_last_joiner: bool) -> None:
        """torch DDP's ``_sync_final_model``: params and buffers from the last joiner."""
        model = self.model
        Joinable.__init__(model)  # torch leaves the config enabled; later forwards do not join
        if model._join_scaled is not None:
            model.buckets_collectives(model._join_scaled.inner)
            model._join_scaled = None
        src = torch.tensor([model.world_rank if is_last_joiner else -1], device=model.device)
        dist.all_reduce(src, op=dist.ReduceOp.MAX, group=model.process_group)
        model.wait_for_params()
        tensors = [*model.module.parameters(), *model.module.buffers()]
        last = model.global_rank(int(src.item()))
        broadcast_by_dtype(tensors, src=last, group=model.process_group)


class _ModelJoin(Join):
    """torch's ``Join`` of ``model.join()``; leaving by an error also ends the join (torch
    leaves the joinables' configs enabled then)."""

    def __init__(self, model, **kwargs) -> None:
        super().__init__([model], **kwargs)
        self.model = model

    def __exit__(self, type, value, traceback):
        try:
            return super().__exit__(type, value, traceback)
        finally:
            if type is not None:
                Joinable.__init__(self.model)


class JoinableModel(Joinable):
    """torch DDP's ``Joinable`` face of :class:`~aligndp.runtime.ddp.DataParallel`."""

    _join_scaled: JoinCollectives | None = None
    _join_optimizer: weakref.ref | None = None
    """The last aligndp optimizer built over the model: steps on a joined rank (optim/join.py)."""
    _join_shadowed = False
    """The joined rank's last shadowed forward was followed by a synchronised backward."""

    def join(
        self, divide_by_initial_world_size=True, enable=True, throw_on_early_termination=False
    ):
        """torch DDP's ``join``: ``Join([self], ...)`` ([Note: join] in runtime/join.py)."""
        _check_bools(
            divide_by_initial_world_size=divide_by_initial_world_size,
            enable=enable,
            throw_on_early_termination=throw_on_early_termination,
        )
        refusal = join_refusal(self) if enable else None
        if refusal is not None:
            raise RuntimeError(refusal)
        return _ModelJoin(
            self,
            enable=enable,
            throw_on_early_termination=throw_on_early_termination,
            divide_by_initial_world_size=divide_by_initial_world_size,
        )

    def join_hook(self, **kwargs) -> JoinHook:
        divide = kwargs.get("divide_by_initial_world_size", True)
        _check_bools(divide_by_initial_world_size=divide)
        if self._join_scaled is not None:  # a Join left by an error: start afresh
            self.buckets_collectives(self._join_scaled.inner)
            self._join_scaled = None
        if not divide:
            self._join_scaled = JoinCollectives(self.buckets[0].collectives)
            self.buckets_collectives(self._join_scaled)
        self._join_shadowed = False
        opt = self._join_optimizer() if self._join_optimizer is not None else None
        if opt is not None:  # a Join left by an error keeps its configs; Join sets them anew
            Joinable.__init__(opt)
        return _ModelJoinHook(self)

    @property
    def join_device(self) -> torch.device:
        return self.device

    @property
    def join_process_group(self):
        return self.process_group

    def will_sync_module_buffers(self) -> bool:
        """torch DDP's: the forward broadcasts module buffers."""
        return (
            self.config.broadcast_buffers
            and self.world_size > 1
            and any(True for _ in self.module.buffers())
        )

    def buckets_collectives(self, collectives) -> None:
        """The collectives each bucket reduces through."""
        for bucket in self.buckets:
            bucket.collectives = collectives
