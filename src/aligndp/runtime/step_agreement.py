"""The end-of-backward agreement (:class:`StepAgreement`): the int32 flags each rank encodes,
what every rank decides from their sum, the problems carried to the next step; and the
read-only view of the reduced gradients a reduction hands the optimizer (:class:`ReducedGrads`).

[Note: step states] (DESIGN.md): at the end of every synchronised backward the ranks sum one
int32 vector and every rank decides the same from it. Its layout, ``n`` params in
registration order:

    [0, n)          had a gradient on this rank (used)
    [n, 2n)         received a gradient after its bucket's collective started (late)
    [2n, 3n)        read in forward before its all-gather was waited for (stale read)
    with check_finite:
    [3n, 4n)        non-finite local gradient elements before the reduction
    [4n, 4n + dp)   the same, summed per rank (slot r holds rank r's total)
"""

from __future__ import annotations

from collections.abc import Callable, Container, Mapping, Sequence
from typing import NamedTuple, Protocol

import torch
import torch.nn as nn

from aligndp.runtime.collectives import Collectives
from aligndp.runtime.step_state import ParamIndex

__all__ = [
    "Agreed",
    "PendingFlags",
    "ReducedGrads",
    "StepAgreement",
    "decode_flags",
    "encode_flags",
    "flag_values",
    "nonfinite_counts",
]


class Agreed(NamedTuple):
    """What every rank decides from the summed flags."""

    used: list[nn.Parameter]
    """Params some rank had a gradient for, in registration order."""
    nonfinite: str
    """``"'name': k element(s), ... on rank r, ..."``; empty when every gradient was finite."""
    problems: str
    """The error message of late or stale-read params; empty when there are none."""


class PendingFlags(NamedTuple):
    """Summed flags being copied to the host without waiting (read at the next reduction)."""

    host: torch.Tensor
    event: torch.cuda.Event | None
    """Recorded after the copy on CUDA; None where the flags already are on the host."""


def flag_values(
    params: Sequence[nn.Parameter],
    *,
    used: Sequence[bool],
    late: Container[nn.Parameter],
    stale_read: Container[nn.Parameter],
) -> list[int]:
    """This rank's used, late and stale-read flags as Python ints (``used`` by param index;
    no param is hashed when ``late`` and ``stale_read`` are empty, the usual case)."""
    n = len(params)
    flags = [1 if u else 0 for u in used]
    flags += [1 if p in late else 0 for p in params] if late else [0] * n
    flags += [1 if p in stale_read else 0 for p in params] if stale_read else [0] * n
    return flags


def encode_flags(
    values: list[int],
    *,
    nonfinite: torch.Tensor | None,
    rank: int,
    dp_size: int,
    device: torch.device,
) -> torch.Tensor:
    """This rank's flags on ``device`` (:func:`flag_values`, then with check_finite the
    per-param counts ``nonfinite``, an int32 tensor on ``device``, and the per-rank totals)."""
    local = torch.tensor(values, dtype=torch.int32)
    if device.type == "cuda":
        local = local.pin_memory().to(device, non_blocking=True)
    if nonfinite is None:
        return local
    on_rank = torch.zeros(dp_size, dtype=torch.int32, device=device)
    on_rank[rank] = nonfinite.sum()
    return torch.cat([local, nonfinite, on_rank])


def decode_flags(
    values: Sequence[int], *, params: Sequence[nn.Parameter], names: Mapping[nn.Parameter, str]
) -> Agreed:
    """The decision every rank takes from the summed flags (``values``, as Python ints)."""
    n = len(params)
    used = [p for p, v in zip(params, values[:n]) if v]
    late = [names[p] for p, v in zip(params, values[n : 2 * n]) if v]
    stale = [names[p] for p, v in zip(params, values[2 * n : 3 * n]) if v]
    nonfinite = ", ".join(
        f"{names[p]!r}: {v} element(s)" for p, v in zip(params, values[3 * n : 4 * n]) if v
    )
    if nonfinite:
        ranks = [r for r, v in enumerate(values[4 * n :]) if v]
        nonfinite = f"{nonfinite} on " + ", ".join(f"rank {r}" for r in ranks)
    problems = []
    if late:
        problems.append(
            f"params {late[:5]} received a gradient after their bucket's collective started "
            "(a fused-wgrad layer used more often than in the previous step); that contribution "
            "is lost: call opt.zero_grad() and repeat the step, or build the model so every "
            "fused layer is used the same number of times per step"
        )
    if stale:
        problems.append(
            f"params {stale[:5]} were read in forward before their all-gather was waited for "
            "(read outside their own module's forward, e.g. F.linear(x, self.head.weight) or a "
            "tied weight), so the forward used stale values: use overlap_param_gather=False, or "
            "call the module that owns them"
        )
    return Agreed(used, nonfinite, "; ".join(problems))


