"""torch DDP's compression comm hooks, run through the collectives seam.

[Note: comm hooks]
``DataParallel.register_comm_hook(state, hook)`` takes the hooks of torch's
``torch.distributed.algorithms.ddp_comm_hooks.default_hooks`` that a torch DDP user registers
to compress the gradient all-reduce: ``fp16_compress_hook``, ``bf16_compress_hook``, their
``fp16_compress_wrapper(allreduce_hook)`` / ``bf16_compress_wrapper(allreduce_hook)`` forms
(torch documents them as equal) and ``allreduce_hook`` (torch's default, so nothing changes).
aligndp does not call the hook: it recognises it and does its arithmetic through the model's
:class:`~aligndp.runtime.collectives.Collectives` backend, so any registered backend carries
it. A compressed bucket is cast to the 16-bit dtype, averaged by the backend's
``all_reduce_mean`` (on gloo: divided by the group size, then summed, the order of torch's
hook; on NCCL ``ReduceOp.AVG``) and copied back into the bucket when the reduction is waited
for — torch's ``buffer.to(dtype).div_(world_size)``, all-reduce, ``copy_`` back. The 16-bit
copies are kept per bucket (allocated by the backend, so a backend whose collectives need its
own storage gets it). Only the all-reduce of ``sharding="none"`` is a DDP all-reduce; sharded
modes reduce-scatter, and other hooks (PowerSGD, a user's function) would run arbitrary code
against torch's ``GradBucket``: both are refused, naming what to use instead. At dp 1 no
bucket is reduced, so nothing is compressed (torch DDP still rounds through the hook).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from aligndp.plan.slots import BufferLayout
from aligndp.plan.spec import Mode
from aligndp.runtime.collectives import Collectives, Work

__all__ = ["CompressedCollectives", "comm_hook_dtype", "with_comm_hook"]

_COMPRESS_DTYPES = {
    default_hooks.fp16_compress_hook: torch.float16,
    default_hooks.bf16_compress_hook: torch.bfloat16,
}
_WRAPPERS = {"fp16_compress_wrapper": torch.float16, "bf16_compress_wrapper": torch.bfloat16}

_ALTERNATIVES = (
    "aligndp runs torch's default_hooks.fp16_compress_hook / bf16_compress_hook (or "
    "fp16_compress_wrapper / bf16_compress_wrapper around allreduce_hook) with "
    "sharding='none'; for a 16-bit reduction in any mode pass parallelize(..., "
    "grad_dtype=torch.bfloat16)"
)


def _wrapped_hook(hook: Callable) -> tuple[str, object] | None:
    """``(wrapper name, inner hook)`` when ``hook`` is what a default_hooks wrapper returned."""
    outer = hook.__qualname__.split(".<locals>.")[0] if hasattr(hook, "__qualname__") else ""
    if outer not in _WRAPPERS or getattr(hook, "__module__", None) != default_hooks.__name__:
        return None
    cells = dict(zip(hook.__code__.co_freevars, hook.__closure__ or ()))
    return outer, cells["hook"].cell_contents if "hook" in cells else None


def comm_hook_dtype(hook: object) -> torch.dtype | None:
    """The dtype ``hook`` compresses the all-reduce to, None for ``allreduce_hook`` (no
    change); TypeError naming the alternatives for any other hook ([Note: comm hooks])."""
    if not callable(hook):
        raise TypeError(f"register_comm_hook takes a hook function, got {type(hook).__name__}")
    if hook is default_hooks.allreduce_hook:
        return None
    if hook in _COMPRESS_DTYPES:
        return _COMPRESS_DTYPES[hook]
    wrapped = _wrapped_hook(hook)
    if wrapped is not None and wrapped[1] is default_hooks.allreduce_hook:
        return _WRAPPERS[wrapped[0]]
    what = getattr(hook, "__qualname__", repr(hook))
    if wrapped is not None:
        inner = wrapped[1]
        what = f"{wrapped[0]}({getattr(inner, '__qualname__', repr(inner))})"
    raise TypeError(
        f"register_comm_hook got {what}: aligndp reduces buckets through its collectives "
        f"backend and does not run torch's GradBucket hooks (PowerSGD, user functions); "
        f"{_ALTERNATIVES}"
    )


def check_hook_state(state: object, group: dist.ProcessGroup | None) -> None:
    """A default hook's state is the process group it reduces over (None: the default
    group); refuse one that is not the model's data-parallel group."""
    world = dist.group.WORLD
    if (state if state is not None else world) is not (group if group is not None else world):
        raise ValueError(
            f"register_comm_hook's state is the process group the hook reduces over, got "
            f"{state!r}, but this model reduces over "
            f"{'the default group' if group is None else repr(group)}: pass None (the default "
            "group) or the process group given to parallelize"
        )


