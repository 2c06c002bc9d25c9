"""What aligndp decides from a collective's result, on torch's fake process group.

[Note: rehearsal on the fake process group]
``aligndp rehearse`` (app/rehearse.py) runs one rank of a D-rank job in one process on torch's
fake backend (``dist.init_process_group("fake", ...)``): every collective is accepted and
moves nothing, so a tensor collective leaves garbage or zeros in its output. The runtime's
tensor collectives only carry data and run unchanged (their count and bytes are what a
rehearsal measures). Three wrap-time steps *decide* something from what other ranks sent, and
this module is the one place that answers them without the other ranks:

- :func:`gather_objects` (the agreement digests, the input checks' errors, split
  Newton–Schulz's group lists): every rank of a rehearsal builds the same model with the same
  settings, so each is taken to have sent what this rank sends; for split Newton–Schulz
  (optim/split_ns.py) that makes a rehearsal create only the sub-groups its own rank is in,
  which is all it needs (a fake ``new_group`` synchronises nothing);
- :func:`side_backend`: the side group of save/load's monitored barrier is made on the fake
  backend (gloo cannot run over the fake store).

The fake backend is not free: its all-gathers and gathers copy the input into every rank's
slot of the output (one copy per rank: a ZeRO-1 param gather at D = 1,024 is 1,024 copies per
bucket), and its all-gathers and reduce-scatters split their tensors into one chunk per rank
even when they are empty, so each call costs in proportion to D (an all-reduce or a
broadcast does not). A rehearsal would time that as its own step's work (the optimizer
phase, where the param gather launches; the figures are in
benchmarks/results/rehearse_fake_copies_2026-12-07.md). Inside
:func:`moving_nothing` those collectives (:data:`PER_RANK_COLLECTIVES`) do not reach the
backend at all: each returns a completed ``Work``, so a timed step pays for none of the fake
backend's per-rank work, as the rehearsal promises; the probed step (collectives and memory)
runs without it, through the backend.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

__all__ = [
    "FAKE_BACKEND",
    "PER_RANK_COLLECTIVES",
    "gather_objects",
    "init_fake_world",
    "is_fake",
    "moving_nothing",
    "side_backend",
]

FAKE_BACKEND = "fake"
"""torch's name of the backend that accepts every collective and moves nothing."""


def init_fake_world(rank: int, world_size: int) -> None:
    """Initialise the default process group on the fake backend as ``rank`` of
    ``world_size``. torch registers the backend in a testing module (no public one, torch
    2.9-2.13); importing it is all this needs of it."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  registers "fake"

    dist.init_process_group(FAKE_BACKEND, store=dist.HashStore(), rank=rank, world_size=world_size)


def is_fake(group: dist.ProcessGroup | None = None) -> bool:
    """Whether ``group`` (None: the default group) runs on the fake backend."""
    return dist.is_initialized() and dist.get_backend(group) == FAKE_BACKEND


def gather_objects(obj: object, group: dist.ProcessGroup | None = None) -> list:
    """``dist.all_gather_object`` of ``obj`` over ``group``, returned as the list of every
    rank's object; on the fake backend every rank is this one
    ([Note: rehearsal on the fake process group])."""
    world_size = dist.get_world_size(group)
    if is_fake(group):
        return [obj] * world_size
    out: list = [None] * world_size
    dist.all_gather_object(out, obj, group=group)
    return out


def side_backend() -> str:
    """The backend of the side group of save/load's barrier: gloo, or fake in a rehearsal."""
    return FAKE_BACKEND if is_fake() else "gloo"


PER_RANK_COLLECTIVES = (
    "all_gather_single",
    "all_gather_single_coalesced",
    "_allgather_base",
    "allgather",
    "allgather_coalesced",
    "allgather_into_tensor_coalesced",
    "gather",
    "reduce_scatter_single",
    "reduce_scatter_single_coalesced",
    "_reduce_scatter_base",
    "reduce_scatter",
    "reduce_scatter_tensor_coalesced",
)
"""The ``ProcessGroup`` methods whose fake implementation does work per rank of the group
(those a torch version lacks are skipped)."""


class _Done(dist.Work):
    """The ``Work`` of a collective that moved nothing: complete from the start."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        done = torch.futures.Future()
        done.set_result(None)
        return done


def _done(*_args, **_kwargs) -> dist.Work:
    return _Done()


@contextlib.contextmanager
def moving_nothing():
    """Inside: on the fake backend, :data:`PER_RANK_COLLECTIVES` return a completed ``Work``
    without reaching the backend (their outputs keep whatever they held). Enter it only
    where every group is fake (a rehearsal's timed steps): it patches the ``ProcessGroup``
    class of this process."""
    if not is_fake():
        raise ValueError(
            "moving_nothing() stubs the fake backend's collectives; the default process group "
            f"runs on {dist.get_backend() if dist.is_initialized() else 'nothing'}: use it in "
            "a rehearsal (init_fake_world) only"
        )
    cls = dist.ProcessGroup
    # pybind keeps methods as descriptors in the class dict: restore those
    saved = {n: cls.__dict__.get(n) for n in PER_RANK_COLLECTIVES if hasattr(cls, n)}
    for name in saved:
        setattr(cls, name, _done)
    try:
        yield
    finally:
        for name, raw in saved.items():
            if raw is None:
                delattr(cls, name)
            else:
                setattr(cls, name, raw)
