"""The gradient side of :class:`~aligndp.runtime.ddp.DataParallel`: hooks, step states (the
reduction itself, readiness and the agreement: reduction.py).

See the module docstring of aligndp/runtime/ddp.py and DESIGN.md [Note: step states].
:class:`GradSync` is a mixin: ``DataParallel`` provides ``params``, ``param_names``,
``index`` (the :class:`~aligndp.runtime.step_state.ParamIndex`), ``_slot`` and
``bucket_refs`` (its slots and refs), ``flat_buffers``, ``config``, ``collectives``, ``rank``,
``dp_size`` (the shard group's), ``world_rank``, ``world_size`` (every rank's), ``device``,
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
from aligndp.runtime.collectives import Work
from aligndp.runtime.grads import same_storage
from aligndp.runtime.reduction import Reduction
from aligndp.runtime.step_flags import PendingFlags
from aligndp.runtime.step_state import BucketRef, RoundReport, StepState

__all__ = ["GradSync"]

_ACCUMULATING = StepState.ACCUMULATING  # read per gradient: a global, not an enum lookup


class GradSync(Reduction):
    """Gradient hooks and the step states; the reduction is :class:`Reduction`'s."""

    def _init_grad_sync(self) -> None:
        self._bucket_params = self.index.members
        self._position = {ref: k for k, ref in enumerate(self.bucket_refs)}
        self._launch_position = {p: self._position[self._slot[p].ref] for p in self.params}
        """param -> the launch position of its bucket."""
        # [Note: gradient as bucket view]: where a buffer's grad dtype is its params' dtype,
        # autograd accumulates straight into the view (``param.grad`` is the view)
        self._direct_buffers = [
            buf for buf in self.flat_buffers if buf.layout.grad_dtype == buf.layout.param_dtype
        ]
        self._direct: dict[nn.Parameter, torch.Tensor] = {
            p: self._slot[p].view for buf in self._direct_buffers for p in buf.params
        }
        self._armed: set[nn.Parameter] = set()  # param.grad is its view, set by us
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
        self._waiting_after_reduction: list[int] = []
        self._waiting: list[int] = []
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
    def arm(self) -> None:
        """Before a forward with grad: make every direct param's ``param.grad`` its view, so
        autograd accumulates into the buffer itself ([Note: gradient as bucket view])."""
        armed = self._armed
        for p, view in self._direct.items():
            if p.grad is None:
                p.grad = view
                armed.add(p)

    def _on_grad(self, param: nn.Parameter) -> None:
        grad = param.grad
        if grad is None:
            return
        if not self._callback_queued:
            self._queue_end_of_backward()
        view = self._slot[param].view
        if grad is view and param not in self._published:  # accumulated in place: nothing to do
            self._stale.discard(param)
            if self.state is not _ACCUMULATING:
                self._reopen()
                self._begin_accumulating()
            self._arrived(param)
            return
        if param in self._published:  # autograd accumulated onto the visible grad
            self._published.discard(param)  # (no forward through us): it is the new total
            if not same_storage(grad, view):
                view.copy_(grad.view_as(view))
            self._reopen()  # the other visible grads
        else:
            self._reopen()
            if param in self._stale or param in self._armed:  # the view was zero / is in grad
                self._stale.discard(param)
                view.copy_(grad.view_as(view))
            else:
                view.add_(grad.view_as(view))
        if param in self._direct:
            param.grad = view
            self._armed.add(param)
        else:
            param.grad = None
        self._begin_accumulating()
        self._arrived(param)

    def _arrived(self, param: nn.Parameter) -> None:
        assert self.state is _ACCUMULATING, "a gradient arrives in ACCUMULATING only"
        self._used.add(param)
        if self._unwaited and param in self._unwaited:
            self._problems["stale_read"].add(param)
        if not self._sync_enabled:
            return
        fired = self._fired[param] = self._fired[param] + 1
        position = self._launch_position[param]
        if position < self._next_launch:
            self._problems["late"].add(param)  # only a fused layer used more often than last time
        elif self._expected is not None and self.config.overlap:
            if fired == self._expected[param]:  # [Note: bucket readiness]: one count per bucket
                self._waiting[position] -= 1
                if position == self._next_launch:
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
        """Zero a stale view before something accumulates into or reads it (the views of
        direct buffers are zero already: zero_grad zeroed them whole)."""
        if param in self._stale:
            self._stale.discard(param)
            if param not in self._direct:
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
                # (dp_size is the shard group's: on a mesh the replica all-reduce averages the
                # replicas' identical old means to the old mean again)
                lo, hi = slot.owned.lo, slot.owned.hi
                flat[:lo].zero_()
                flat[hi:].zero_()
                flat[lo:hi].mul_(self.dp_size)
                self._used.add(p)
            if p in self._direct:  # autograd goes on accumulating into the view
                if p.grad is not slot.view:
                    p.grad = slot.view
                self._armed.add(p)
            else:
                p.grad = None
        self._published.clear()

    def _reset_round(self) -> None:
        self._fired = dict.fromkeys(self._fired, 0)
        self._waiting = list(self._waiting_after_reduction)
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
        for buf in self._direct_buffers:  # one op per buffer ([Note: gradient as bucket view])
            buf.grad_data.zero_()
        for p in self._eager_zero:
            if p not in self._direct:
                self._slot[p].view.zero_()
        for p in self.params:
            p.grad = None
        self._armed.clear()
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
