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
"""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["FAKE_BACKEND", "gather_objects", "init_fake_world", "is_fake", "side_backend"]

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
