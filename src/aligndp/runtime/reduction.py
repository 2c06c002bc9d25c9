"""The reduction half of :class:`~aligndp.runtime.grad_sync.GradReducer`: launches in index
order, and the end-of-backward agreement that publishes ``param.grad``.

:class:`Reduction` is the reducer's base class (one object, two files: grad_sync.py holds its
state, hooks and transitions); each bucket's collective is its
:class:`~aligndp.runtime.bucket_group.BucketGroup`'s. [Note: bucket readiness] and
[Note: step states] are in DESIGN.md.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from aligndp.runtime.bucket_group import BucketGroup
from aligndp.runtime.step_flags import (
    Agreed,
    decode_flags,
    encode_flags,
    flag_values,
    nonfinite_counts,
    to_host_async,
)
from aligndp.runtime.step_state import ReducedGrads, RoundReport, StepState

__all__ = ["Reduction"]


class Reduction:
    """Launches in index order and ``finish_grad_sync`` (ACCUMULATING -> REDUCED)."""

    param_gather = None
    """The model's :class:`~aligndp.runtime.param_gather.ParamGather`, set by its DataParallel."""

    def param_writes(self) -> int:
        """The GradSink's count of param writes torch's version counters miss (the param
        gathers): quantised-weight caches key on it ([Note: weights once per step] in
        aligndp/lowp/linear.py)."""
        return 0 if self.param_gather is None else self.param_gather.writes

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (micro-batches); the next backward outside syncs them."""
        previous = self._sync_enabled
        self._sync_enabled = False
        try:
            yield
        finally:
            self._sync_enabled = previous

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Same as ``opt.zero_grad()``. ``set_to_none=False`` keeps zero gradients visible, so
        params unused in the next step are still stepped (with zero gradient), as in torch."""
        self.zero_grad_buffer()
        if not set_to_none:
            self._used[:] = [True] * len(self.params)
            self._begin_accumulating()

    # ---- readiness and collectives ----
    def _launch_ready(self) -> None:
        """Launch the groups from the next one on while they have counted down to zero."""
        groups = self.groups
        while self._next_launch < len(groups) and not groups[self._next_launch].countdown:
            self._launch(groups[self._next_launch])

    def _launch(self, group: BucketGroup) -> None:
        assert group.position == self._next_launch, "buckets launch in index order"
        self._flush(group)  # [Note: one copy per bucket] in grad_landing.py
        stale, used, eager_zero = self._stale, self._used, self._eager_zero
        for k in self._members[group.position]:
            if stale[k]:
                self._take(k)
            elif not eager_zero[k]:
                used[k] = True  # written since zero_grad: by autograd, a fused kernel or the user
        grad = group.grad()
        if self.config.check_finite:
            self._check_finite(group, grad)
        group.launch_reduce(grad)
        self._next_launch += 1

    def _spans(self, group: BucketGroup) -> torch.Tensor:
        """``(3, k)`` int64 on the device: flag index, start and end (in the bucket) of each
        of the bucket's k params, for :meth:`_check_finite`."""
        first = group.buffer.layout.buckets[group.ref.bucket].start
        rows = [(s.index, s.slot.start - first, s.slot.end - first) for s in group.slots]
        return torch.tensor(rows, dtype=torch.int64).t().contiguous().to(self.device)

    def _check_finite(self, group: BucketGroup, grad: torch.Tensor) -> None:
        """Count non-finite local gradient elements per param: one pass over the bucket, on
        the device (no host sync; the counts are read with the agreement)."""
        if self._nonfinite is None:
            self._nonfinite = torch.zeros(len(self.params), dtype=torch.int32, device=self.device)
        index, starts, ends = self._finite_spans[group.position]
        counts = nonfinite_counts(grad, starts=starts, ends=ends)
        self._nonfinite.index_add_(0, index, counts.to(torch.int32))

    def finish_grad_sync(self) -> ReducedGrads:
        """Reduce what has accumulated (launch every bucket not yet launched, wait for all),
        agree with the other ranks and publish ``param.grad``: ACCUMULATING -> REDUCED, a
        no-op in any other state. Runs by itself at the end of every synchronised backward.
        Returns the read-only view of the reduced gradients ([Note: reduced grads view]).

        [Note: agreement without a host sync]
        The flags' all-reduce is always launched, but read on the host only when this rank
        needs the answer now: some param had no gradient here (is it used elsewhere?) or
        ``check_finite`` (skip or raise before the step). When every param had a gradient
        here, every param has one globally, so nothing waits: the flags are copied to pinned
        memory behind an event, and the problems they may carry (rare: a fused layer used
        more often, a stale read) are raised at the end of the next reduction, on every rank
        alike. One rank alone (dp 1, no check_finite) agrees with itself on the host: its
        flags never go to the device."""
        if self.collecting and self.state is not StepState.REDUCED:
            # [Note: one rank collects at the end] in grad_landing.py, maybe adopting
            self.landing.collect(self, adopt=self.landing.adopting)
        if self.state is StepState.IDLE:  # [Note: undefined gradients]: armed views drop
            for k in [k for k, armed in enumerate(self._armed) if armed]:
                self.params[k].grad = None
                self._armed[k] = False
        if self.state is not StepState.ACCUMULATING:
            return self.reduced()
        self._raise_pending_problems()
        while self._next_launch < len(self.groups):
            self._launch(self.groups[self._next_launch])
        for group in self.groups:
            group.wait_reduce()
        values = flag_values(
            self.params,
            used=self._used,
            late=self._problems["late"],
            stale_read=self._problems["stale_read"],
        )
        if self.world_size == 1 and not self.config.check_finite:
            used, nonfinite, problems = self._decide(values)  # one rank agrees with itself
        elif all(self._used) and not self.config.check_finite:
            used, nonfinite, problems = self.params, "", ""
            self._pending_flags = to_host_async(self._flags(values))
        else:
            used, nonfinite, problems = self._decode(self._flags(values).tolist())
        self.last_round = RoundReport(self._launched_in_backward, len(self.groups), len(used))
        if self.config.overlap:  # [Note: bucket readiness]: this round's counts are the hints
            self._expected[:] = self._fired
            direct, expected = self._direct, self._expected
            for g in self.groups:  # [Note: one copy per bucket] in grad_landing.py
                g.defer = all(direct[s.index] and expected[s.index] == 1 for s in g.slots)
        self._reset_round()
        self.epoch += 1
        self.state = StepState.REDUCED
        armed, adopted, params, views = self._armed, self.landing.adopted, self.params, self._views
        ks = range(len(params)) if used is params else [self._k[p] for p in used]
        for k in ks:  # [Note: one rank's host time] in grad_landing.py
            shown = self._shown[k]
            if shown is not None:
                params[k].grad = shown
                armed[k] = False
            elif adopted[k] is None and params[k].grad is not views[k]:
                p, view = params[k], views[k]
                p.grad = view if view.dtype == p.dtype else view.to(p.dtype)
        self._published.update(ks)
        if len(used) < len(self.params):  # an armed param without a gradient shows None
            for k, p in enumerate(self.params):
                if armed[k] and k not in self._published:
                    p.grad = None
                    armed[k] = False
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
        return self.reduced()

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

    def _flags(self, values: list[int]) -> torch.Tensor:
        """This rank's flags (step_flags.py) on the device, summed over the ranks."""
        nonfinite = None
        if self.config.check_finite:
            nonfinite = self._nonfinite
            if nonfinite is None:
                nonfinite = torch.zeros(len(self.params), dtype=torch.int32, device=self.device)
        local = encode_flags(
            values, nonfinite=nonfinite, rank=self.rank, dp_size=self.world_size, device=self.device
        )
        if self.world_size > 1:
            self.collectives.all_reduce_sum(local)
        return local

    def _decide(self, values: list[int]) -> Agreed:
        """The agreement of one rank: its own flags, decoded on the host (no device copy)."""
        if all(self._used) and not any(values[len(self.params) :]):
            return Agreed(self.params, "", "")
        return self._decode(values)

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
