"""The bucket: the unit of the step, both directions of one unit of communication.

[Note: the bucket]
A :class:`Bucket` is built once per bucket of the plan from the model's
:class:`~aligndp.runtime.step_state.ParamIndex` (:func:`make_buckets`, in launch order) and
owns everything that happens to that bucket at run time:

- readiness: ``countdown``, the params still to arrive before its gradient collective may
  start ([Note: bucket readiness] in DESIGN.md), reset from the last synchronised backward;
- how its params' first gradients land when they are kept for one copy at launch
  (``defer``, ``deferred``, :meth:`land_deferred`: [Note: one copy per bucket] in
  grad_landing.py);
- the gradient reduction: :meth:`launch_reduce` (all-reduce or reduce-scatter, mean) and
  :meth:`wait_reduce`, with ``reducing`` true in between;
- the masters of this rank's owned pieces (``masters``, [Note: masters with the buckets] in
  masters.py), which an optimizer steps;
- the param all-gather of sharded and layer-wise buffers: :meth:`launch_gather` (casting the
  masters back into ``param_data`` first) and :meth:`wait_gather`.

The gradient reducer (reducer.py) decides *when* a bucket launches (strictly in position
order, so every rank issues the same sequence) and what the gradients mean; the param gather
(param_gather.py) decides in which order buckets gather and which reads wait for them. The
bucket size (``bucket_numel``) already sets how much one collective carries, and every call
through the collectives seam stays one bucket's tensor, so a backend (a 2-D mesh, FP8
gathers) sees the same calls as before. Megatron-Core groups several buckets to issue them
as one coalesced NCCL call; here that would be a larger ``bucket_numel``.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from aligndp.plan.spec import Mode
from aligndp.runtime.buffer import FlatBuffer
from aligndp.runtime.collectives import Collectives, Work
from aligndp.runtime.gather_codec import CodedGather, GatherCodec, Sources, coded_gather
from aligndp.runtime.masters import Master
from aligndp.runtime.step_state import BucketRef, GradSlot, ParamIndex

__all__ = ["Bucket", "make_buckets"]


class Bucket:
    """One bucket's readiness, landing, gradient collective, masters and param all-gather
    ([Note: the bucket])."""

    def __init__(
        self,
        ref: BucketRef,
        position: int,
        index: ParamIndex,
        *,
        collectives: Collectives,
        coded: CodedGather | None = None,
    ) -> None:
        self.ref = ref
        self.position = position
        """Launch position: the reducer launches bucket ``k`` only after buckets ``0..k-1``."""
        self.buffer: FlatBuffer = index.buffer(ref)
        self.params: tuple[nn.Parameter, ...] = index.members[ref]
        """The bucket's params, in registration order."""
        self.slots: tuple[GradSlot, ...] = tuple(index.slots[p] for p in self.params)
        self.collectives = collectives
        """The model's backend ([Note: collectives seam]); ``register_comm_hook`` replaces it."""
        self.replicated = self.buffer.layout.mode is Mode.REPLICATED
        self.gathers = self.buffer.param_data is not None
        """Whether the bucket holds params to all-gather after a step (sharded, layer-wise)."""
        self.coded = coded if coded is not None and ref in coded.buckets else None
        """Encodes and decodes this bucket's gather ([Note: FP8 param gather]), if it is
        low-precision."""
        self._grad = self.buffer.bucket_grad(ref.bucket)  # buffers are never reallocated
        self._param = self.buffer.bucket_param(ref.bucket) if self.gathers else None
        self.countdown = len(self.params)
        """Params still to arrive before the gradient collective may start."""
        self.reducing = False
        """The gradient collective was launched and not yet waited for."""
        self.defer = False
        """Its params' first gradients of a step are kept as autograd made them and copied into
        the buffer in one ``_foreach_copy_`` at launch ([Note: one copy per bucket] in
        grad_landing.py): set per round by the reducer from the last round's arrivals."""
        self.deferred: list[tuple[int, torch.Tensor]] = []
        """(param index, gradient) waiting for that copy."""
        self._member = {s.index: (p, s.view) for p, s in zip(self.params, self.slots)}
        """Param index -> (param, its gradient view)."""
        self.masters: tuple[Master, ...] | None = None
        """This rank's masters of the bucket's owned pieces, once :meth:`keep_masters` set them
        (the build step ``attach_masters``); None before."""
        self._cast_back: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        self._sources: Sources = {}
        self._reduce_work: Work | None = None
        self._gather_work: Work | None = None

    # ---- gradients ----
    def grad(self) -> torch.Tensor:
        """The bucket's elements of ``grad_data``."""
        return self._grad

    @torch.no_grad()
    def land_deferred(self, armed: list[bool]) -> None:
        """Copy the deferred gradients into their views (one ``_foreach_copy_``) and make each
        ``param.grad`` its view, marked in ``armed`` (by param index; the landing's,
        [Note: one copy per bucket] in grad_landing.py)."""
        deferred, self.deferred = self.deferred, []
        if not deferred:
            return
        members = [self._member[k] for k, _ in deferred]
        torch._foreach_copy_([view for _, view in members], [g for _, g in deferred])
        for (k, _), (param, view) in zip(deferred, members):
            param.grad = view
            armed[k] = True

    def launch_reduce(self, grad: torch.Tensor) -> None:
        """Start the bucket's gradient mean over the ranks (in place; a no-op on one rank)."""
        assert not self.reducing, "a bucket's gradient collective launches once per round"
        self.reducing = True
        if self.collectives.dp_size == 1 and self.collectives.replicas == 1:
            self._reduce_work = None
        elif self.replicated:
            self._reduce_work = self.collectives.all_reduce_mean(grad)
        else:
            self._reduce_work = self.collectives.reduce_scatter_mean(grad)

    def wait_reduce(self) -> None:
        """Wait for the gradient collective launched this round (if any)."""
        work, self._reduce_work = self._reduce_work, None
        if work is not None:
            work.wait()
        self.reducing = False

    # ---- params ----
    def keep_masters(self, masters: tuple[Master, ...]) -> None:
        """Keep ``masters`` (:func:`~aligndp.runtime.masters.bucket_masters` of this bucket):
        each launch casts the separate ones back and an FP8 gather encodes the coded ones."""
        self.masters = masters
        low = [m for m in masters if m.cast_back and not m.coded]
        self._cast_back = ([m.view for m in low], [m.master for m in low])
        self._sources = {id(m.param): m.master.view(-1) for m in masters if m.coded}

    def launch_gather(self) -> None:
        """Cast the bucket's masters back into ``param_data`` and start its param all-gather
        (``gathering`` until :meth:`wait_gather`). A coded gather encodes the coded masters
        ([Note: FP8 param gather])."""
        if not self.gathers:
            return
        if self._cast_back[0]:  # [Note: masters with the buckets] in masters.py
            torch._foreach_copy_(*self._cast_back)
        if self.coded is not None:  # [Note: FP8 param gather]: encode, then gather
            self._gather_work = self.coded.launch(self.ref, self._sources)
        elif self.collectives.dp_size > 1:
            self._gather_work = self.collectives.all_gather_shards(self._param)

    def wait_gather(self) -> bool:
        """Wait for the param all-gather in flight, if any (an FP8 one decodes); whether one
        was."""
        work, self._gather_work = self._gather_work, None
        if work is None:
            return False
        work.wait()
        if self.coded is not None:
            self.coded.finish(self.ref)
        return True

    def drop_gather(self) -> None:
        """Forget the gather in flight unwaited: another one failed
        ([Note: a failed gather] in param_gather.py)."""
        self._gather_work = None

    @property
    def gathering(self) -> bool:
        return self._gather_work is not None


def make_buckets(
    index: ParamIndex, *, collectives: Collectives, codec: GatherCodec | None = None
) -> list[Bucket]:
    """One :class:`Bucket` per bucket of ``index``, in launch order; ``codec`` encodes the
    buckets planned with a ``gather_dtype`` ([Note: FP8 param gather] in gather_codec.py)."""
    coded = coded_gather(index, codec, collectives=collectives)
    return [
        Bucket(ref, k, index, collectives=collectives, coded=coded)
        for k, ref in enumerate(index.refs)
    ]
