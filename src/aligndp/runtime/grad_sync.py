"""The gradient reducer of :class:`~aligndp.runtime.ddp.DataParallel`: hooks and step states
(the end-of-backward reduction and agreement: reduction.py, its other half).

See the module docstring of aligndp/runtime/ddp.py and DESIGN.md [Note: step states].
``DataParallel`` composes one :class:`GradReducer` (``model.reducer``) over its ``ParamIndex``
(step_state.py) and its ``BucketGroup`` s (bucket_group.py), and forwards its public methods.

``state`` changes in these named transitions only ([Note: step states]):

    _begin_accumulating   IDLE -> ACCUMULATING      the first gradient of a new step
    _reopen               REDUCED -> ACCUMULATING   a gradient after the reduction
    finish_grad_sync      ACCUMULATING -> REDUCED   the end of a synchronised backward
    zero_grad_buffer      any -> IDLE               a new step begins (``zero_grad``)

[Note: one closure per param]
Per-param state is lists indexed by the param's registration index ``k`` (no hash of a
param), and each param's post-accumulate hook is a closure bound to its ``k``, which finds
its view and :class:`BucketGroup` through the reducer (weakly: [Note: dropped wrappers]).
On the direct path ([Note: gradient as bucket view] in ddp.py: ACCUMULATING, ``param.grad``
is the view) the hook only marks the param written and counts its group down; all else goes
through :meth:`GradReducer._absorb` first (reopen, copy or add into the view). A fused
kernel's ``mark_ready`` runs the same ``arrive`` closure; its weight is never armed
([Note: gradient as bucket view]). Deferring, collecting, zeroing: grad_landing.py.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Collection, Mapping, Sequence

import torch
import torch.nn as nn

from aligndp.plan.fused import GradTarget
from aligndp.runtime.bucket_group import BucketGroup
from aligndp.runtime.collectives import Collectives
from aligndp.runtime.grad_landing import Landing
from aligndp.runtime.grads import same_storage
from aligndp.runtime.reduction import Reduction
from aligndp.runtime.step_flags import PendingFlags
from aligndp.runtime.step_state import ParamIndex, ReducedGrads, RoundReport, StepState

__all__ = ["GradReducer"]

# read per gradient: globals, not enum or attribute lookups
_ACCUMULATING, _REDUCED, _STRIDED = StepState.ACCUMULATING, StepState.REDUCED, torch.strided


class GradReducer(Reduction):
    """Gradient hooks, readiness, the step states and the reduced-gradient view of one model."""

    def __init__(
        self,
        index: ParamIndex,
        groups: Sequence[BucketGroup],
        *,
        params: Sequence[nn.Parameter],
        names: Mapping[nn.Parameter, str],
        config,
        collectives: Collectives,
        rank: int,
        device: torch.device,
        eager_zero: set[nn.Parameter],
        fused: Collection[nn.Parameter] = (),
    ) -> None:
        """``params`` in registration order; ``config``: the model's ``DDPConfig``; ``rank``: among
        all ranks; ``eager_zero``: params whose stale views are zeroed at ``zero_grad``;
        ``fused``: the weights of fused-wgrad layers (they write their views themselves)."""
        self.index, self.groups, self.config = index, list(groups), config
        self.params, self.param_names = list(params), names
        self.collectives, self.rank, self.device = collectives, rank, device
        self.dp_size = collectives.dp_size
        self.world_size = self.dp_size * collectives.replicas  # the agreement's ranks
        n = len(self.params)
        self._k = {p: k for k, p in enumerate(self.params)}
        self._slots = list(index.slots.values())
        self._views = [s.view for s in self._slots]
        self._shown = [s.sharded_grad for s in self._slots]  # param.grad where sharded
        self._members = [[s.index for s in g.slots] for g in self.groups]  # by group position
        by_ref = {g.ref: g for g in self.groups}
        self._group_of = [by_ref[s.ref] for s in self._slots]
        self._eager_zero = [p in eager_zero for p in self.params]
        # [Note: gradient as bucket view]: where a buffer's grad dtype is its params' dtype,
        # autograd accumulates straight into the view (``param.grad`` is the view)
        self._direct_buffers = [
            b for b in index.buffers if b.layout.grad_dtype == b.layout.param_dtype
        ]
        direct = {id(p) for b in self._direct_buffers for p in b.params}
        self._direct = [id(p) in direct for p in self.params]
        self._armed = [False] * n  # param.grad is its view, set by us; never a fused weight's:
        self._armable = [d and p not in fused for d, p in zip(self._direct, self.params)]
        self._stale = [not z for z in self._eager_zero]  # [Note: lazy zeroing]
        self._stale_at_zero = tuple(self._stale)  # what zero_grad makes it
        self._used = [False] * n  # had a gradient on this rank since the reduction
        self._published: set[int] = set()  # param.grad set by us ([Note: step states])
        self._fired = [0] * n  # [Note: bucket readiness]: arrivals this round
        self._undefined = [False] * n  # [Note: undefined gradients]
        self._expected = [-1] * n  # arrivals in the last synchronised round (-1: none yet)
        self.state = StepState.IDLE
        self.epoch = 0
        """Moves at every reduction, reopen and ``zero_grad``: a :class:`ReducedGrads` of an
        older epoch refuses to be read."""
        self._view: ReducedGrads | None = None
        self._pending_flags: PendingFlags | None = None
        self._problems: dict[str, set[nn.Parameter]] = {"late": set(), "stale_read": set()}
        self._nonfinite: torch.Tensor | None = None
        self._finite_spans = (
            {g.position: self._spans(g) for g in self.groups} if config.check_finite else {}
        )
        self._next_launch = 0
        self._launched_in_backward = 0
        self._sync_enabled = True
        self._callback_queued = False
        self._unwaited: set[nn.Parameter] = set()
        self.replaced = False
        """The model was wrapped again: its end-of-backward callback does nothing."""
        self.nonfinite: str | None = None
        """The agreed message of the last reduction when a gradient was not finite, else None."""
        self.last_round: RoundReport | None = None
        self.landing = Landing(self, fused=bool(fused))  # grad_landing.py
        bound = [self._bind(k) for k in range(n)]
        self.hooks = [hook for hook, _, _ in bound]  # the model registers them, and pre_hooks
        self.pre_hooks = [pre for _, _, pre in bound]  # [Note: undefined gradients]
        self._arrive = [arrive for _, arrive, _ in bound]

    def _bind(self, k: int):
        """(hook, arrive, pre) of param ``k`` ([Note: one closure per param]; ``pre``: [Note:
        undefined gradients] in DESIGN.md)."""
        # on the params: ours only weakly ([Note: dropped wrappers] in wrapped_param.py)
        me = weakref.ref(self)
        stale, used, fired, expected = self._stale, self._used, self._fired, self._expected
        undefined = self._undefined
        dtype, shape = self._views[k].dtype, self._views[k].shape

        def arrive(r: GradReducer, param: nn.Parameter) -> None:
            if not r._callback_queued:
                r._queue_end_of_backward()
            stale[k] = False
            used[k] = True
            if r._unwaited and param in r._unwaited:
                r._problems["stale_read"].add(param)
            if not r._sync_enabled:
                return
            n = fired[k] = fired[k] + 1
            group = r._group_of[k]
            if group.position < r._next_launch:
                r._problems["late"].add(param)  # only a fused layer used more often than last time
            elif n == expected[k]:  # [Note: bucket readiness]: one count per bucket
                group.countdown -= 1
                if not group.countdown and group.position == r._next_launch:
                    r._launch_ready()
                    r._launched_in_backward = r._next_launch

        def pre(grad: torch.Tensor | None) -> None:
            if grad is None:
                undefined[k] = True

        def hook(param: nn.Parameter) -> None:
            if undefined[k]:  # [Note: undefined gradients]: nothing arrived
                undefined[k] = False
                return
            r = me()
            if r is None:
                return
            grad, state = param.grad, r.state
            if state is _ACCUMULATING and grad is r._views[k]:
                arrive(r, param)
            elif (  # [Note: one copy per bucket]: keep the first gradient for the launch
                stale[k]
                and not fired[k]
                and grad is not None
                and r._sync_enabled
                and state is not _REDUCED
                and grad.dtype is dtype
                and grad.shape == shape
                and grad.layout is _STRIDED
                and r._group_of[k].defer
            ):
                if state is not _ACCUMULATING:
                    r._begin_accumulating()
                r._group_of[k].deferred.append((k, grad))
                arrive(r, param)
            elif r._absorb(param, k):
                arrive(r, param)

        return hook, arrive, pre

    @property
    def collecting(self) -> bool:  # [Note: one rank collects at the end] in grad_landing.py
        return self.landing.collecting

    # ---- the GradSink protocol ([Note: fused wgrad] in aligndp/plan/fused.py) ----
    def grad_target(self, param: nn.Parameter) -> GradTarget | None:
        k = self._k.get(param)
        if k is None:
            return None
        self._reopen()
        # a stale view stays stale until mark_ready ([Note: write, not accumulate])
        return GradTarget(self._views[k], accumulate=not self._stale[k])

    def main_grad_view(self, param: nn.Parameter) -> torch.Tensor:
        """``param.main_grad`` for users: the view, zeroed first if stale. Touching it during a
        step counts as giving the param a gradient (it is reduced and stepped)."""
        k = self._k[param]
        self.landing.settle(self)  # [Note: one rank steps autograd's gradients]
        if self.collecting and self.state is not StepState.REDUCED:
            self.landing.collect(self)
        self._flush(self._group_of[k])
        self._take(k)
        if self.state is StepState.IDLE:
            self._begin_accumulating()
        return self._views[k]

    def mark_ready(self, param: nn.Parameter) -> None:
        """A fused-wgrad kernel has written ``param``'s gradient into its view."""
        self._reopen()
        self._begin_accumulating()
        self._arrive[self._k[param]](self, param)

    def buckets_in_flight(self) -> list:
        """Buckets launched and not yet waited for, in launch order (empty outside backward)."""
        return [g.ref for g in self.groups if g.reducing]

    # ---- hooks ----
    def arm(self) -> None:
        """Before a forward with grad: make every direct param's ``param.grad`` its view, so
        autograd accumulates into the buffer itself ([Note: gradient as bucket view])."""
        if self.collecting:  # autograd keeps its own tensors until _collect
            return
        armed, views, groups = self._armed, self._views, self._group_of
        for k, p in enumerate(self.params):
            if self._armable[k] and p.grad is None and not groups[k].defer:
                p.grad = views[k]
                armed[k] = True

    def _absorb(self, param: nn.Parameter, k: int) -> bool:
        """Off the direct path: bring ``param.grad`` into its view and the model into
        ACCUMULATING. False when there is no gradient (nothing arrived)."""
        grad = param.grad
        if grad is None:
            return False
        if grad.layout is not _STRIDED:  # as parallelize() refuses a sparse embedding
            raise ValueError(
                f"{self.param_names[param]} got a {grad.layout} gradient; aligndp reduces dense "
                "flat buffers: make its layer give dense gradients (nn.Embedding(sparse=False))"
            )
        view = self._views[k]
        if grad is view and k not in self._published:  # accumulated in place: nothing to do
            self._reopen()
            self._begin_accumulating()
            return True
        if k in self._published:  # autograd accumulated onto the visible grad
            self._published.discard(k)  # (no forward through us): it is the new total
            if not same_storage(grad, view):
                view.copy_(grad.view_as(view))
            self._reopen()  # the other visible grads
        else:
            self._reopen()
            if self._stale[k] or self._armed[k]:  # the view was zero / is in grad
                view.copy_(grad.view_as(view))
            else:
                view.add_(grad.view_as(view))
        if self._direct[k]:
            param.grad = view
            self._armed[k] = True
        else:
            param.grad = None
        self._begin_accumulating()
        return True

    def _flush(self, group: BucketGroup) -> None:
        """Copy the group's deferred gradients into the buffer (one ``_foreach_copy_``) and
        make each ``param.grad`` its view."""
        deferred, group.deferred = group.deferred, []
        if not deferred:
            return
        views = self._views
        with torch.no_grad():
            torch._foreach_copy_([views[k] for k, _ in deferred], [g for _, g in deferred])
        params, armed = self.params, self._armed
        for k, _ in deferred:
            params[k].grad = views[k]
            armed[k] = True

    def _queue_end_of_backward(self) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        self._callback_queued = False
        if self._sync_enabled and not self.replaced:
            if self.collecting:  # a backward after the reduction accumulated into the views
                self._reopen()
            self.finish_grad_sync()

    def _take(self, k: int) -> None:
        """Zero a stale view before something adds into or reads it (direct views are zero
        already unless their group deferred: [Note: deferring buckets are not zeroed])."""
        if self._stale[k]:
            self._stale[k] = False
            if not self._direct[k] or self.landing.unzeroed[k]:
                self.landing.unzeroed[k] = False
                self._views[k].zero_()

    def note_unwaited(self, params: set[nn.Parameter]) -> None:
        """``params`` were read in forward before their all-gather was waited for."""
        self._unwaited |= params

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
        self.landing.settle(self)  # the views take the adopted gradients first
        self.state = StepState.ACCUMULATING
        self.epoch += 1
        for k in sorted(self._published):
            p, slot = self.params[k], self._slots[k]
            grad, flat = p.grad, slot.view.view(-1)
            if grad is None:  # dropped by the user (model.zero_grad(), p.grad = None)
                flat.zero_()
            elif slot.owned is None:
                if not same_storage(grad, slot.view):
                    slot.view.copy_(grad.view_as(slot.view))
                self._used[k] = True
            else:  # own shard x dp_size (shard group's), zeros elsewhere: next mean adds to it
                lo, hi = slot.owned.lo, slot.owned.hi
                flat[:lo].zero_()
                flat[hi:].zero_()
                flat[lo:hi].mul_(self.dp_size)
                self._used[k] = True
            if self._direct[k]:  # autograd goes on accumulating into the view
                if p.grad is not slot.view:
                    p.grad = slot.view
                self._armed[k] = True
            else:
                p.grad = None
        self._published.clear()

    def _reset_round(self) -> None:
        n = len(self.params)
        self._fired[:] = [0] * n
        for g in self.groups:
            g.countdown = len(g.params)
            g.reducing = False
            g.deferred = []
        self._next_launch = 0
        self._launched_in_backward = 0
        self._used[:] = [False] * n
        self._problems = {"late": set(), "stale_read": set()}
        self._nonfinite = None
        self._unwaited = set()

    def zero_grad_buffer(self) -> None:
        """Start a new step (-> IDLE): every ``main_grad`` counts as zero ([Note: lazy zeroing]),
        every ``param.grad`` is dropped."""
        self._stale[:] = self._stale_at_zero
        self.landing.zero_buffers(self)
        for p in self.params:
            p.grad = None
        self._armed[:] = [False] * len(self.params)
        self._published.clear()
        self._reset_round()
        self._callback_queued = False
        self.nonfinite = None
        self.epoch += 1
        self.state = StepState.IDLE

    def reduced(self) -> ReducedGrads:
        """The read-only view of the current gradients ([Note: reduced grads view]): the last
        reduction's in REDUCED, none otherwise (IDLE: nothing to step)."""
        view = self._view
        if view is None or view.epoch != self.epoch:
            has = frozenset()
            if self.state is StepState.REDUCED:  # None: every param (nothing to hash)
                full = len(self._published) == len(self.params)
                has = None if full else frozenset(self.params[k] for k in self._published)
            settle = functools.partial(self.landing.settle, self)  # owed copies: grad_landing
            view = self._view = ReducedGrads(
                self, self.epoch, self.index, has, nonfinite=self.nonfinite, settle=settle
            )
        return view
