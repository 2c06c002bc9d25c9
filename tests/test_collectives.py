"""The collectives seam ([Note: collectives seam] in aligndp/runtime/collectives.py) on gloo.

A backend registered through the public API, with its own allocator, must train exactly as
the default one (bit for bit: it is the same arithmetic, only the storage and the dispatch
differ), and every collective and allocation must go through it. A backend whose allocator
breaks the alignment contract is refused on every rank, naming itself, the address and the
alignment; an unknown name is refused naming the registered ones.
"""

from __future__ import annotations

import collections

import pytest
import torch
import torch.distributed as dist

import aligndp
from aligndp.runtime.buffer import aligned_empty
from aligndp.runtime.collective_backends import (
    make_collectives,
    register_collectives,
    registered_collectives,
)
from aligndp.runtime.collectives import TorchCollectives
from aligndp.runtime.ddp import DataParallel, DDPConfig
from tests._dist import case, make_tests
from tests.models import batch, loss_of, make_net

STEPS = 3
ARENA_ALIGN = 4096


class CountingCollectives(TorchCollectives):
    """Counts every call; allocates from arenas of its own, filled with NaN before handing
    them out (the buffer must zero what it gets)."""

    name = "counting"

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        super().__init__(group)
        self.calls: collections.Counter[str] = collections.Counter()
        self.arenas: list[torch.Tensor] = []

    def allocate(self, numel, *, dtype, device, align_bytes):
        self.calls["allocate"] += 1
        assert ARENA_ALIGN % align_bytes == 0, "the test arena serves up to 4096-byte alignment"
        raw = torch.empty(numel * dtype.itemsize + ARENA_ALIGN, dtype=torch.uint8, device=device)
        skip = -raw.data_ptr() % ARENA_ALIGN
        arena = raw[skip : skip + numel * dtype.itemsize].view(dtype)
        arena.fill_(float("nan"))
        self.arenas.append(arena)
        return arena

    def all_reduce_mean(self, bucket):
        self.calls["all_reduce_mean"] += 1
        return super().all_reduce_mean(bucket)

    def reduce_scatter_mean(self, bucket):
        self.calls["reduce_scatter_mean"] += 1
        return super().reduce_scatter_mean(bucket)

    def all_gather_shards(self, bucket):
        self.calls["all_gather_shards"] += 1
        return super().all_gather_shards(bucket)

    def all_reduce_sum(self, tensor):
        self.calls["all_reduce_sum"] += 1
        super().all_reduce_sum(tensor)


class MisalignedCollectives(TorchCollectives):
    """Hands out storage one element past an aligned address."""

    name = "misaligned"

    def allocate(self, numel, *, dtype, device, align_bytes):
        return aligned_empty(numel + 1, dtype=dtype, device=device, align_bytes=align_bytes)[1:]


class ShortCollectives(TorchCollectives):
    """Hands out one element too few."""

    name = "short"

    def allocate(self, numel, *, dtype, device, align_bytes):
        return super().allocate(numel - 1, dtype=dtype, device=device, align_bytes=align_bytes)


register_collectives("counting", CountingCollectives)
register_collectives("misaligned", MisalignedCollectives)
register_collectives("short", ShortCollectives)


def train(sharding: str, collectives: str, rank: int, ws: int):
    """``STEPS`` clipped AdamW steps; the params after each step and the model."""
    model, opt = aligndp.parallelize(
        make_net(),
        sharding=sharding,
        lr=1e-2,
        max_grad_norm=0.5,
        bucket_numel=200,
        collectives=collectives,
    )
    history = []
    for step in range(STEPS):
        loss_of(model, *batch(step, rank, ws)).backward()
        opt.step()
        opt.zero_grad()
        history.append([p.detach().clone() for p in model.module.parameters()])
    return history, model