def to_host_async(flags: torch.Tensor) -> PendingFlags:
    """``flags`` copied to pinned host memory behind an event, without waiting for them."""
    if flags.device.type != "cuda":
        return PendingFlags(flags, None)
    host = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=True)
    host.copy_(flags, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return PendingFlags(host, event)


def nonfinite_counts(
    bucket: torch.Tensor, *, starts: torch.Tensor, ends: torch.Tensor
) -> torch.Tensor:
    """Non-finite (NaN, +Inf, -Inf) elements of ``bucket[starts[k]:ends[k]]`` for every k.

    One pass over the bucket whatever the number of params in it, and no host sync: the
    non-finite mask's running count (int32 while the bucket allows, else int64), read at
    each span's ends. ``starts``/``ends``: int64 tensors on the bucket's device.
    """
    if bucket.numel() == 0:
        return torch.zeros(starts.shape, dtype=torch.int64, device=bucket.device)
    bad = ~torch.isfinite(bucket)
    count_dtype = torch.int32 if bucket.numel() < 2**31 else torch.int64
    running = torch.cumsum(bad, 0, dtype=count_dtype)  # running[i] = bad[: i + 1].sum()

    def before(stop: torch.Tensor) -> torch.Tensor:  # bad[:stop].sum() for every stop
        return torch.where(stop > 0, running[(stop - 1).clamp(min=0)], 0)

    return before(ends) - before(starts)


class StepAgreement:
    """The agreement of one model's synchronised backwards: counts non-finite local gradients
    per bucket (``check_finite``), sums the flags over the ranks and decides, and keeps an
    unread sum's problems for the next reduction.

    [Note: agreement without a host sync]
    The flags' all-reduce is always launched, but read on the host only when this rank
    needs the answer now: some param had no gradient here (is it used elsewhere?) or
    ``check_finite`` (skip or raise before the step). When every param had a gradient
    here, every param has one globally, so nothing waits: the flags are copied to pinned
    memory behind an event, and the problems they may carry (rare: a fused layer used
    more often, a stale read) are raised at the end of the next reduction, on every rank
    alike. One rank alone (dp 1, no check_finite) agrees with itself on the host: its
    flags never go to the device.
    """

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        names: Mapping[nn.Parameter, str],
        *,
        rank: int,
        world_size: int,
        device: torch.device,
        check_finite: bool,
        buckets: Sequence = (),
    ) -> None:
        """``rank`` among the ``world_size`` ranks that agree; ``buckets``: the model's
        :class:`~aligndp.runtime.bucket.Bucket` s (their spans, for ``check_finite``)."""
        # the reducer's own list, not a copy: publishing knows "every param" by identity
        # (``used is params``) and hashes no param ([Note: one rank's host time])
        self.params, self.names = params, names
        self.rank, self.world_size, self.device = rank, world_size, device
        self.check_finite = check_finite
        self._spans = {b.position: self._spans_of(b) for b in buckets} if check_finite else {}
        self._nonfinite: torch.Tensor | None = None
        self._pending: PendingFlags | None = None

    def _spans_of(self, bucket) -> torch.Tensor:
        """``(3, k)`` int64 on the device: flag index, start and end (in the bucket) of each
        of the bucket's k params, for :meth:`count_nonfinite`."""
        first = bucket.buffer.layout.buckets[bucket.ref.bucket].start
        rows = [(s.index, s.slot.start - first, s.slot.end - first) for s in bucket.slots]
        return torch.tensor(rows, dtype=torch.int64).t().contiguous().to(self.device)

    def count_nonfinite(self, bucket, grad: torch.Tensor) -> None:
        """Count non-finite local gradient elements per param of ``bucket`` (its ``grad``):
        one pass on the device, no host sync (the counts are read with the flags)."""
        if self._nonfinite is None:
            self._nonfinite = torch.zeros(len(self.params), dtype=torch.int32, device=self.device)
        index, starts, ends = self._spans[bucket.position]
        counts = nonfinite_counts(grad, starts=starts, ends=ends)
        self._nonfinite.index_add_(0, index, counts.to(torch.int32))

    def agree(
        self,
        *,
        used: Sequence[bool],
        late: Container[nn.Parameter],
        stale_read: Container[nn.Parameter],
        collectives: Collectives,
    ) -> Agreed:
        """Sum this rank's flags over the ranks and decide; read on the host only when this
        rank needs the answer now ([Note: agreement without a host sync])."""
        values = flag_values(self.params, used=used, late=late, stale_read=stale_read)
        if self.world_size == 1 and not self.check_finite:  # one rank agrees with itself
            if all(used) and not any(values[len(self.params) :]):
                return Agreed(self.params, "", "")
            return self._decode(values)
        if all(used) and not self.check_finite:
            self._pending = to_host_async(self._flags(values, collectives))
            return Agreed(self.params, "", "")
        return self._decode(self._flags(values, collectives).tolist())

    def _flags(self, values: list[int], collectives: Collectives) -> torch.Tensor:
        """This rank's flags on the device, summed over the ranks."""
        nonfinite = None
        if self.check_finite:
            nonfinite = self._nonfinite
            if nonfinite is None:
                nonfinite = torch.zeros(len(self.params), dtype=torch.int32, device=self.device)
        local = encode_flags(
            values, nonfinite=nonfinite, rank=self.rank, dp_size=self.world_size, device=self.device
        )
        if self.world_size > 1:
            collectives.all_reduce_sum(local)
        return local

    def _decode(self, values: list[int]) -> Agreed:
        return decode_flags(values, params=self.params, names=self.names)

    def raise_pending(self) -> None:
        """Problems the last unread sum carried (long finished by now): raise them on every
        rank alike."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        if pending.event is not None:
            pending.event.synchronize()
        problems = self._decode(pending.host.tolist()).problems
        if problems:
            raise RuntimeError(f"in the previous step: {problems}")

    def reset(self) -> None:
        """A new round: the non-finite counts so far are dropped."""
        self._nonfinite = None


def nonfinite_message(nonfinite: str, *, skip: bool) -> str:
    """The agreed message of a reduction with non-finite gradient elements (``nonfinite``:
    :attr:`Agreed.nonfinite`); ``skip``: ``on_nonfinite="skip"``."""
    return f"non-finite (NaN/Inf) gradient elements before the reduction: {nonfinite}; " + (
        "the optimizer step is skipped on every rank"
        if skip
        else "lower the learning rate or check the loss, then call opt.zero_grad() "
        "to drop this step (or parallelize(..., on_nonfinite='skip') to skip such "
        "steps on every rank)"
    )


class ReducedGrads:
    """A read-only view of one reduction's gradients, what ``finish_grad_sync()`` hands the
    optimizer ([Note: reduced grads view]).

    Valid while its ``epoch`` is the reducer's: a new reduction, ``zero_grad`` or a gradient
    reopening the buffers moves the epoch, and every read of an older view raises a
    ``RuntimeError`` (an optimizer must never step from gradients that moved under it).
    """

    def __init__(
        self,
        source: _EpochSource,
        epoch: int,
        index: ParamIndex,
        has: frozenset | None,
        *,
        nonfinite: str | None = None,
        settle: Callable[[], None] = lambda: None,
    ) -> None:
        """``settle``: fills the views before they are read (the copies one rank may owe,
        [Note: one rank steps autograd's gradients] in grad_landing.py)."""
        self._source = source
        self._settle = settle
        self.epoch = epoch
        """The reducer's epoch when this view was taken."""
        self._slots = index.slots
        self.has = has
        """The params with a reduced gradient (some rank had one); None when every param has
        one. Read as taken: :meth:`check` first where the view may be old."""
        self.nonfinite = nonfinite
        """The agreed message when some gradient was not finite (``check_finite``), else None."""

    def check(self) -> None:
        """Raise if the gradients moved on since this view was taken."""
        if self._source.epoch != self.epoch:
            raise RuntimeError(
                f"these reduced gradients are stale (taken at epoch {self.epoch}, now "
                f"{self._source.epoch}: zero_grad, a new backward or a reduction came since); "
                "take a new view with model.finish_grad_sync()"
            )

    def has_grad(self, param: nn.Parameter) -> bool:
        """Whether ``param`` has a reduced gradient (some rank had one for it)."""
        self.check()
        return self.has is None or param in self.has

    def view(self, param: nn.Parameter) -> torch.Tensor:
        """``param``'s reduced gradient in its buffer's dtype, shaped like the param: valid
        everywhere when replicated, only in :meth:`owned` when sharded or layer-wise."""
        self.check()
        self._settle()
        return self._slots[param].view

    def owned(self, param: nn.Parameter) -> torch.Tensor:
        """The flat elements of ``param``'s reduced gradient this rank holds: all of them when
        replicated, its :class:`~aligndp.plan.slots.OwnedPiece` otherwise (maybe empty)."""
        self.check()
        self._settle()
        slot = self._slots[param]
        flat = slot.view.view(-1)
        return flat if slot.owned is None else flat[slot.owned.lo : slot.owned.hi]


class _EpochSource(Protocol):
    epoch: int
