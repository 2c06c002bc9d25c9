"""An experiment, not a library backend: bucket collectives moved by the GPUs' copy engines
over NVLink, through torch's symmetric memory, registered by the benchmarks that measure it
(``ddp_step.py --collectives symm-mem``, ``profile_ddp.py``) with
``aligndp.register_collectives`` — the collectives seam used from a script, no library file
touched ([Note: collectives seam] in aligndp/runtime/collectives.py).

Why it is not in the library (benchmarks/results/ddp_overhead_2026-11-30.md, 2x H200, 1b
preset): it halves the slowdown NCCL's kernels cause to the backward's GEMMs (3.5 -> 1.8-2.2 ms
per step), but the mean it leaves on the SMs costs about 1 ms, so the DDP step gains about
0.65 ms (0.7 %), inside the spread between runs. Its signal-pad barriers also wait without a
timeout (a dead rank hangs the others), and it needs one NVLink node. NCCL stays the one
engine; this file keeps the measurement reproducible.

NCCL moves bytes with kernels that occupy SMs for the whole collective; here the bytes move by
``cudaMemcpyAsync`` between peers' memory (the copy engines) and the SMs only do the mean, one
small kernel per bucket.

Storage. :meth:`SymmMemCollectives.allocate` takes every buffer from torch's symmetric memory
(``symm_mem.empty``) and rendezvouses it on the group, so each rank can address every peer's
copy of the buffer (``handle.get_buffer(peer, ...)``). FlatBuffer allocates in the same order
on every rank, which keeps these collective allocations matched. Like
:func:`~aligndp.runtime.buffer.aligned_empty` it over-allocates by the alignment slack and
hands out an aligned view; the view's start within the allocation may differ between ranks,
so the ranks exchange it once per allocation and a peer's bucket is found at the peer's own
offset.

Collectives. A bucket that lies in one of these allocations (found by address) is reduced or
gathered on one side stream of ours, which first waits for the caller's stream:

- reduce-scatter: barrier (every peer's gradients are written); copy chunk ``r`` of every
  peer's bucket into a row of a staging workspace; barrier (nobody reads our bucket any
  more); our shard ``r`` becomes the mean of itself and the rows, in place.
- all-gather: barrier (every shard is final); copy shard ``q`` of peer ``q`` into our shard
  ``q`` for every peer; barrier (nobody still reads our shard, which we may overwrite next).
- all-reduce: the reduce-scatter whose last barrier comes after the mean, then the all-gather
  (three barriers); chunks may be uneven, so any bucket length works.

The barriers are the symmetric memory's signal-pad barriers: one thread per peer writes a
flag into the peer's pad (waiting until the previous flag was consumed) and waits for the
peer's flag in its own, so barriers may follow each other on one channel. Every rank issues
the same operations in the same order (buckets launch in index order, gathers in forward
order) on one stream, so channel 0 of the bucket's allocation is enough. The returned
:class:`_CopyWork` makes the waiting stream wait for an event recorded after the last barrier.
Anything else (a buffer allocated elsewhere, ``dp_size == 1``) goes to
:class:`~aligndp.runtime.collectives.TorchCollectives`, as do the small blocking sums.

The barrier and mean kernels still use a few SMs; CUDA graphs are not supported. We never use
NVLink multicast, so ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` is set unless the user set it.
"""

from __future__ import annotations

import dataclasses
import os
import warnings

import torch
import torch.distributed as dist

from aligndp.runtime.collectives import TorchCollectives, Work

__all__ = ["SymmMemCollectives"]

_CHANNEL = 0


