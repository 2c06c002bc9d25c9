"""All-gather of sharded params after an optimizer step, now or overlapped with the next forward.

After a sharded (ZeRO-1) or layerwise step every rank holds updated values only in its own
slice of each bucket of ``param_data``; one all-gather per bucket refills the rest.

Timeline with ``overlap=True`` (NCCL runs collectives on its own stream, gloo on threads):

    step():     optimizer on owned slices ── launch all-gather bucket 0, 1, ... (async)
    comm:                                    └── gather 0 ──┘└── gather 1 ──┘ ...
    forward:    pre-hook of module m waits only for the buckets holding m's own params,
                so the first layers start while later buckets are still in flight.

While a bucket's gather is in flight its params are *pending* (the Note below): any read of
one outside its module's forward (an EMA, a weight norm, an evaluation through another
module) waits for that bucket first. The next step's window
(``reducer.update()``), ``model.finish_grad_sync()``, checkpoints and
``model.wait_for_params()`` call :meth:`ParamGather.wait_all`. Buckets of buffers planned
with a ``gather_dtype`` go through a :class:`~aligndp.runtime.gather_codec.CodedGather`
([Note: FP8 param gather]): encoded before their gather, decoded into ``param_data`` when it
is waited for (their buckets do it).

[Note: reads wait for the gather]
With ``overlap_param_gather=True`` a param's all-gather is still in flight when ``opt.step()``
returns. While it is, the param's class is the *pending*
subclass of its class (:func:`mark_pending`), whose ``__torch_function__`` first waits for
that param's gather, which gives every param of its bucket its own class back
(:func:`settle`), then runs the call again. Every read through the param object waits so:
``p.norm()``, ``p.detach().clone()``, ``p.data``, ``copy_``, ``torch._foreach_*`` over params,
``F.linear(x, other.weight)`` in another module's forward; calls that read no values
(``p.grad``, ``p.shape``, ``p.requires_grad``, ``p._version``, :data:`_METADATA`) do not wait,
so ``zero_grad`` keeps the overlap. A module's forward pre-hook settles its own params before
its forward reads them, and outside the window every class is the normal one, so the step
pays two class assignments per param and nothing per read. Not covered: an alias taken
before the step (a view, ``data_ptr()``); ``model.wait_for_params()`` waits for everything.

[Note: a failed gather]
A gather whose wait raises (a rank that never launched it: gloo's timeout) leaves the ranks'
params out of step for good. The first wait raises an error naming the bucket, the rank and
the way back (the last checkpoint); the other gathers in flight are dropped unwaited, since
each would wait out its own timeout (on gloo one after the other: a wrapper dropped after the
failure took the timeout times the number of buckets in its finaliser). Their params stay
pending, so every later read of one, forward, step or ``state_dict()`` raises the same error at
once instead of reading a value the failed gather never wrote. Dropping the wrapper gives them
their own classes back without waiting (:meth:`ParamGather.release`).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator, Sequence
from typing import Protocol

import torch
import torch.nn as nn

from aligndp.runtime.bucket import Bucket
from aligndp.runtime.collectives import Collectives
from aligndp.runtime.gather_codec import CodedGather
from aligndp.runtime.step_state import BucketRef, ParamIndex

__all__ = ["ParamGather", "PendingWaiter", "mark_pending", "settle"]


class ParamGather:
    """The order and overlap of the per-bucket param all-gathers (each gather's work is its
    :class:`~aligndp.runtime.bucket.Bucket`'s), and the pending params while one flies.

    The model owns one (``DataParallel.param_gather``, built with it over its buckets, with
    the forward pre-hooks of ``overlap`` installed then). The optimizer's step window
    (``model.reducer.update()``, [Note: one step, top-down]) waits for every gather before
    the step writes the shards and launches the rest after it (:meth:`launch_rest`); a part
    that steps bucket by bucket launches each one as it is stepped (:meth:`launch_stepped`).
    Each bucket's launch casts its masters back first. Buckets are named by
    :class:`~aligndp.runtime.step_state.BucketRef`, as on the gradient side; buckets of
    buffers without ``param_data`` (replicated) hold no params to gather.
    """

    def __init__(
        self,
        buckets: Sequence[Bucket],
        *,
        index: ParamIndex,
        module: nn.Module,
        collectives: Collectives,
        overlap: bool = False,
    ) -> None:
        """``buckets`` (launch order), ``index`` (the one param -> bucket index) and
        ``collectives``: the model's; ``module``: the wrapped module; ``overlap``
        (``overlap_param_gather``): leave the gathers in flight after the step, each module's
        forward pre-hook (installed here) waiting for its own buckets; False waits for them at
        the end of the step."""
        self.module = module
        self.coded: CodedGather | None = next((b.coded for b in buckets if b.coded), None)
        """The buckets' low-precision gathers, if any ([Note: FP8 param gather]): each launch
        encodes its bucket's coded masters ([Note: masters with the buckets] in masters.py)."""
        self.collectives = collectives
        self.dp_size = collectives.dp_size
        self.overlap = overlap
        self._buckets: dict[BucketRef, Bucket] = {b.ref: b for b in buckets if b.gathers}
        """The buckets that hold params, by reference."""
        self._launched: set[BucketRef] = set()
        self._marked: set[BucketRef] = set()  # their params are pending (reads wait for the gather)
        self.failed: str | None = None
        """Why a gather failed, once one has ([Note: a failed gather]): every later wait
        raises it at once."""
        self.writes = 0
        """Bucket gathers launched so far (at dp_size 1 too, where the step's cast-back alone
        wrote ``param_data``): the params' values changed without their version counters
        (the grad sink's :meth:`~aligndp.runtime.reducer.GradReducer.param_writes`)."""
        self._slot = index.by_id
        """id(param) -> its slot in the model's one index (a pending param's hash would wait:
        ids do not)."""
        self.hooks: list = []
        """Handles of the forward pre-hooks on the module (a dropped wrapper's finaliser
        removes them: [Note: dropped wrappers] in wrapped_param.py)."""
        self.order = self._forward_order(module)
        """Every bucket, in the order the forward pass first needs it (the same on every rank)."""
        if overlap and self.dp_size > 1:
            self._install_hooks(module)

    def _forward_order(self, module: nn.Module) -> list[BucketRef]:
        """Buckets sorted by the earliest-registered param they hold.

        Layouts put params in reverse registration order (≈ backward order), so the first
        layers sit in the *last* bucket; gathering bucket 0 first would make the first module
        of the next forward wait for every gather (NCCL runs collectives in launch order).
        """
        keys = sorted(self._buckets, key=lambda ref: (ref.buffer, -ref.bucket))
        position = {id(p): n for n, p in enumerate(module.parameters())}
        first = {
            ref: min((position.get(id(p), len(position)) for p in b.params), default=len(position))
            for ref, b in self._buckets.items()
        }
        return sorted(keys, key=lambda k: (first[k], keys.index(k)))

    def _install_hooks(self, module: nn.Module) -> None:
        where = self._slot
        for m in module.modules():
            here = m.parameters(recurse=False)
            mine = {where[id(p)].ref for p in here if id(p) in where} & self._buckets.keys()
            if mine:
                self.hooks.append(m.register_forward_pre_hook(_WaitsFor(self, sorted(mine))))

    def launch_stepped(self, ref: BucketRef) -> None:
        """Start the gather of a bucket the optimizer has just stepped (layer-wise Muon steps
        one bucket at a time, so this gather overlaps the next bucket's step)."""
        self.launch_bucket(ref)
        self._launched.add(ref)

    def launch_rest(self) -> None:
        """Start every bucket not started since the last call, in :attr:`order` (forward
        order, the same on every rank); wait for all unless overlapping the next forward."""
        for key in self.order:
            if key not in self._launched:
                self.launch_bucket(key)
        self._launched.clear()
        if not self.overlap:
            self.wait_all()

    def launch_bucket(self, key: BucketRef) -> None:
        """Cast one bucket's masters back and start its all-gather now (every rank must start
        the same buckets in the same order)."""
        self.writes += 1
        bucket = self._buckets.get(key)
        if bucket is None:
            return
        bucket.launch_gather()
        if self.overlap and bucket.gathering:  # [Note: reads wait for the gather]
            mark_pending(bucket.params, self)
            self._marked.add(key)

    def wait(self, keys: Iterable[BucketRef]) -> None:
        """Wait for the given buckets' gathers (no-op for those already done) and give their
        params their own classes back; raise at once once a gather has failed."""
        if self.failed is not None:
            raise RuntimeError(self.failed)
        for key in keys:
            bucket = self._buckets.get(key)
            if bucket is None:
                continue
            try:
                waited = bucket.wait_gather()
            except Exception as e:
                self._give_up(key, e)
                raise RuntimeError(self.failed) from e
            if waited and key in self._marked:
                self._marked.discard(key)
                settle(bucket.params)

    def _give_up(self, key: BucketRef, error: Exception) -> None:
        """[Note: a failed gather]: name it, and drop every gather still in flight unwaited."""
        lines = str(error).strip().splitlines()
        first = lines[0] if lines else ""
        self.failed = (
            f"the param all-gather of bucket {key.bucket} of buffer {key.buffer} failed on "
            f"rank {self.collectives.rank} of its group ({type(error).__name__}: {first}), so "
            "the ranks' params are out of step; the other gathers then in flight were dropped, "
            "and every later read of their params, forward, step or checkpoint raises this. "
            "Restart the job from its last checkpoint (aligndp.load)"
        )
        for bucket in self._buckets.values():
            bucket.drop_gather()
        self._launched.clear()

    def release(self) -> None:
        """For a wrapper being dropped: wait for the gathers in flight, or after a failed one
        give the pending params their own classes back without waiting."""
        if self.failed is None:
            self.wait_all()
            return
        for key in self._marked:
            settle(self._buckets[key].params)
        self._marked.clear()

    def wait_for(self, param: nn.Parameter) -> None:
        """Wait for the gather of the bucket holding ``param`` (a pending param being read)."""
        slot = self._slot.get(id(param))  # my params are alive: their ids are theirs
        if slot is not None:
            self.wait((slot.ref,))

    def wait_all(self) -> None:
        """Wait for every gather still in flight: call before reading params outside forward."""
        self.wait(self._buckets)

    def pending_params(self) -> set:
        """The params of every bucket whose gather is still in flight."""
        return {p for b in self._buckets.values() if b.gathering for p in b.params}

    @property
    def in_flight(self) -> int:
        return sum(b.gathering for b in self._buckets.values())

    def remove_hooks(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks.clear()


class _WaitsFor:
    """A forward pre-hook that waits for the gathers of ``refs`` (the module's own buckets); a
    class, so that ``torch.save`` of the module pickles it (as a hook that waits for nothing:
    the loaded module's wrapper installs its own)."""

    def __init__(self, gather: ParamGather | None, refs: list[BucketRef]) -> None:
        self.gather, self.refs = gather, refs

    def __call__(self, _module, _args) -> None:
        if self.gather is not None:
            self.gather.wait(self.refs)

    def __reduce__(self):
        return _WaitsFor, (None, [])


# ---- [Note: reads wait for the gather] ----
_T = torch.Tensor
_METADATA = frozenset(
    [
        f
        for name in (
            "grad",
            "_grad",
            "requires_grad",
            "shape",
            "dtype",
            "device",
            "layout",
            "ndim",
            "is_leaf",
            "grad_fn",
            "_version",
            "retains_grad",
            "is_cuda",
            "is_sparse",
            "is_meta",
            "is_nested",
            "is_quantized",
            "itemsize",
            "nbytes",
            "_backward_hooks",
            "_post_accumulate_grad_hooks",
        )
        for f in (
            getattr(_T, name).__get__,
            getattr(_T, name).__set__,
            getattr(_T, name).__delete__,
        )
    ]
    + [_T.size, _T.dim, _T.numel, _T.nelement, _T.stride, _T.element_size, _T.storage_offset]
    + [_T.is_contiguous, _T.is_floating_point, _T.is_complex, _T.get_device, _T.__len__]
    + [_T.requires_grad_, _T.retain_grad, _T.register_hook, _T.register_post_accumulate_grad_hook]
    + [torch.is_floating_point, torch.is_complex, torch.numel]
)
"""Calls on a pending param that read no values: they run without waiting for its gather."""


class PendingWaiter(Protocol):
    """What marks params pending (:class:`ParamGather`)."""

    def wait_for(self, param: nn.Parameter) -> None:
        """Wait for ``param``'s gather if it is one of mine in flight, and settle its bucket."""
        ...


_WAITERS: weakref.WeakSet[PendingWaiter] = weakref.WeakSet()
"""Everything that marked params pending (asked in turn when a pending param is read)."""
_PENDING: dict[type, type] = {}
"""A param class -> its pending subclass."""
_SETTLED: dict[type, type] = {}
"""A pending subclass -> the class it was made from."""


def mark_pending(params: Iterable[nn.Parameter], waiter: PendingWaiter) -> None:
    """Until :func:`settle`, any read of one of ``params`` first calls ``waiter.wait_for``,
    which must wait for its gather and settle it. Costs one class assignment per param."""
    _WAITERS.add(waiter)
    for p in params:
        cls = type(p)
        pending = _PENDING.get(cls)
        if pending is None:
            if cls in _SETTLED:  # already pending (a gather launched again)
                continue
            pending = type(f"Pending{cls.__name__}", (cls,), {"__module__": __name__})
            pending.__torch_function__ = classmethod(_read_pending)
            _PENDING[cls], _SETTLED[pending] = pending, cls
        p.__class__ = pending


def settle(params: Iterable[nn.Parameter]) -> None:
    """Give pending params their own class back (their gather was waited for)."""
    for p in params:
        base = _SETTLED.get(type(p))
        if base is not None:
            p.__class__ = base


def _wait_for(p: torch.Tensor) -> None:
    for waiter in list(_WAITERS):
        waiter.wait_for(p)
    settle([p])  # a copy of a pending param (deepcopy) has nothing to wait for


def _tensors_in(obj: object) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _tensors_in(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _tensors_in(x)


def _read_pending(cls: type, func, types, args=(), kwargs=None):
    """``__torch_function__`` of pending params: wait for every pending param the call reads,
    then run it as their own classes would."""
    kwargs = kwargs or {}
    if func in _METADATA:
        types = tuple(_SETTLED.get(t, t) for t in types)
        return _SETTLED[cls].__torch_function__(func, types, args, kwargs)
    for t in list(_tensors_in((args, kwargs))):
        if type(t) in _SETTLED:
            _wait_for(t)
    return func(*args, **kwargs)
