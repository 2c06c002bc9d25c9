"""All-gather of sharded params after an optimizer step, now or overlapped with the next forward.

After a sharded (ZeRO-1) or layerwise step every rank holds updated values only in its own
slice of each bucket of ``param_data``; one all-gather per bucket refills the rest.

Timeline with ``overlap=True`` (NCCL runs collectives on its own stream, gloo on threads):

    step():     optimizer on owned slices ── launch all-gather bucket 0, 1, ... (async)
    comm:                                    └── gather 0 ──┘└── gather 1 ──┘ ...
    forward:    pre-hook of module m waits only for the buckets holding m's own params,
                so the first layers start while later buckets are still in flight.

While a bucket's gather is in flight its params are *pending*
([Note: reads wait for the gather] in wrapped_param.py): any read of one outside its module's
forward (an EMA, a weight norm, an evaluation through another module) waits for that bucket
first. ``model.finish_grad_sync()`` (what the next ``step()`` reads first), checkpoints and
``model.wait_for_params()`` call
:meth:`ParamGather.wait_all`. Buckets of buffers planned with a ``gather_dtype`` go through
a :class:`~aligndp.runtime.gather_codec.CodedGather` ([Note: FP8 param gather]): encoded
before their gather, decoded into ``param_data`` when it is waited for (their groups do it).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch.nn as nn

from aligndp.runtime.bucket_group import BucketGroup
from aligndp.runtime.collectives import Collectives
from aligndp.runtime.gather_codec import CodedGather
from aligndp.runtime.step_state import BucketRef, ParamIndex

__all__ = ["ParamGather"]


class ParamGather:
    """The order and overlap of the per-bucket param all-gathers; each gather's work and
    pending params are its :class:`~aligndp.runtime.bucket_group.BucketGroup`'s.

    The model owns one (``DataParallel.param_gather``, built with it over its groups, with
    the forward pre-hooks of ``overlap`` installed then); the optimizer calls into it:
    :meth:`launch_stepped` / :meth:`launch_rest` after each step (each bucket's launch casts
    its masters back first), and ``model.finish_grad_sync()`` waits for them all before a
    step writes the shards again.
    Buckets are named by :class:`~aligndp.runtime.step_state.BucketRef`, as on the gradient
    side; groups of buffers without ``param_data`` (replicated) hold no params to gather.
    """

    def __init__(
        self,
        groups: Sequence[BucketGroup],
        *,
        index: ParamIndex,
        module: nn.Module,
        collectives: Collectives,
        overlap: bool = False,
    ) -> None:
        """``groups`` (launch order), ``index`` (the one param -> bucket index) and
        ``collectives``: the model's; ``module``: the wrapped module; ``overlap``
        (``overlap_param_gather``): leave the gathers in flight after the step, each module's
        forward pre-hook (installed here) waiting for its own buckets; False waits for them at
        the end of the step."""
        self.module = module
        self.coded: CodedGather | None = next((g.coded for g in groups if g.coded), None)
        """The groups' low-precision gathers, if any ([Note: FP8 param gather]): each launch
        encodes its bucket's coded masters ([Note: masters with the buckets] in masters.py)."""
        self.collectives = collectives
        self.dp_size = collectives.dp_size
        self.overlap = overlap
        self._groups: dict[BucketRef, BucketGroup] = {g.ref: g for g in groups if g.gathers}
        """The groups whose buckets hold params, by bucket."""
        self._launched: set[BucketRef] = set()
        self.writes = 0
        """Bucket gathers launched so far (at dp_size 1 too, where the step's cast-back alone
        wrote ``param_data``): the params' values changed without their version counters
        (the grad sink's :meth:`~aligndp.runtime.reduction.Reduction.param_writes`)."""
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
        keys = sorted(self._groups, key=lambda ref: (ref.buffer, -ref.bucket))
        position = {id(p): n for n, p in enumerate(module.parameters())}
        first = {
            ref: min((position.get(id(p), len(position)) for p in g.params), default=len(position))
            for ref, g in self._groups.items()
        }
        return sorted(keys, key=lambda k: (first[k], keys.index(k)))

    def _install_hooks(self, module: nn.Module) -> None:
        where = self._slot
        for m in module.modules():
            here = m.parameters(recurse=False)
            mine = {where[id(p)].ref for p in here if id(p) in where} & self._groups.keys()
            groups = [self._groups[ref] for ref in sorted(mine)]
            if groups:
                self.hooks.append(m.register_forward_pre_hook(_WaitsFor(groups)))

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
        group = self._groups.get(key)
        if group is not None:
            group.launch_gather(self if self.overlap else None)

    def wait(self, keys: Iterable[BucketRef]) -> None:
        """Wait for the given buckets' gathers (no-op for those already done)."""
        for key in keys:
            group = self._groups.get(key)
            if group is not None:
                group.wait_gather()

    def wait_for(self, param: nn.Parameter) -> None:
        """Wait for the gather of the bucket holding ``param`` (a pending param being read)."""
        slot = self._slot.get(id(param))  # my params are alive: their ids are theirs
        group = self._groups.get(slot.ref) if slot is not None else None
        if group is not None:
            group.wait_gather()

    def wait_all(self) -> None:
        """Wait for every gather still in flight: call before reading params outside forward."""
        for group in self._groups.values():
            group.wait_gather()

    def pending_params(self) -> set:
        """The params of every bucket whose gather is still in flight."""
        return {p for g in self._groups.values() if g.gathering for p in g.params}

    @property
    def in_flight(self) -> int:
        return sum(g.gathering for g in self._groups.values())

    def remove_hooks(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks.clear()


class _WaitsFor:
    """A forward pre-hook that waits for ``groups``' gathers (the module's own buckets); a
    class, so that ``torch.save`` of the module pickles it (as a hook that waits for nothing:
    the loaded module's wrapper installs its own)."""

    def __init__(self, groups: list[BucketGroup]) -> None:
        self.groups = groups

    def __call__(self, _module, _args) -> None:
        for g in self.groups:
            g.wait_gather()

    def __reduce__(self):
        return _WaitsFor, ([],)
