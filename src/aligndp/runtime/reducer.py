"""The gradient reducer of :class:`~aligndp.runtime.ddp.DataParallel` (``model.reducer``, over
its :class:`~aligndp.runtime.bucket.Bucket` s): per-param hooks, bucket readiness and launch
order, the step states, the optimizer's step window. Where gradients land: grad_landing.py;
what the ranks agree: step_agreement.py. ``state`` changes in these transitions only:

    _begin_accumulating   IDLE -> ACCUMULATING      the first gradient of a new step
    _reopen               REDUCED -> ACCUMULATING   a gradient after the reduction
    finish_grad_sync      ACCUMULATING -> REDUCED   the end of a synchronised backward
    zero_grad_buffer      any -> IDLE               a new step begins (``zero_grad``)

[Note: one closure per param]
Per-param state is lists indexed by the param's registration index ``k`` (no hash of a
param); each param's post-accumulate hook is a closure bound to its ``k``, which finds its
view and bucket through the reducer (weakly: [Note: dropped wrappers]). On the direct path
([Note: gradient as bucket view] in ddp.py) the hook only marks the param written and counts
its bucket down; all else goes through ``Landing.absorb`` first. A fused kernel's
``mark_ready`` runs the same ``arrive`` closure; its weight is never armed.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Collection, Iterator, Mapping, Sequence

import torch
import torch.nn as nn

from aligndp.plan.fused import GradTarget
from aligndp.runtime.bucket import Bucket
from aligndp.runtime.collectives import Collectives
from aligndp.runtime.grad_landing import Landing
from aligndp.runtime.step_agreement import ReducedGrads, StepAgreement, nonfinite_message
from aligndp.runtime.step_state import ParamIndex, RoundReport, StepState

__all__ = ["GradReducer"]

# read per gradient: globals, not enum or attribute lookups
_ACCUMULATING, _REDUCED, _STRIDED = StepState.ACCUMULATING, StepState.REDUCED, torch.strided


class GradReducer:
    """Gradient hooks, readiness, the step states and the reduced-gradient view of one model."""

    param_gather = None
    """The model's :class:`~aligndp.runtime.param_gather.ParamGather`, set by its DataParallel."""

    def __init__(
        self,
        index: ParamIndex,
        buckets: Sequence[Bucket],
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
        all ranks; ``eager_zero``, ``fused``: see :class:`~aligndp.runtime.grad_landing.Landing`."""
        self.index, self.buckets, self.config = index, list(buckets), config
        self.params, self.param_names = list(params), names
        self.collectives, self.rank, self.device = collectives, rank, device
        self.dp_size = collectives.dp_size
        self.world_size = self.dp_size * collectives.replicas  # the agreement's ranks
        n = len(self.params)
        self._k = {p: k for k, p in enumerate(self.params)}
        alone = self.world_size == 1 and not config.check_finite
        self.landing = L = Landing(index, self.buckets, self.params, eager_zero=eager_zero,
                                   fused=fused, alone=alone)  # fmt: skip
        # the per-param landing state (grad_landing.py), read here
        self._views, self._stale, self._armed, self._direct = L.views, L.stale, L.armed, L.direct
        self._eager_zero, self._published, self._members = L.eager_zero, L.published, L.members
        self._bucket_of = L.bucket_of  # param index -> its Bucket
        self._used = [False] * n  # had a gradient on this rank since the reduction
        self._fired = [0] * n  # [Note: bucket readiness]: arrivals this round
        self._undefined = [False] * n  # [Note: undefined gradients]
        self._expected = [-1] * n  # arrivals in the last synchronised round (-1: none yet)
        self.state = StepState.IDLE
        self.epoch = 0
        """Moves at every reduction, reopen and ``zero_grad``: a :class:`ReducedGrads` of an
        older epoch refuses to be read."""
        self._view: ReducedGrads | None = None
        self._problems: dict[str, set[nn.Parameter]] = {"late": set(), "stale_read": set()}
        self.agreement = StepAgreement(  # the end-of-backward agreement
            self.params, names, rank=rank, world_size=self.world_size, device=device,
            check_finite=config.check_finite, buckets=self.buckets)  # fmt: skip
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
            bucket = r._bucket_of[k]
            if bucket.position < r._next_launch:
                r._problems["late"].add(param)  # only a fused layer used more often than last time
            elif n == expected[k]:  # [Note: bucket readiness]: one count per bucket
                bucket.countdown -= 1
                if not bucket.countdown and bucket.position == r._next_launch:
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
                and r._bucket_of[k].defer
            ):
                if state is not _ACCUMULATING:
                    r._begin_accumulating()
                r._bucket_of[k].deferred.append((k, grad))
                arrive(r, param)
            elif r.landing.absorb(r, param, k):
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
        self.landing.settle()  # [Note: one rank steps autograd's gradients]
        if self.collecting and self.state is not StepState.REDUCED:
            self.landing.collect(self)
        self._bucket_of[k].land_deferred(self._armed)
        self.landing.take(k)
        if self.state is StepState.IDLE:
            self._begin_accumulating()
        return self._views[k]

    def mark_ready(self, param: nn.Parameter) -> None:
        """A fused-wgrad kernel has written ``param``'s gradient into its view."""
        self._reopen()
        self._begin_accumulating()
        self._arrive[self._k[param]](self, param)

    def param_writes(self) -> int:
        """The GradSink's count of param writes torch's version counters miss (the param
        gathers): quantised-weight caches key on it ([Note: weights once per step] in
        aligndp/lowp/linear.py)."""
        return 0 if self.param_gather is None else self.param_gather.writes

    def buckets_in_flight(self) -> list:
        """Buckets launched and not yet waited for, in launch order (empty outside backward)."""
        return [b.ref for b in self.buckets if b.reducing]

    def note_unwaited(self, params: set[nn.Parameter]) -> None:
        """``params`` were read in forward before their all-gather was waited for."""
        self._unwaited |= params

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (micro-batches); the next backward outside syncs them."""
        previous = self._sync_enabled
        self._sync_enabled = False
        try:
            yield
        finally:
            self._sync_enabled = previous

    # ---- readiness and launches ----
    def _launch_ready(self) -> None:
        """Launch the buckets from the next one on while they have counted down to zero."""
        buckets = self.buckets
        while self._next_launch < len(buckets) and not buckets[self._next_launch].countdown:
            self._launch(buckets[self._next_launch])

    def _launch(self, bucket: Bucket) -> None:
        assert bucket.position == self._next_launch, "buckets launch in index order"
        bucket.land_deferred(self._armed)  # [Note: one copy per bucket] in grad_landing.py
        stale, used, eager_zero = self._stale, self._used, self._eager_zero
        for k in self._members[bucket.position]:
            if stale[k]:
                self.landing.take(k)
            elif not eager_zero[k]:
                used[k] = True  # written since zero_grad: by autograd, a fused kernel or the user
        grad = bucket.grad()
        if self.config.check_finite:
            self.agreement.count_nonfinite(bucket, grad)
        bucket.launch_reduce(grad)
        self._next_launch += 1

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

    # ---- the named transitions ([Note: step states]) ----
    def _begin_accumulating(self) -> None:
        """IDLE -> ACCUMULATING: the first gradient of a new step (after ``zero_grad``) — a
        hook, a fused kernel's ``mark_ready`` or a touch of ``param.main_grad``. A no-op in
        ACCUMULATING; REDUCED must :meth:`_reopen` first."""
        assert self.state is not StepState.REDUCED, "reopen the reduced grads first"
        self.state = StepState.ACCUMULATING

    def _reopen(self) -> None:
        """REDUCED -> ACCUMULATING: make the buffers hold the visible grads again
        ([Note: step states], ``Landing.reopen``); a no-op in any other state."""
        if self.state is not StepState.REDUCED:
            return
        self.landing.settle()  # the views take the adopted gradients first
        self.state = StepState.ACCUMULATING
        self.epoch += 1
        self.landing.reopen(self._used, self.dp_size)

    def finish_grad_sync(self) -> ReducedGrads:
        """Reduce what has accumulated (launch every bucket not yet launched, wait for all),
        agree with the other ranks and publish ``param.grad``: ACCUMULATING -> REDUCED, a
        no-op in any other state. Runs by itself at the end of every synchronised backward.
        Returns the read-only view of the reduced gradients ([Note: reduced grads view])
        ([Note: agreement without a host sync] in step_agreement.py)."""
        if self.collecting and self.state is not StepState.REDUCED:
            # [Note: one rank collects at the end] in grad_landing.py, maybe adopting
            self.landing.collect(self, adopt=self.landing.adopting)
        if self.state is StepState.IDLE:  # [Note: undefined gradients]: armed views drop
            self.landing.drop_armed()
        if self.state is not StepState.ACCUMULATING:
            return self.reduced()
        self.agreement.raise_pending()
        while self._next_launch < len(self.buckets):
            self._launch(self.buckets[self._next_launch])
        for bucket in self.buckets:
            bucket.wait_reduce()
        used, nonfinite, problems = self.agreement.agree(
            used=self._used,
            late=self._problems["late"],
            stale_read=self._problems["stale_read"],
            collectives=self.collectives,
        )
        self.last_round = RoundReport(self._launched_in_backward, len(self.buckets), len(used))
        if self.config.overlap:  # [Note: bucket readiness]: this round's counts are the hints
            self._expected[:] = self._fired
            direct, expected = self._direct, self._expected
            for b in self.buckets:  # [Note: one copy per bucket] in grad_landing.py
                b.defer = all(direct[s.index] and expected[s.index] == 1 for s in b.slots)
        self._reset_round()
        self.epoch += 1
        self.state = StepState.REDUCED
        self.landing.publish(used, self._k)
        self.nonfinite = None
        if nonfinite:
            skip = self.config.on_nonfinite == "skip"
            self.nonfinite = nonfinite_message(nonfinite, skip=skip)
            if not skip:
                raise FloatingPointError(self.nonfinite)
        if problems:
            raise RuntimeError(problems)
        return self.reduced()

    def _reset_round(self) -> None:
        n = len(self.params)
        self._fired[:] = [0] * n
        for b in self.buckets:
            b.countdown = len(b.params)
            b.reducing = False
            b.deferred = []
        self._next_launch = 0
        self._launched_in_backward = 0
        self._used[:] = [False] * n
        self._problems = {"late": set(), "stale_read": set()}
        self.agreement.reset()
        self._unwaited = set()

    def zero_grad_buffer(self) -> None:
        """Start a new step (-> IDLE): every ``main_grad`` counts as zero ([Note: lazy zeroing]),
        every ``param.grad`` is dropped."""
        self._stale[:] = self.landing.stale_at_zero
        self.landing.zero_buffers()
        for p in self.params:
            p.grad = None
        self._armed[:] = [False] * len(self.params)
        self._published.clear()
        self._reset_round()
        self._callback_queued = False
        self.nonfinite = None
        self.epoch += 1
        self.state = StepState.IDLE

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Same as ``opt.zero_grad()``. ``set_to_none=False`` keeps zero gradients visible, so
        params unused in the next step are still stepped (with zero gradient), as in torch."""
        self.zero_grad_buffer()
        if not set_to_none:
            self._used[:] = [True] * len(self.params)
            self._begin_accumulating()

    def shadow_backward(self) -> ReducedGrads:
        """A rank that ran out of batches under ``Join`` ([Note: join] in join.py): the
        collectives of the others' synchronised backward with zero gradients of its own — every
        bucket in launch order, then the agreement — so it ends REDUCED with their reduced
        gradients, ready to step. The readiness hints of its own backwards are kept."""
        expected = list(self._expected)
        self.zero_grad_buffer()
        self._begin_accumulating()
        try:
            return self.finish_grad_sync()
        finally:
            self._expected[:] = expected

    def reduced(self) -> ReducedGrads:
        """The read-only view of the current gradients ([Note: reduced grads view]): the last
        reduction's in REDUCED, none otherwise (IDLE: nothing to step)."""
        view = self._view
        if view is None or view.epoch != self.epoch:
            has = frozenset()
            if self.state is StepState.REDUCED:  # None: every param (nothing to hash)
                full = len(self._published) == len(self.params)
                has = None if full else frozenset(self.params[k] for k in self._published)
            settle = self.landing.settle  # the copies one rank may owe: grad_landing.py
            view = self._view = ReducedGrads(
                self, self.epoch, self.index, has, nonfinite=self.nonfinite, settle=settle
            )
        return view

    def grads_for_step(self) -> ReducedGrads:
        """:meth:`finish_grad_sync` once the gathers in flight (they read the step's shards) end."""
        self.param_gather.wait_all()
        return self.finish_grad_sync()

    @contextlib.contextmanager
    def update(self) -> Iterator[ReducedGrads]:
        """The optimizer's step window ([Note: one step, top-down] in optim/composite.py): hand
        the step :meth:`grads_for_step`; after it, launch every bucket's gather not yet
        launched. A skipped step (non-finite gradients) or one that raised launches none."""
        grads = self.grads_for_step()
        yield grads
        if grads.nonfinite is None:
            self.param_gather.launch_rest()