@dataclasses.dataclass(frozen=True)
class _Region:
    """One symmetric allocation and the aligned view of it that was handed out."""

    base: torch.Tensor
    """What ``symm_mem.empty`` returned (held: it keeps the memory alive)."""
    handle: object
    """Its rendezvous on the group (``_SymmetricMemory``)."""
    start: int
    """``data_ptr()`` of the view handed out."""
    nbytes: int
    offsets: tuple[int, ...]
    """Per rank: bytes from the start of that rank's buffer (``get_buffer``'s origin) to its
    view."""

    def covers(self, bucket: torch.Tensor) -> bool:
        ptr = bucket.data_ptr()
        end = ptr + bucket.numel() * bucket.element_size()
        return self.start <= ptr and end <= self.start + self.nbytes

    def peer(self, q: int, bucket: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """Elements ``[lo, hi)`` of rank ``q``'s copy of ``bucket``, addressable from here."""
        item = bucket.element_size()
        byte = self.offsets[q] + bucket.data_ptr() - self.start + lo * item
        assert byte % item == 0, "a peer's bucket starts between two elements"
        return self.handle.get_buffer(q, (hi - lo,), bucket.dtype, byte // item)


def _register_group(group_name: str) -> None:
    """Give symmetric memory the group's store: torch < 2.12 needs it before ``rendezvous``,
    newer releases do it themselves and only warn that the call is unneeded."""
    import torch.distributed._symmetric_memory as symm_mem

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        symm_mem.enable_symm_mem_for_group(group_name)


def _mean_into(own: torch.Tensor, peers: torch.Tensor) -> None:
    """``own = (own + sum of the rows of peers) / (1 + rows)`` in place: two ranks in one pass
    (symm_mem_kernels.py, NCCL's AVG bit for bit), more row by row."""
    if len(peers) == 1:
        from symm_mem_kernels import mean2_

        mean2_(own, peers[0])
        return
    for row in peers:
        own.add_(row)
    own.div_(len(peers) + 1)


class _CopyWork:
    """``wait()``: the caller's current stream waits for the side stream's event."""

    def __init__(self, event: torch.cuda.Event, device: torch.device, keep: tuple) -> None:
        self._event, self._device, self._keep = event, device, keep

    def wait(self) -> bool:
        self._event.wait(torch.cuda.current_stream(self._device))
        self._keep = ()  # ordered before any reuse by the waiting stream from here on
        return True


class SymmMemCollectives(TorchCollectives):
    """Copy-engine collectives on symmetric-memory buffers; NCCL process groups on CUDA only."""

    name = "symm-mem"

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        backend = dist.get_backend(group)
        if backend != "nccl" or not torch.cuda.is_available():
            raise ValueError(
                "collectives backend 'symm-mem' copies buckets between GPUs through CUDA "
                f"symmetric memory and needs an NCCL process group with CUDA; this group's "
                f"backend is {backend!r} (CUDA available: {torch.cuda.is_available()}): use "
                "collectives='torch'"
            )
        super().__init__(group)
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        pg = group if group is not None else dist.group.WORLD
        self._group_name: str = pg.group_name
        _register_group(self._group_name)
        self._regions: list[_Region] = []
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._workspaces: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

    # ---- storage ----
    def allocate(
        self, numel: int, *, dtype: torch.dtype, device: torch.device, align_bytes: int
    ) -> torch.Tensor:
        """Symmetric memory, rendezvoused on the group (collective: every rank allocates the
        same sizes in the same order), as an aligned zeroed view."""
        if device.type != "cuda" or self.dp_size == 1:
            return super().allocate(numel, dtype=dtype, device=device, align_bytes=align_bytes)
        import torch.distributed._symmetric_memory as symm_mem

        item = dtype.itemsize
        with torch.cuda.device(device):  # the symmetric pool is the current device's
            base = symm_mem.empty(numel + max(align_bytes // item, 1), dtype=dtype, device=device)
            handle = symm_mem.rendezvous(base, self._group_name)
        skip = (-base.data_ptr() % align_bytes) // item
        view = base[skip : skip + numel]
        mine = view.data_ptr() - handle.buffer_ptrs[self.rank]  # get_buffer's origin
        found = -1
        if mine >= 0 and mine % item == 0:
            found = handle.get_buffer(self.rank, (numel,), dtype, mine // item).data_ptr()
        if found != view.data_ptr():
            raise RuntimeError(
                f"symmetric memory: get_buffer() does not find the view at "
                f"{view.data_ptr():#x} {mine} B past this rank's buffer_ptrs entry (it gave "
                f"{found:#x}): this torch counts buffer offsets differently; use "
                "collectives='torch'"
            )
        mine_t = torch.tensor([mine], dtype=torch.int64, device=device)
        every = [torch.empty_like(mine_t) for _ in range(self.dp_size)]
        dist.all_gather(every, mine_t, group=self.group)
        offsets = tuple(int(t.item()) for t in every)
        region = _Region(base, handle, view.data_ptr(), numel * item, offsets)
        self._regions.append(region)
        return view.zero_()

    def _region_of(self, bucket: torch.Tensor) -> _Region | None:
        """The allocation ``bucket`` lies in (None: not ours, or nothing to exchange)."""
        if self.dp_size == 1 or not bucket.is_contiguous():
            return None
        for region in self._regions:
            if region.base.dtype == bucket.dtype and region.covers(bucket):
                return region
        return None

    # ---- collectives ----
    def all_reduce_mean(self, bucket: torch.Tensor) -> Work:
        region = self._region_of(bucket)
        if region is None:
            return super().all_reduce_mean(bucket)
        return self._copy(region, bucket, reduce=True, gather=True)

    def reduce_scatter_mean(self, bucket: torch.Tensor) -> Work:
        region = self._region_of(bucket)
        if region is None:
            return super().reduce_scatter_mean(bucket)
        return self._copy(region, bucket, reduce=True, gather=False)

    def all_gather_shards(self, bucket: torch.Tensor) -> Work:
        region = self._region_of(bucket)
        if region is None:
            return super().all_gather_shards(bucket)
        return self._copy(region, bucket, reduce=False, gather=True)

    def _copy(self, region: _Region, bucket: torch.Tensor, *, reduce: bool, gather: bool) -> Work:
        """Queue the peer copies (module docstring) on the side stream; the Work waits for them.

        Chunk ``q`` is ``bucket[numel*q//n : numel*(q+1)//n]``: :func:`shard_of` when the
        length is a multiple of ``n`` (sharded buckets always are)."""
        n, r, device = self.dp_size, self.rank, bucket.device
        bounds = [bucket.numel() * q // n for q in range(n + 1)]
        peers = [(r + step) % n for step in range(1, n)]  # staggered: not all on one peer
        side = self._stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        keep: tuple = ()
        with torch.cuda.stream(side):
            region.handle.barrier(channel=_CHANNEL)
            if reduce:
                lo, hi = bounds[r], bounds[r + 1]
                rows = self._workspace(device, bucket.dtype, hi - lo)
                for row, q in zip(rows, peers, strict=True):
                    row.copy_(region.peer(q, bucket, lo, hi))
                if not gather:
                    region.handle.barrier(channel=_CHANNEL)
                _mean_into(bucket[lo:hi], rows)
                if gather:
                    region.handle.barrier(channel=_CHANNEL)
                keep = (rows,)
            if gather:
                for q in peers:
                    lo, hi = bounds[q], bounds[q + 1]
                    bucket[lo:hi].copy_(region.peer(q, bucket, lo, hi))
                region.handle.barrier(channel=_CHANNEL)
            event = torch.cuda.Event()
            event.record(side)
        return _CopyWork(event, device, keep)

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        """Our side stream on ``device`` (one per device: every copy in issue order)."""
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device=device)
        return stream

    def _workspace(self, device: torch.device, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """``(dp_size - 1, numel)`` staging rows, one per peer (a view of a workspace that only
        grows). Call on
        the side stream: the storage belongs to it, so a replaced workspace is reused only
        after the copies queued there."""
        key = (device, dtype)
        ws = self._workspaces.get(key)
        if ws is None or ws.shape[1] < numel:
            ws = torch.empty(self.dp_size - 1, numel, dtype=dtype, device=device)
            self._workspaces[key] = ws
        return ws[:, :numel]
