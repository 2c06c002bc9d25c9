"""The reduction side of :class:`~aligndp.runtime.ddp.DataParallel`: bucket readiness, launches
in index order, and the end-of-backward agreement that publishes ``param.grad``.

:class:`Reduction` is a mixin of :class:`~aligndp.runtime.grad_sync.GradSync` (which owns the
state it reads: ``_expected``, ``_fired``, ``_waiting``, ``_works``, ``_next_launch`` ...);
[Note: bucket readiness] and [Note: step states] are in DESIGN.md.
"""

from __future__ import annotations

import torch

from aligndp.plan.spec import Mode
from aligndp.runtime.step_flags import (
    Agreed,
    decode_flags,
    encode_flags,
    nonfinite_counts,
    to_host_async,
)
from aligndp.runtime.step_state import BucketRef, RoundReport, StepState

__all__ = ["Reduction"]


class Reduction:
    """Readiness, bucket collectives and ``finish_grad_sync`` (ACCUMULATING -> REDUCED)."""

    # ---- readiness and collectives ----
    def _waiting_counts(self) -> list[int]:
        """Per launch position, the bucket's params: each counts down once, when it has fired
        as often as in the last synchronised backward (``_arrived``). A param that had no
        gradient then never counts down, so its bucket waits for the end of backward."""
        return [len(self._bucket_params[ref]) for ref in self.bucket_refs]

    def _launch_ready(self) -> None:
        while self._next_launch < len(self.bucket_refs) and not self._waiting[self._next_launch]:
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
        if self.world_size == 1:
            self._works[ref] = None
        elif buf.layout.mode is Mode.REPLICATED:
            self._works[ref] = self.collectives.all_reduce_mean(grad)
        else:
            self._works[ref] = self.collectives.reduce_scatter_mean(grad)
        self._next_launch += 1

    def _spans(self, ref: BucketRef) -> torch.Tensor:
        """``(3, k)`` int64 on the device: flag index, start and end (in the bucket) of each
        of the bucket's k params, for :meth:`_check_finite`."""
        first = self.index.buffer(ref).layout.buckets[ref.bucket].start
        slots = [self._slot[p] for p in self._bucket_params[ref]]
        rows = [(s.index, s.slot.start - first, s.slot.end - first) for s in slots]
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
        self._waiting_after_reduction = self._waiting_counts()
        self._reset_round()
        self.reductions += 1
        self.state = StepState.REDUCED
        for p in used:
            slot = self._slot[p]
            if slot.sharded_grad is not None:
                p.grad = slot.sharded_grad
                self._armed.discard(p)
            elif p.grad is not slot.view:
                p.grad = slot.view if slot.view.dtype == p.dtype else slot.view.to(p.dtype)
            self._published.add(p)
        if len(used) < len(self.params):  # an armed param without a gradient shows None
            for p in self._armed - set(used):
                p.grad = None
                self._armed.discard(p)
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
            rank=self.world_rank,
            dp_size=self.world_size,
            device=self.device,
        )
        if self.world_size > 1:
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
