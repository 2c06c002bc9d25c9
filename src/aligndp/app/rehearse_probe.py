"""What one rank does in a step, counted the same way on any backend: collectives and memory.

[Note: one probe on every backend]
:class:`StepProbe` is a ``TorchDispatchMode``: every collective reaches torch's dispatcher as
a ``c10d`` op whatever the backend (gloo, NCCL, or the fake one of a rehearsal, [Note:
rehearsal on the fake process group] in runtime/fake_world.py), so the same probe records
the real run's collectives and the rehearsal's, and tests compare them exactly: kind, group
(its global ranks), bytes and the phase of the step that launched it. ``bytes`` is the larger
side of the collective (the whole bucket of a reduce-scatter or all-gather, the tensor of an
all-reduce): the payload a communication model turns into bus traffic.

Memory: torch keeps no allocator statistics on the CPU, so the probe counts the bytes of
every live tensor storage it has seen (outputs of every dispatched op, and the tensors it is
told about before, e.g. the model's params), each storage once however many views it has,
until the storage is freed; the peak is the largest sum. On CUDA the caller reads
``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` instead (rehearse.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import weakref
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from aligndp.runtime.collective_backends import register_collectives
from aligndp.runtime.collectives import TorchCollectives

__all__ = [
    "UNSTAGED",
    "CollectiveRecord",
    "StepProbe",
    "UnstagedCollectives",
    "collective_kind",
    "register_unstaged",
]

_KINDS = {
    "allreduce_": "all_reduce",
    "allreduce_coalesced_": "all_reduce",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "_allgather_base_": "all_gather",
    "allgather_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "broadcast_": "broadcast",
    "scatter_": "scatter",
    "gather_": "gather",
    "alltoall_base_": "all_to_all",
    "barrier": "barrier",
    "monitored_barrier_": "barrier",
}


def collective_kind(op_name: str) -> str:
    """``all_reduce``, ``reduce_scatter``, ... for a ``c10d`` op's name (else the name)."""
    return _KINDS.get(op_name, op_name)


@dataclasses.dataclass(frozen=True)
class CollectiveRecord:
    """One collective a rank launched in a step."""

    kind: str
    """``all_reduce``, ``reduce_scatter``, ``all_gather``, ``broadcast``, ``scatter``, ..."""
    ranks: tuple[int, ...]
    """Global ranks of its group (its size is ``len(ranks)``)."""
    bytes: int
    """Bytes of its larger side: the whole buffer of a reduce-scatter or all-gather."""
    dtype: str
    phase: str
    """The part of the step that launched it: forward, backward, optimizer."""
    at_ms: float
    """Milliseconds from the start of the step to its launch (on the rank's clock)."""

    @property
    def group_size(self) -> int:
        return len(self.ranks)

    def key(self) -> tuple:
        """What must equal between a rehearsal and a real run (no clock)."""
        return (self.kind, self.ranks, self.bytes, self.dtype, self.phase)


def _group_ranks(args: Iterable) -> tuple[int, ...]:
    for a in args:
        if type(a).__name__ == "ScriptObject":
            try:
                group = dist.ProcessGroup.unbox(a)
            except RuntimeError:  # a ReduceOp, not a group
                continue
            return tuple(dist.get_process_group_ranks(group))
    return ()


def _side_bytes(arg: object) -> tuple[int, str]:
    tensors = [t for t in tree_leaves(arg) if isinstance(t, torch.Tensor)]
    dtype = str(tensors[0].dtype).removeprefix("torch.") if tensors else ""
    return sum(t.numel() * t.element_size() for t in tensors), dtype


class StepProbe(TorchDispatchMode):
    """Records collectives and live tensor-storage bytes while active
    ([Note: one probe on every backend]). Set :attr:`phase` as the step moves on."""

    def __init__(self) -> None:
        super().__init__()
        self.phase = "setup"
        self.recording = False
        self.collectives: list[CollectiveRecord] = []
        self.live_bytes = 0
        self.peak_bytes = 0
        self.peak_phase = "setup"
        self._seen: dict[int, weakref.ref] = {}
        self._t0 = time.perf_counter()
        self._paused = 0

    active: StepProbe | None = None
    """The probe in use in this process, if any (a collectives wrapper pauses it)."""

    def __enter__(self):
        StepProbe.active = self
        return super().__enter__()

    def __exit__(self, *exc):
        StepProbe.active = None
        return super().__exit__(*exc)

    @contextlib.contextmanager
    def paused(self):
        """Storages made inside are not counted (a backend's own staging, e.g. gloo's copy of
        a reduce-scatter's input made in ``Work.wait``, which NCCL does not make)."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def start_step(self) -> None:
        """Clear the collectives and restart the clock (the peak is kept: of the whole run)."""
        self.collectives.clear()
        self.recording = True
        self._t0 = time.perf_counter()

    def track(self, tensors: Iterable[torch.Tensor]) -> None:
        """Count the storages of tensors made before the probe was active (params, buffers)."""
        for t in tensors:
            self._add(t)

    def _add(self, t: torch.Tensor) -> None:
        if t.device.type == "meta" or self._paused:
            return
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # sparse or wrapper tensors
            return
        key = id(storage)
        known = self._seen.get(key)
        if known is not None and known() is storage:
            return
        # an id can be reused before the old storage's finalizer has run: key by the object
        nbytes = storage.nbytes()
        self._seen[key] = weakref.ref(storage)
        self.live_bytes += nbytes
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes, self.peak_phase = self.live_bytes, self.phase
        weakref.finalize(storage, self._free, key, nbytes)

    def _free(self, key: int, nbytes: int) -> None:
        known = self._seen.get(key)
        if known is not None and known() is None:
            del self._seen[key]
        self.live_bytes -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "c10d" and self.recording:
            name = func.__name__.split(".")[0]
            sides = [_side_bytes(a) for a in args[:2]]
            nbytes, dtype = max(sides) if sides else (0, "")
            self.collectives.append(
                CollectiveRecord(
                    kind=collective_kind(name),
                    ranks=_group_ranks(args),
                    bytes=nbytes,
                    dtype=dtype,
                    phase=self.phase,
                    at_ms=(time.perf_counter() - self._t0) * 1e3,
                )
            )
        out = func(*args, **kwargs)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._add(t)
        return out


class _Unstaged:
    """A ``Work`` whose wait the active probe does not count: gloo stages a reduce-scatter
    through a copy of the whole bucket made in ``wait`` (ProcessGroupGloo has no in-place
    reduce-scatter), which NCCL, and so a rehearsal of a GPU job, does not make."""

    def __init__(self, work) -> None:
        self.work = work

    def wait(self):
        probe = StepProbe.active
        with probe.paused() if probe is not None else contextlib.nullcontext():
            return self.work.wait()


class UnstagedCollectives(TorchCollectives):
    """torch's collectives whose waits the probe does not count: the real gloo runs that a
    rehearsal is checked against (tests/test_rehearse.py, benchmarks/rehearse_table.py)."""

    name = "torch-unstaged"

    def all_reduce_mean(self, bucket):
        return _Unstaged(super().all_reduce_mean(bucket))

    def reduce_scatter_mean(self, bucket):
        return _Unstaged(super().reduce_scatter_mean(bucket))

    def all_gather_shards(self, bucket):
        return _Unstaged(super().all_gather_shards(bucket))


UNSTAGED = UnstagedCollectives.name


def register_unstaged() -> None:
    """Make ``DDPConfig(collectives=UNSTAGED)`` available in this process (idempotent)."""
    register_collectives(UNSTAGED, UnstagedCollectives)
