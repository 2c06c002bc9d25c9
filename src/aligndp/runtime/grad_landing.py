"""Where gradients land: each param's gradient view and what ``param.grad`` is, from arming
before a forward to publishing after the reduction — one :class:`Landing` per
:class:`~aligndp.runtime.reducer.GradReducer` (``reducer.landing``), which owns the per-param
landing state (views, stale, armed, published, adopted) and the paths below; the reducer's
hooks and transitions call it.

[Note: the landing paths]
A gradient reaches its bucket's view by one of these; each stays for the figure it buys
(docs/performance.md):

- *armed* (the default, [Note: gradient as bucket view] in ddp.py): ``param.grad`` is the
  view, autograd adds into the buffer itself, the hook only counts — no copy at all;
- *one copy per bucket* (below): autograd's tensors kept and copied at the bucket's launch —
  the compiled step's host time (per-param add launches were most of aligndp's extra host
  time over plain torch, gpt2-small, one H200);
- *collect at the end* and *adopt* (one rank, below): no per-param hooks; one copy, or none —
  one rank's compiled host time and the 1b eager step's parity with plain torch;
- *absorb* (:meth:`Landing.absorb`): off those paths (a dtype that differs, a backward whose
  forward bypassed the wrapper, ``create_graph``, a gradient after the reduction) — every
  behaviour torch has, at a copy's cost;
- *fused wgrad* ([Note: fused wgrad] in aligndp/plan/fused.py): the kernel writes the view.

[Note: one copy per bucket]
Arming ``param.grad`` with its view makes autograd's AccumulateGrad *add* each gradient into the
buffer: one kernel launch per param on the host, where plain torch *steals* the tensor the backward
made (no kernel). Under ``torch.compile`` the backward's own launches are few, so those per-param
launches were most of aligndp's extra host time over plain torch (one H200, gpt2-small;
docs/performance.md). So once a synchronised backward has shown which params arrive (the readiness
hints), a bucket whose params each arrived exactly once, and whose collective therefore launches
during backward, *defers*: its params are not armed, AccumulateGrad steals their gradients, the hook
keeps each (``Bucket.deferred``), and the bucket's launch copies them all into the buffer with
one ``torch._foreach_copy_`` (a few multi-tensor kernels) before its collective, then makes each
``param.grad`` the view, as the armed path would have. A deferred gradient lives until its bucket
launches: at most about one bucket of extra memory, since only buckets that launch during backward
defer (the first backward, a bucket holding a param unused last time, ``no_sync`` rounds and
fused-wgrad params keep the armed path). Anything that reads a view before its launch
(``param.main_grad``, the end of backward) flushes first.

[Note: deferring buckets are not zeroed]
A deferring bucket's views are overwritten by its copy, so ``zero_grad`` leaves them as they
are (``Landing.unzeroed``) and zeroes only the buckets autograd will add into, each run of
neighbouring ones in one op: once every param arrives once per step, nothing is zeroed at
all. Where a view of such a bucket is still stale when something reads it (an unused param
at its bucket's launch, ``param.main_grad``), ``Landing.take`` zeroes that view alone. A
bucket holding a param that keeps its own ``Parameter`` subclass (its ``main_grad`` is read
without us) is zeroed as before. On one H200 the whole-buffer zeroing was a visible part of
a 1b step.

[Note: one rank collects at the end]
One rank alone (dp 1, no replicas) reduces nothing, so there is nothing to overlap and no
reason to hear from each param as its gradient arrives. Where every buffer is direct, no
layer writes its own wgrad (fused), ``check_finite`` is off and no gather is coded, the
reducer is *collecting*: no per-param hook is registered and nothing is armed; autograd
steals each gradient into ``param.grad`` as in plain torch (and accumulates onto it over
micro-batches); one tensor hook on the wrapped module's output queues the end-of-backward
callback, which copies every ``param.grad`` into its view (one ``_foreach_copy_``; an add
where the view already holds a gradient), makes ``param.grad`` the view and reduces as
before ([Note: one rank steps autograd's gradients] skips even that copy).
``finish_grad_sync`` and ``param.main_grad`` collect first, so a backward that bypassed the
wrapper's output is still seen at the step. What one backward publishes, which params count
as used, the step states and the errors are those of the hooked path; the difference is the
host cost: on one H200, compiled gpt2-small, the hooks were a tenth of the step's host
time, against one Python loop over the params at the end (the compiled step came to parity
with plain torch; docs/performance.md). The price is memory: every gradient autograd made
lives until backward ends (the deferring path held about one bucket of them). Backward has
freed most activations by then, so the step's peak moved little: gpt2-small eager peaked
above plain torch by about the buffer itself.

[Note: one rank steps autograd's gradients]
Collecting with every buffer replicated (``sharding="none"``), nothing reads a view during the step:
the replicated part steps from ``param.grad``. So the end of backward *adopts* each gradient
autograd made instead of copying it (``Landing.adopting``): ``param.grad`` stays autograd's own
tensor, as in plain torch, the view is marked written but not filled, and the copy is owed. Anything
that reads or adds into a view pays it first, all adopted gradients in one ``_foreach_copy_``
(:meth:`Landing.settle`): ``param.main_grad``, ``ReducedGrads.view``/``owned``, a gradient reopening
the reduced buffers; ``zero_grad`` drops the debt. A ``param.grad`` the user replaced in the
meantime is left as it is (the view takes the reduced value, as it held before). Params of their own
``Parameter`` class (``main_grad`` read without us) are never stale, so their gradients are added as
before. On one H200 the copy (a read and a write of every gradient) was the whole difference of
aligndp's 1b eager step from plain torch's (docs/performance.md). The step's results are those of
the copying path, bit for bit. Autograd's gradients now live until ``zero_grad``, as in plain torch,
beside the buffer they may be read into: that buffer is the memory one rank spends over plain torch.

[Note: one rank's host time]
A compiled one-rank step of a small model is host-bound (gpt2-small on one H200: more host
time per step than GPU time), so each Python pass over the params at the end of backward and
at ``zero_grad`` shows in the step time. Each pass reads a param once and calls nothing per
param on the usual path: :meth:`Landing.collect` reads every ``param.grad`` in one list and
checks it against the dtype and shape its view had when it was built; a bucket's launch
calls ``Landing.take`` only for a stale view; publishing skips an adopted param with one list
lookup; collecting, the buckets ``zero_grad`` leaves unzeroed are chosen once (nothing
defers or adds there, so the choice cannot change). ``param.grad`` of a ``WrappedParameter``
costs more per read than a plain param's ([Note: plain class while stepping] in
runtime/wrapped_param.py), so a pass that reads it twice pays twice.
"""