def with_comm_hook(
    collectives: Collectives, state: object, hook: object, *, layouts: Sequence[BufferLayout]
) -> Collectives:
    """``collectives`` as ``hook`` (registered with ``state``) has the gradient all-reduce
    done; refuses what [Note: comm hooks] lists, before anything changes."""
    dtype = comm_hook_dtype(hook)
    sharded = sorted({lo.mode.value for lo in layouts if lo.mode is not Mode.REPLICATED})
    if sharded:
        raise ValueError(
            f"register_comm_hook compresses the all-reduce of sharding='none', but this model "
            f"has {sharded} buffers, which reduce-scatter: use sharding='none' with the hook, or "
            "parallelize(..., grad_dtype=torch.bfloat16) to reduce in 16 bits in any mode"
        )
    if collectives.replicas > 1:
        raise ValueError(
            "register_comm_hook works on a flat process group, not a 2-D mesh= yet: drop the "
            "hook, or parallelize(..., grad_dtype=torch.bfloat16) to reduce in 16 bits"
        )
    check_hook_state(state, collectives.group)
    return collectives if dtype is None else CompressedCollectives(collectives, dtype)


class _Decompress:
    """The compressed all-reduce's ``Work``: waiting copies the average back into the bucket."""

    def __init__(self, work: Work, compressed: torch.Tensor, bucket: torch.Tensor) -> None:
        self.work, self.compressed, self.bucket = work, compressed, bucket
        self.done = False

    def wait(self) -> object:
        if not self.done:
            self.work.wait()
            self.bucket.copy_(self.compressed)
            self.done = True
        return None


class CompressedCollectives:
    """``inner`` with the gradient all-reduce done in ``dtype`` ([Note: comm hooks]); every
    other collective and the allocation are ``inner``'s."""

    def __init__(self, inner: Collectives, dtype: torch.dtype) -> None:
        self.inner, self.dtype = inner, dtype
        self.name, self.group = inner.name, inner.group
        self.rank, self.dp_size, self.replicas = inner.rank, inner.dp_size, inner.replicas
        self._copies: dict[tuple[int, int], torch.Tensor] = {}

    def allocate(self, numel: int, *, dtype, device, align_bytes: int) -> torch.Tensor:
        return self.inner.allocate(numel, dtype=dtype, device=device, align_bytes=align_bytes)

    def all_reduce_mean(self, bucket: torch.Tensor) -> Work:
        key = (bucket.data_ptr(), bucket.numel())
        compressed = self._copies.get(key)
        if compressed is None:
            compressed = self.inner.allocate(
                bucket.numel(), dtype=self.dtype, device=bucket.device, align_bytes=16
            )
            self._copies[key] = compressed
        compressed.copy_(bucket)  # round to nearest even, as bucket.to(dtype)
        return _Decompress(self.inner.all_reduce_mean(compressed), compressed, bucket)

    def reduce_scatter_mean(self, bucket: torch.Tensor) -> Work:
        raise AssertionError("comm hooks are refused in sharded modes")

    def all_gather_shards(self, bucket: torch.Tensor) -> Work:
        return self.inner.all_gather_shards(bucket)

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        self.inner.all_reduce_sum(tensor)

    def all_reduce_owned_sum(self, tensor: torch.Tensor) -> None:
        self.inner.all_reduce_owned_sum(tensor)