@case(2, 3)
def case_registered_backend_trains_bit_identically_and_carries_every_collective(rank, ws):
    for sharding in ("none", "zero1"):
        expected, _ = train(sharding, "torch", rank, ws)
        got, model = train(sharding, "counting", rank, ws)
        backend = model.collectives
        assert isinstance(backend, CountingCollectives)
        for step, (mine, ref) in enumerate(zip(got, expected)):
            for (name, _), p, q in zip(model.module.named_parameters(), mine, ref):
                assert torch.equal(p, q), f"{sharding} step {step}: {name} differs"
        buckets = len(model.bucket_refs)
        assert buckets > 2, "the test needs several buckets"
        sharded = sharding == "zero1"
        assert backend.calls == collections.Counter(
            {
                "allocate": len(model.layouts) * (2 if sharded else 1),  # grad_data (+ param_data)
                "all_reduce_mean": 0 if sharded else STEPS * buckets,
                "reduce_scatter_mean": STEPS * buckets if sharded else 0,
                "all_gather_shards": STEPS * buckets if sharded else 0,
                "all_reduce_sum": 2 * STEPS,  # the agreement's flags and the global norm
            }
        ), f"{sharding}: {backend.calls}"
        storages = {a.untyped_storage().data_ptr() for a in backend.arenas}
        for buf in model.flat_buffers:
            for data in (buf.grad_data, buf.param_data):
                if data is not None:
                    assert data.untyped_storage().data_ptr() in storages, (
                        "a buffer was not allocated by the backend's allocate()"
                    )


@case(2, 3)
def case_allocation_that_breaks_the_contract_is_refused_on_every_rank(rank, ws):
    for sharding in ("none", "zero1"):
        with pytest.raises(
            ValueError,
            match=r"collectives backend 'misaligned' allocated a buffer at address 0x[0-9a-f]+, "
            r"4 B past a 256-byte boundary: .*64-element starts of torch.float32",
        ):
            aligndp.parallelize(make_net(), sharding=sharding, collectives="misaligned")
    with pytest.raises(ValueError, match=r"'short' allocated a \((\d+),\) .* asked for"):
        DataParallel(make_net(), config=DDPConfig(collectives="short"))


@case(2)
def case_backend_storage_starts_zero_and_the_gather_uses_it(rank, ws):
    """The arenas come NaN-filled: the buffer zeroes them, so padding (never written
    afterwards) is zero, as with the default allocation ([Note: lazy zeroing])."""
    model, opt = aligndp.parallelize(make_net(), sharding="zero1", collectives="counting")
    assert opt.gather.collectives is model.collectives
    assert (model.collectives.rank, model.collectives.dp_size) == (rank, ws)
    for buf in model.flat_buffers:
        assert torch.count_nonzero(buf.grad_data) == 0, "grad_data must start zero"
        padding = torch.ones(buf.layout.padded_numel, dtype=torch.bool)
        for s in buf.slots:
            padding[s.start : s.end] = False
        assert padding.any(), "the test needs padding"
        assert torch.count_nonzero(buf.param_data[padding]) == 0, "param_data padding not zero"


def test_unknown_name_is_refused_naming_the_registered_ones():
    known = registered_collectives()
    assert {"torch", "counting", "misaligned"} <= set(known)
    names = "registered are " + ", ".join(repr(n) for n in known)
    with pytest.raises(ValueError, match=rf"unknown collectives backend 'nvshmem': {names}"):
        DDPConfig(collectives="nvshmem")
    with pytest.raises(ValueError, match=rf"unknown collectives backend 'nvshmem': {names}"):
        aligndp.parallelize(make_net(), collectives="nvshmem")
    with pytest.raises(ValueError, match="unknown collectives backend 'nvshmem'"):
        make_collectives("nvshmem", group=None)
    with pytest.raises(TypeError, match="the name of a registered backend, got type"):
        DDPConfig(collectives=TorchCollectives)


def test_registration_is_checked():
    register_collectives("counting", CountingCollectives)  # the same factory again: no-op
    with pytest.raises(ValueError, match="'counting' is already registered"):
        register_collectives("counting", MisalignedCollectives)
    with pytest.raises(TypeError, match="needs a factory"):
        register_collectives("broken", "not a factory")
    with pytest.raises(ValueError, match="non-empty string name"):
        register_collectives("", CountingCollectives)

    class Nameless:
        name = "torch"

    register_collectives("renamed", lambda group: Nameless())
    with pytest.raises(ValueError, match="registered as collectives backend 'renamed' made a"):
        make_collectives("renamed", group=None)


make_tests(globals())
