"""The gradient side of :class:`~aligndp.runtime.ddp.DataParallel`: hooks, readiness,
reduction, step states.

See the module docstring of aligndp/runtime/ddp.py and DESIGN.md [Note: step states].
:class:`GradSync` is a mixin: ``DataParallel`` provides ``params``, ``param_names``,
``_slot`` (a :class:`~aligndp.runtime.step_state.GradSlot` per param), ``bucket_refs``,
``flat_buffers``, ``config``, ``collectives``, ``rank``, ``dp_size``, ``device``,
``_eager_zero`` and ``_replaced``, and calls :meth:`_init_grad_sync`.

``state`` changes in these named transitions only ([Note: step states]):

    _begin_accumulating   IDLE -> ACCUMULATING      the first gradient of a new step
    _reopen               REDUCED -> ACCUMULATING   a gradient after the reduction
    finish_grad_sync      ACCUMULATING -> REDUCED   the end of a synchronised backward
    zero_grad_buffer      any -> IDLE               a new step begins (``zero_grad``)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn as nn

from aligndp.plan.fused import GradTarget
from aligndp.plan.spec import Mode
from aligndp.runtime.collectives import Work
from aligndp.runtime.grads import same_storage
from aligndp.runtime.step_flags import (
    Agreed,
    PendingFlags,
    decode_flags,
    encode_flags,
    nonfinite_counts,
    to_host_async,
)
from aligndp.runtime.step_state import BucketRef, RoundReport, StepState

__all__ = ["GradSync"]


class GradSync:
    """Gradient hooks, bucket readiness, the end-of-backward reduction and the step states."""

    def _init_grad_sync(self) -> None:
        self._bucket_params = {
            ref: [p for p in self.params if self._slot[p].ref == ref] for ref in self.bucket_refs
        }
        self._position = {ref: k for k, ref in enumerate(self.bucket_refs)}
        self.state = StepState.IDLE
        self._pending_flags: PendingFlags | None = None
        self.reduction_listeners: list = []
        """Called after each reduction has published ``param.grad`` (optimizers mark the tensors
        they step, e.g. ZeRO-1's fp32 masters, the same way)."""
        self._expected: dict[nn.Parameter, int] | None = None  # [Note: bucket readiness]
        self._fired: dict[nn.Parameter, int] = dict.fromkeys(self.params, 0)
        self._stale: set[nn.Parameter] = set(self.params)  # [Note: lazy zeroing]
        self._used: set[nn.Parameter] = set()  # had a gradient on this rank since the reduction
        self._published: set[nn.Parameter] = set()  # param.grad set by us ([Note: step states])
        self._problems: dict[str, set[nn.Parameter]] = {"late": set(), "stale_read": set()}
        self._nonfinite: torch.Tensor | None = None
        self._finite_spans = (
            {ref: self._spans(ref) for ref in self.bucket_refs} if self.config.check_finite else {}
        )
        self._works: dict[BucketRef, Work | None] = {}
        self._next_launch = 0
        self._launched_in_backward = 0
        self._sync_enabled = True
        self._callback_queued = False
        self._unwaited: set[nn.Parameter] = set()
        self.nonfinite: str | None = None
        """The agreed message of the last reduction when a gradient was not finite, else None."""
        self.last_round: RoundReport | None = None
        self.reductions = 0
        """Counts reductions and zero_grads: what optimizers bound to the gradients is valid
        while it is unchanged."""

    # ---- the GradSink protocol ([Note: fused wgrad] in aligndp/plan/fused.py) ----
    def grad_target(self, param: nn.Parameter) -> GradTarget | None:
        slot = self._slot.get(param)
        if slot is None:
            return None
        self._reopen()
        # a stale view stays stale until mark_ready ([Note: write, not accumulate])
        return GradTarget(slot.view, accumulate=param not in self._stale)

    def main_grad_view(self, param: nn.Parameter) -> torch.Tensor:
        """``param.main_grad`` for users: the view, zeroed first if stale. Touching it during a
        step counts as giving the param a gradient (it is reduced and stepped)."""
        self._take(param)
        if self.state is StepState.IDLE:
            self._begin_accumulating()
        return self._slot[param].view

    def mark_ready(self, param: nn.Parameter) -> None:
        """A fused-wgrad kernel has written ``param``'s gradient into its view."""
        self._queue_end_of_backward()
        self._reopen()
        self._stale.discard(param)
        self._begin_accumulating()
        self._arrived(param)

    def buckets_in_flight(self) -> list[BucketRef]:
        """Buckets whose gradient collective was launched and not yet waited for, in launch
        order (read-only; empty outside a synchronised backward)."""
        return list(self._works)

    # ---- hooks ----
    def _on_grad(self, param: nn.Parameter) -> None:
        grad = param.grad
        if grad is None:
            return
        self._queue_end_of_backward()
        view = self._slot[param].view
        if param in self._published:  # autograd accumulated onto the visible grad
            self._published.discard(param)  # (no forward through us): it is the new total
            if not same_storage(grad, view):
                view.copy_(grad.view_as(view))
            self._reopen()  # the other visible grads
        else:
            self._reopen()
            if param in self._stale:
                self._stale.discard(param)
                view.copy_(grad.view_as(view))
            else:
                view.add_(grad.view_as(view))
        param.grad = None
        self._begin_accumulating()
        self._arrived(param)

    def _arrived(self, param: nn.Parameter) -> None:
        assert self.state is StepState.ACCUMULATING, "a gradient arrives in ACCUMULATING only"
        self._used.add(param)
        if param in self._unwaited:
            self._problems["stale_read"].add(param)
        if not self._sync_enabled:
            return
        self._fired[param] += 1
        if self._position[self._slot[param].ref] < self._next_launch:
            self._problems["late"].add(param)  # only a fused layer used more often than last time
        elif self._expected is not None and self.config.overlap:
            self._launch_ready()
            self._launched_in_backward = self._next_launch

    def _queue_end_of_backward(self) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        self._callback_queued = False
        if self._sync_enabled and not self._replaced:
            self.finish_grad_sync()

    def _take(self, param: nn.Parameter) -> None:
        """Zero a stale view before something accumulates into or reads it."""
        if param in self._stale:
            self._stale.discard(param)
            self._slot[param].view.zero_()

    # ---- the named transitions ([Note: step states]) ----
    def _begin_accumulating(self) -> None:
        """IDLE -> ACCUMULATING: the first gradient of a new step (after ``zero_grad``) — a
        hook, a fused kernel's ``mark_ready`` or a touch of ``param.main_grad``. A no-op in
        ACCUMULATING; REDUCED must :meth:`_reopen` first."""
        assert self.state is not StepState.REDUCED, "reopen the reduced grads first"
        self.state = StepState.ACCUMULATING

    @torch.no_grad()
    def _reopen(self) -> None:
        """REDUCED -> ACCUMULATING: make the buffers hold the visible grads again
        ([Note: step states]); a no-op in any other state."""
        if self.state is not StepState.REDUCED:
            return
        self.state = StepState.ACCUMULATING
        for p in list(self._published):
            slot, grad = self._slot[p], p.grad
            flat = slot.view.view(-1)
            if grad is None:  # dropped by the user (model.zero_grad(), p.grad = None)
                flat.zero_()
            elif slot.owned is None:
                if not same_storage(grad, slot.view):
                    slot.view.copy_(grad.view_as(slot.view))
                self._used.add(p)
            else:  # own shard x dp_size, zeros elsewhere: the next mean adds the new mean to it
                lo, hi = slot.owned
                flat[:lo].zero_()
                flat[hi:].zero_()
                flat[lo:hi].mul_(self.dp_size)
                self._used.add(p)
            p.grad = None
        self._published.clear()

    # ---- readiness and collectives ----
    def _bucket_ready(self, ref: BucketRef) -> bool:
        assert self._expected is not None
        return all(0 < self._expected[p] <= self._fired[p] for p in self._bucket_params[ref])

    def _launch_ready(self) -> None:
        while self._next_launch < len(self.bucket_refs) and self._bucket_ready(
            self.bucket_refs[self._next_launch]
        ):
            self._launch(self.bucket_refs[self._next_launch])

    def _launch(self, ref: BucketRef) -> None:
        assert ref == self.bucket_refs[self._next_launch], "buckets launch in index order"
        buf = self.flat_buffers[ref.buffer]
        for p in self._bucket_params[ref]:
            if p not in self._stale and p not in self._eager_zero:
                self._used.add(
                    p
                )  # written since zero_grad: by autograd, a fused kernel or the user
            self._take(p)
        grad = buf.bucket_grad(ref.bucket)
        if self.config.check_finite:
            self._check_finite(ref, grad)
        if self.dp_size == 1:
            self._works[ref] = None
        elif buf.layout.mode is Mode.REPLICATED:
            self._works[ref] = self.collectives.all_reduce_mean(grad)
        else:
            self._works[ref] = self.collectives.reduce_scatter_mean(grad)
        self._next_launch += 1

    def _spans(self, ref: BucketRef) -> torch.Tensor:
        """``(3, k)`` int64 on the device: flag index, start and end (in the bucket) of each
        of the bucket's k params, for :meth:`_check_finite`."""
        buf = self.flat_buffers[ref.buffer]
        first = buf.layout.buckets[ref.bucket].start
        rows = [
            (self._slot[p].index, s.start - first, s.end - first)
            for p, s in zip(buf.params, buf.slots)
            if s.bucket == ref.bucket
        ]
        return torch.tensor(rows, dtype=torch.int64).t().contiguous().to(self.device)

    def _check_finite(self, ref: BucketRef, grad: torch.Tensor) -> None:
        """Count non-finite local gradient elements per param: one pass over the bucket, on
        the device (no host sync; the counts are read with the agreement)."""
        if self._nonfinite is None:
            self._nonfinite = torch.zeros(len(self.params), dtype=torch.int32, device=self.device)
        index, starts, ends = self._finite_spans[ref]
        counts = nonfinite_counts(grad, starts=starts, ends=ends)
        self._nonfinite.index_add_(0, index, counts.to(torch.int32))

    def finish_grad_sync(self) -> None:
        """Reduce what has accumulated (launch every bucket not yet launched, wait for all),
        agree with the other ranks and publish ``param.grad``: ACCUMULATING -> REDUCED, a
        no-op in any other state. Runs by itself at the end of every synchronised backward.

        [Note: agreement without a host sync]
        The flags' all-reduce is always launched, but read on the host only when this rank
        needs the answer now: some param had no gradient here (is it used elsewhere?) or
        ``check_finite`` (skip or raise before the step). When every param had a gradient
        here, every param has one globally, so nothing waits: the flags are copied to pinned
        memory behind an event, and the problems they may carry (rare: a fused layer used
        more often, a stale read) are raised at the end of the next reduction, on every rank
        alike."""
        if self.state is not StepState.ACCUMULATING:
            return
        self._raise_pending_problems()
        while self._next_launch < len(self.bucket_refs):
            self._launch(self.bucket_refs[self._next_launch])
        for work in self._works.values():
            if work is not None:
                work.wait()
        flags = self._flags()
        if len(self._used) == len(self.params) and not self.config.check_finite:
            used, nonfinite, problems = self.params, "", ""
            self._pending_flags = to_host_async(flags)
        else:
            used, nonfinite, problems = self._decode(flags.tolist())
        self.last_round = RoundReport(self._launched_in_backward, len(self.bucket_refs), len(used))
        self._expected = dict(self._fired)
        self._reset_round()
        self.reductions += 1
        self.state = StepState.REDUCED
        for p in used:
            slot = self._slot[p]
            if slot.sharded_grad is not None:
                p.grad = slot.sharded_grad
            else:
                p.grad = slot.view if slot.view.dtype == p.dtype else slot.view.to(p.dtype)
            self._published.add(p)
        for listener in self.reduction_listeners:
            listener()
        self.nonfinite = None
        if nonfinite:
            skip = self.config.on_nonfinite == "skip"
            self.nonfinite = (
                f"non-finite (NaN/Inf) gradient elements before the reduction: {nonfinite}; "
                + (
                    "the optimizer step is skipped on every rank"
                    if skip
                    else "lower the learning rate or check the loss, then call opt.zero_grad() "
                    "to drop this step (or parallelize(..., on_nonfinite='skip') to skip such "
                    "steps on every rank)"
                )
            )
            if not skip:
                raise FloatingPointError(self.nonfinite)
        if problems:
            raise RuntimeError(problems)

    def _flags(self) -> torch.Tensor:
        """This rank's flags (step_flags.py), summed over the ranks."""
        nonfinite = None
        if self.config.check_finite:
            nonfinite = self._nonfinite
            if nonfinite is None:
                nonfinite = torch.zeros(len(self.params), dtype=torch.int32, device=self.device)
        local = encode_flags(
            self.params,
            used=self._used,
            late=self._problems["late"],
            stale_read=self._problems["stale_read"],
            nonfinite=nonfinite,
            rank=self.rank,
            dp_size=self.dp_size,
            device=self.device,
        )
        if self.dp_size > 1:
            self.collectives.all_reduce_sum(local)
        return local

    def _decode(self, values: list[int]) -> Agreed:
        return decode_flags(values, params=self.params, names=self.param_names)

    def _raise_pending_problems(self) -> None:
        """Problems the last unread agreement carried (long finished by now): raise them
        everywhere."""
        pending, self._pending_flags = self._pending_flags, None
        if pending is None:
            return
        if pending.event is not None:
            pending.event.synchronize()
        problems = self._decode(pending.host.tolist()).problems
        if problems:
            raise RuntimeError(f"in the previous step: {problems}")

    def _reset_round(self) -> None:
        self._fired = dict.fromkeys(self._fired, 0)
        self._works.clear()
        self._next_launch = 0
        self._launched_in_backward = 0
        self._used = set()
        self._problems = {"late": set(), "stale_read": set()}
        self._nonfinite = None
        self._unwaited = set()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (micro-batches); the next backward outside syncs them."""
        previous = self._sync_enabled
        self._sync_enabled = False
        try:
            yield
        finally:
            self._sync_enabled = previous

    def zero_grad_buffer(self) -> None:
        """Start a new step (-> IDLE): every ``main_grad`` counts as zero ([Note: lazy zeroing]),
        every ``param.grad`` is dropped."""
        self._stale = set(self.params) - self._eager_zero
        for p in self._eager_zero:
            self._slot[p].view.zero_()
        for p in self.params:
            p.grad = None
        self._published.clear()
        self._reset_round()
        self._callback_queued = False
        self.nonfinite = None
        self.reductions += 1
        self.state = StepState.IDLE

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Same as ``opt.zero_grad()``. ``set_to_none=False`` keeps zero gradients visible, so
        params unused in the next step are still stepped (with zero gradient), as in torch."""
        self.zero_grad_buffer()
        if not set_to_none:
            self._used = set(self.params)
            self._begin_accumulating()

    def reduced_grad(self, param: nn.Parameter) -> torch.Tensor:
        """The ``main_grad`` view of ``param`` after a reduction (this rank's shard is valid in
        sharded and layer-wise buffers); for optimizers, which read it without reopening."""
        return self._slot[param].view

    def has_grad(self, param: nn.Parameter) -> bool:
        """Whether ``param`` has a reduced gradient to step with (some rank used it)."""
        return param in self._published
