"""All-gather of sharded params after an optimizer step, now or overlapped with the next forward.

After a sharded (ZeRO-1) or layerwise step every rank holds updated values only in its own
slice of each bucket of ``param_data``; one all-gather per bucket refills the rest.

Timeline with ``overlap=True`` (NCCL runs collectives on its own stream, gloo on threads):

    step():     optimizer on owned slices ── launch all-gather bucket 0, 1, ... (async)
    comm:                                    └── gather 0 ──┘└── gather 1 ──┘ ...
    forward:    pre-hook of module m waits only for the buckets holding m's own params,
                so the first layers start while later buckets are still in flight.

Anything that reads params outside forward (a checkpoint, an evaluation that bypasses the
module, the next ``step()``) calls :meth:`ParamGather.wait_all` first.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch.distributed as dist
import torch.nn as nn

from aligndp.buffer import FlatBuffer
from aligndp.collectives import all_gather_shards

__all__ = ["ParamGather"]

BucketKey = tuple[int, int]
"""(index into the gatherer's buffers, bucket index)."""


class ParamGather:
    """Launches and tracks per-bucket param all-gathers of the buffers it is given."""

    def __init__(
        self,
        buffers: Sequence[FlatBuffer],
        *,
        group: dist.ProcessGroup | None,
        module: nn.Module | None = None,
        overlap: bool = False,
    ) -> None:
        """``module`` (the wrapped model) is needed only when ``overlap`` installs pre-hooks."""
        for buf in buffers:
            if buf.param_data is None:
                raise ValueError(
                    f"a {buf.layout.mode.value} buffer without param_data cannot be all-gathered; "
                    "only sharded and layerwise buffers hold params"
                )
        if overlap and module is None:
            raise ValueError("overlap=True waits in forward pre-hooks: pass the wrapped module")
        self.buffers = list(buffers)
        self.group = group
        self.dp_size = dist.get_world_size(group)
        self.overlap = overlap
        self._pending: dict[BucketKey, dist.Work] = {}
        self._hooks = []
        if overlap and self.dp_size > 1:
            self._install_hooks(module)

    def _bucket_of(self) -> dict[int, BucketKey]:
        """id(param) -> the bucket holding it."""
        return {id(p): (i, s.bucket) for i, buf in enumerate(self.buffers) for p, s in zip(buf.params, buf.slots)}

    def _install_hooks(self, module: nn.Module) -> None:
        where = self._bucket_of()
        for m in module.modules():
            keys = sorted({where[id(p)] for p in m.parameters(recurse=False) if id(p) in where})
            if keys:
                self._hooks.append(m.register_forward_pre_hook(lambda _m, _args, _keys=keys: self.wait(_keys)))

    def launch(self) -> None:
        """Start the all-gather of every bucket, in buffer and bucket order (the same on every rank).

        Waits for everything at once unless overlapping with the next forward.
        """
        self.wait_all()
        if self.dp_size == 1:
            return
        for i, buf in enumerate(self.buffers):
            for b in range(len(buf.layout.buckets)):
                self._pending[(i, b)] = all_gather_shards(buf.bucket_param(b), group=self.group)
        if not self.overlap:
            self.wait_all()

    def wait(self, keys: Iterable[BucketKey]) -> None:
        """Wait for the given buckets' gathers (no-op for those already done)."""
        for key in keys:
            work = self._pending.pop(key, None)
            if work is not None:
                work.wait()

    def wait_all(self) -> None:
        """Wait for every gather still in flight: call before reading params outside forward."""
        self.wait(list(self._pending))

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
