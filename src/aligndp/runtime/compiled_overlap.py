"""Bucket reductions inside a compiled backward: Dynamo splits the graph at bucket boundaries.

[Note: compiled overlap]
``torch.compile(model)`` of the whole wrapper makes its backward one autograd node: every
param's gradient, hence every post-accumulate hook, comes when the node ends, so no bucket
collective could start while the backward runs. torch DDP keeps the overlap through Dynamo's
DDPOptimizer (torch/_dynamo/backends/distributed.py): when Dynamo converts a frame while
``DistributedDataParallel._get_active_ddp_module()`` returns a module, it splits the captured
graph into subgraphs of about ``module.bucket_bytes_cap`` parameter bytes each (counted
backwards through the graph, from the output), compiles each with the chosen backend
(Inductor by default) and chains them; each subgraph's backward is its own autograd node, so
the gradients of the graph's last layers reach their hooks, and their buckets launch, while
the earlier subgraphs' backward still runs. The converter reads nothing of the module but
``bucket_bytes_cap`` (torch 2.0 through 2.13).

:class:`CompiledOverlap` presents a :class:`DynamoBuckets` there for the duration of the
wrapper's forward (the forward pre-hook and hook in forward_hooks.py, where the previous value
is saved and restored, so an enclosing torch DDP or aligndp wrapper is untouched). Dynamo
decides at conversion and caches the split graph; a forward that is not converted (cached,
eager) pays one class-attribute write on entry and one on exit.

The cap: DDPOptimizer counts a param as ``param.untyped_storage().nbytes()``, and a sharded
param's storage is its whole flat buffer (``param.data`` is a view, runtime/buffer.py), so a
cap of one bucket's bytes would split a ZeRO-1 graph at every param. The cap is instead the
bytes it counts over all params divided by the number of aligndp buckets, so the split makes
about as many subgraphs as there are buckets (the cap is at least 1 MiB, the least
DDPOptimizer accepts). Eight 256 x 256 Linears in two 1 MiB buckets, ZeRO-1: 8 subgraphs
with one bucket's bytes as the cap, 3 with the divided cap (DDPOptimizer closes its first
one at 1 MiB, as for torch DDP); replicated: 2. The split follows the graph's order and its
byte count, not aligndp's layout, so a subgraph boundary and a bucket boundary need not
coincide: a bucket launches once its last param's subgraph has run its backward (readiness
is counted per param, [Note: bucket readiness] in DESIGN.md), and the end-of-backward
callback launches what is left, as without the split. Nothing is presented with one rank
(nothing to overlap: the one-GPU compiled step keeps its single graph), ``overlap=False``,
one bucket, or grad disabled. ``torch._dynamo.config.optimize_ddp = False`` turns the split
off for torch DDP and aligndp alike.

Alternatives not taken: compiled autograd (one traced backward; its hooks still run at the
end of the graph unless collectives are traced in, and it recompiles on every hook change);
functional collectives traced into the graph (the buckets' views, step states and the
end-of-backward agreement are Python state a graph should not guard on:
[Note: compiled forward]); graph breaks at bucket boundaries (each costs a guard check and
a frame, and ``fullgraph=True`` would refuse them).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

__all__ = ["CompiledOverlap", "DynamoBuckets", "split_bytes", "FIRST_BUCKET_BYTES"]

FIRST_BUCKET_BYTES = 1 << 20
"""DDPOptimizer's first bucket (``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES``): it refuses
a cap below it."""


@dataclasses.dataclass(frozen=True)
class DynamoBuckets:
    """What Dynamo reads of the active DDP module while it converts a frame."""

    bucket_bytes_cap: int
    """Parameter bytes per subgraph, as DDPOptimizer counts them (see [Note: compiled overlap])."""


def split_bytes(params: Sequence[nn.Parameter], *, num_buckets: int) -> int:
    """The ``bucket_bytes_cap`` that splits a graph over ``params`` into about ``num_buckets``
    subgraphs: the bytes DDPOptimizer counts (each param's storage), divided by the buckets,
    and at least :data:`FIRST_BUCKET_BYTES`."""
    counted = sum(p.untyped_storage().nbytes() for p in params)
    return max(counted // max(num_buckets, 1), FIRST_BUCKET_BYTES)


def _torch_has_the_split() -> bool:
    return hasattr(DistributedDataParallel, "_get_active_ddp_module") and hasattr(
        DistributedDataParallel, "_active_ddp_module"
    )


_UNSET = object()


class CompiledOverlap:
    """Presents a wrapper's buckets to Dynamo while its forward runs ([Note: compiled overlap]).

    ``enter()`` at the start of the wrapper's forward, ``leave()`` at its end (also after an
    error; a ``leave()`` without its ``enter()`` does nothing)."""

    def __init__(
        self, params: Sequence[nn.Parameter], *, num_buckets: int, world_size: int, overlap: bool
    ) -> None:
        self.face: DynamoBuckets | None = None
        """None where nothing is presented: one rank, no overlap, one bucket, or a torch without
        the DDPOptimizer seam."""
        if world_size > 1 and overlap and num_buckets > 1:
            if _torch_has_the_split():
                self.face = DynamoBuckets(split_bytes(params, num_buckets=num_buckets))
            else:
                warnings.warn(
                    f"torch {torch.__version__} has no DistributedDataParallel."
                    "_get_active_ddp_module: a torch.compile'd backward of the whole model "
                    "reduces every bucket after it ends; compile block by block to overlap them",
                    stacklevel=3,
                )
        self._previous: object = _UNSET

    @classmethod
    def of(cls, dp) -> CompiledOverlap:
        """The one of a :class:`~aligndp.runtime.ddp.DataParallel`."""
        return cls(
            dp.params,
            num_buckets=len(dp.bucket_refs),
            world_size=dp.world_size,
            overlap=dp.config.overlap,
        )

    def enter(self) -> None:
        if self.face is None or not torch.is_grad_enabled():
            return
        self._previous = DistributedDataParallel._active_ddp_module
        DistributedDataParallel._active_ddp_module = self.face

    def leave(self) -> None:
        if self._previous is _UNSET:
            return
        DistributedDataParallel._active_ddp_module = self._previous
        self._previous = _UNSET