from __future__ import annotations

import weakref

import torch

from aligndp.plan.spec import Mode
from aligndp.runtime.grads import same_storage
from aligndp.runtime.step_state import StepState

__all__ = ["Landing"]


class Landing:
    """Per reducer: the per-param landing state and its paths ([Note: the landing paths])."""

    def __init__(
        self,
        index,
        buckets,
        params: list,
        *,
        eager_zero: set,
        fused,
        alone: bool,
    ) -> None:
        """``index``, ``buckets``, ``params``: the reducer's; ``eager_zero``: params whose
        stale views are zeroed at ``zero_grad``; ``fused``: the weights of fused-wgrad layers
        (they write their views themselves); ``alone``: one rank agreeing with itself
        (no ``check_finite``)."""
        n = len(params)
        slots = list(index.slots.values())
        self.params = params
        self.views = [s.view for s in slots]
        self.slots = slots
        self.shown = [s.sharded_grad for s in slots]  # param.grad where sharded
        self.eager_zero = [p in eager_zero for p in params]
        # [Note: gradient as bucket view]: where a buffer's grad dtype is its params' dtype,
        # autograd accumulates straight into the view (``param.grad`` is the view)
        self.direct_buffers = [
            b for b in index.buffers if b.layout.grad_dtype == b.layout.param_dtype
        ]
        direct = {id(p) for b in self.direct_buffers for p in b.params}
        self.direct = [id(p) in direct for p in params]
        self.armed = [False] * n  # param.grad is its view, set by us; never a fused weight's:
        self.armable = [d and p not in fused for d, p in zip(self.direct, params)]
        self.stale = [not z for z in self.eager_zero]  # [Note: lazy zeroing]
        self.stale_at_zero = tuple(self.stale)  # what zero_grad makes it
        self.published: set[int] = set()  # param.grad set by us ([Note: step states])
        self.collecting = (
            alone
            and all(self.direct)
            and not fused
            and not any(b.gather_data is not None for b in index.buffers)
        )
        """No per-param hooks: the gradients autograd left in ``param.grad`` are copied into
        the buffer once, at the end of backward."""
        self.adopting = self.collecting and all(
            b.layout.mode is Mode.REPLICATED for b in index.buffers
        )
        """[Note: one rank steps autograd's gradients]: the end of backward copies nothing."""
        self.adopted: list[torch.Tensor | None] = [None] * n
        """Per param: autograd's gradient whose copy into the view is owed, else None."""
        self._owed = False
        self.unzeroed = [False] * n
        """A direct view ``zero_grad`` left as it was (read only while the param is stale)."""
        self._buckets = buckets
        by_ref = {b.ref: b for b in buckets}
        self.bucket_of = [by_ref[s.ref] for s in slots]
        self.members = [[s.index for s in b.slots] for b in buckets]  # by bucket position
        # a bucket holding a param of its own Parameter class (main_grad read without us)
        self._must_zero = [any(self.eager_zero[k] for k in m) for m in self.members]
        self._kinds = [(v.dtype, v.shape) for v in self.views]  # what a gradient copied in is
        # params of their own Parameter class outside the direct buffers: zeroed one by one
        self._zero_eagerly = [k for k, d in enumerate(self.direct) if self.eager_zero[k] and not d]
        self._kept: tuple[dict[int, set[int]], list[bool]] | None = None
        """Collecting, the buckets never defer or add: ``zero_buffers``' choice, made once."""

    # ---- before and during backward ----
    def arm(self) -> None:
        """Before a forward with grad: make every direct param's ``param.grad`` its view, so
        autograd accumulates into the buffer itself ([Note: gradient as bucket view])."""
        if self.collecting:  # autograd keeps its own tensors until collect
            return
        armed, views, buckets = self.armed, self.views, self.bucket_of
        for k, p in enumerate(self.params):
            if self.armable[k] and p.grad is None and not buckets[k].defer:
                p.grad = views[k]
                armed[k] = True

    @torch.no_grad()
    def absorb(self, r, param, k: int) -> bool:
        """Off the direct path: bring ``param.grad`` into its view and the reducer ``r`` into
        ACCUMULATING. False when there is no gradient (nothing arrived)."""
        grad = param.grad
        if grad is None:
            return False
        if grad.layout is not torch.strided:  # as parallelize() refuses a sparse embedding
            raise ValueError(
                f"{r.param_names[param]} got a {grad.layout} gradient; aligndp reduces dense "
                "flat buffers: make its layer give dense gradients (nn.Embedding(sparse=False))"
            )
        view = self.views[k]
        if grad is view and k not in self.published:  # accumulated in place: nothing to do
            r._reopen()
            r._begin_accumulating()
            return True
        if k in self.published:  # autograd accumulated onto the visible grad
            self.published.discard(k)  # (no forward through us): it is the new total
            if not same_storage(grad, view):
                view.copy_(grad.view_as(view))
            r._reopen()  # the other visible grads
        else:
            r._reopen()
            if self.stale[k] or self.armed[k]:  # the view was zero / is in grad
                view.copy_(grad.view_as(view))
            else:
                view.add_(grad.view_as(view))
        if self.direct[k]:
            param.grad = view
            self.armed[k] = True
        else:
            param.grad = None
        r._begin_accumulating()
        return True

    def take(self, k: int) -> None:
        """Zero a stale view before something adds into or reads it (direct views are zero
        already unless their bucket deferred: [Note: deferring buckets are not zeroed])."""
        if self.stale[k]:
            self.stale[k] = False
            if not self.direct[k] or self.unzeroed[k]:
                self.unzeroed[k] = False
                self.views[k].zero_()

    # ---- after the reduction ----
    def publish(self, used: list, k_of) -> None:
        """Show the reduced gradients of ``used`` (the agreed params; ``k_of``: param -> its
        index) as ``param.grad``: the view (cast to the param's dtype where they differ), or
        a ``ShardedGrad`` where sharded; an armed param without a gradient shows None."""
        params, armed, adopted, views = self.params, self.armed, self.adopted, self.views
        ks = range(len(params)) if used is params else [k_of[p] for p in used]
        for k in ks:  # [Note: one rank's host time]
            shown = self.shown[k]
            if shown is not None:
                params[k].grad = shown
                armed[k] = False
            elif adopted[k] is None and params[k].grad is not views[k]:
                p, view = params[k], views[k]
                p.grad = view if view.dtype == p.dtype else view.to(p.dtype)
        self.published.update(ks)
        if len(used) < len(params):
            self.drop_armed()

    def drop_armed(self) -> None:
        """An armed param that is not published shows ``param.grad`` None again, as in torch
        ([Note: undefined gradients])."""
        for k, p in enumerate(self.params):
            if self.armed[k] and k not in self.published:
                p.grad = None
                self.armed[k] = False

    @torch.no_grad()
    def reopen(self, used: list[bool], dp_size: int) -> None:
        """The buffers take the visible grads back ([Note: step states]): a ``param.grad`` the
        user dropped zeroes its view, an edited one is copied in, a sharded one becomes its own
        shard times ``dp_size`` (the next mean adds to it); ``used`` marks them."""
        for k in sorted(self.published):
            p, slot = self.params[k], self.slots[k]
            grad, flat = p.grad, slot.view.view(-1)
            if grad is None:  # dropped by the user (model.zero_grad(), p.grad = None)
                flat.zero_()
            elif slot.owned is None:
                if not same_storage(grad, slot.view):
                    slot.view.copy_(grad.view_as(slot.view))
                used[k] = True
            else:  # own shard x dp_size (shard group's), zeros elsewhere: next mean adds to it
                lo, hi = slot.owned.lo, slot.owned.hi
                flat[:lo].zero_()
                flat[hi:].zero_()
                flat[lo:hi].mul_(dp_size)
                used[k] = True
            if self.direct[k]:  # autograd goes on accumulating into the view
                if p.grad is not slot.view:
                    p.grad = slot.view
                self.armed[k] = True
            else:
                p.grad = None
        self.published.clear()

    # ---- zero_grad ----
    def zero_buffers(self) -> None:
        """Zero the direct buffers where autograd will add into them: every bucket but those
        that defer or collect; a whole buffer, or each run of neighbouring buckets,
        in one op. Views of params that keep their own class are zeroed wherever they are."""
        for k in self._zero_eagerly:
            self.views[k].zero_()
        if self._owed:  # nothing is owed to views zero_grad makes stale
            self.adopted[:] = [None] * len(self.adopted)
            self._owed = False
        if self._kept is not None:  # collecting: the same choice at every step
            keep, left = self._kept
            self.unzeroed[:] = left
        else:
            keep, left = self._keep()
            if self.collecting:
                self._kept = keep, left
        for buf in self.direct_buffers:
            skip = keep.get(id(buf))
            if not skip:
                buf.grad_data.zero_()
                continue
            buckets, run = buf.layout.buckets, None
            for i in range(len(buckets) + 1):
                if i < len(buckets) and i not in skip:
                    run = i if run is None else run
                elif run is not None:  # buckets run..i-1, and the padding between them
                    buf.grad_data[buckets[run].start : buckets[i - 1].end].zero_()
                    run = None

    def _keep(self) -> tuple[dict[int, set[int]], list[bool]]:
        """The buckets ``zero_buffers`` leaves as they are (``id(buffer)`` -> bucket indices)
        and, per param, whether its view is left so (now in ``unzeroed``)."""
        keep: dict[int, set[int]] = {}
        unzeroed = self.unzeroed
        unzeroed[:] = [False] * len(unzeroed)
        for b in self._buckets:
            members = self.members[b.position]
            copied_in = b.defer or self.collecting
            if copied_in and self.direct[members[0]] and not self._must_zero[b.position]:
                keep.setdefault(id(b.buffer), set()).add(b.ref.bucket)
                for k in members:
                    unzeroed[k] = True
        return keep, list(unzeroed)

    def watch(self, r, output: object) -> None:
        """Collecting: queue ``r``'s end-of-backward reduction from the first gradient that
        reaches ``output`` (the wrapped module's, any nesting): one tensor hook per forward
        instead of one hook per param."""
        me = weakref.ref(r)  # the hooks live on the outputs: they must not keep r alive

        def queue(_grad: torch.Tensor) -> None:
            reducer = me()
            if reducer is not None and not reducer._callback_queued:
                reducer._queue_end_of_backward()

        for t in torch.utils._pytree.tree_leaves(output):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(queue)

    @torch.no_grad()
    def collect(self, r, *, adopt: bool = False) -> None:
        """Bring every gradient autograd left in ``param.grad`` into its view — copied where
        the view is stale, added where it holds one already, each kind in one multi-tensor op
        — and make ``param.grad`` the view. Off that path (a sparse or reshaped gradient)
        the hook's own ``_absorb``. ``adopt``: a stale view's copy is owed instead
        ([Note: one rank steps autograd's gradients]; only the end of backward adopts)."""
        views, stale, used, armed, kinds = self.views, self.stale, r._used, self.armed, self._kinds
        adopted, params, strided = self.adopted, self.params, torch.strided
        copy_to, copy_from, add_to, add_from, odd = [], [], [], [], []
        for k, g in enumerate([p.grad for p in params]):  # [Note: one rank's host time]
            if g is None:
                continue
            view = views[k]
            dtype, shape = kinds[k]
            if g is view:
                used[k] = True
            elif g.dtype is not dtype or g.layout is not strided or g.shape != shape:
                odd.append(k)
            elif stale[k] and adopt:
                adopted[k], stale[k], used[k] = g, False, True
                self._owed = True
            elif stale[k]:
                copy_to.append(view), copy_from.append(g)
                stale[k] = False
                params[k].grad, armed[k], used[k] = view, True, True
            else:
                add_to.append(view), add_from.append(g)
                params[k].grad, armed[k], used[k] = view, True, True
        if copy_to:
            torch._foreach_copy_(copy_to, copy_from)
        if add_to:
            torch._foreach_add_(add_to, add_from)
        for k in odd:
            self.absorb(r, params[k], k)
            stale[k], used[k] = False, True
        if (copy_to or add_to or odd or self._owed) and r.state is StepState.IDLE:
            r._begin_accumulating()

    @torch.no_grad()
    def settle(self) -> None:
        """Pay what adopting owes: copy every adopted gradient into its view (one multi-tensor
        op); a ``param.grad`` that is still the adopted tensor becomes the view."""
        if not self._owed:
            return
        self._owed = False
        owed = [(k, g) for k, g in enumerate(self.adopted) if g is not None]
        self.adopted[:] = [None] * len(self.adopted)
        views, params = self.views, self.params
        torch._foreach_copy_([views[k] for k, _ in owed], [g for _, g in owed])
        for k, g in owed:
            if params[k].grad is g:
                params[k].grad = views[k]
                self.armed[k] = True
