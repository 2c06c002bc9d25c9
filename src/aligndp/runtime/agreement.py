"""Cross-rank checks: every rank wraps the same model, and every rank reaches a collective.

[Note: ranks agree]
Data parallelism assumes every rank holds the same params in the same layout. When they do
not, the collectives still run on buffers of the same length (and training silently mixes
unrelated tensors), or on buffers of different lengths (gloo aborts a process, NCCL hangs).
:func:`check_ranks_agree` compares one digest per rank at wrap time (one tiny
``all_gather_object``) and, only when the digests differ, gathers the summaries to name the
first difference; every rank raises the same ``ValueError``.

[Note: collective timeout]
A collective that only some ranks call (``aligndp.save`` under ``if rank == 0:``, a rank still
in its evaluation while another saves) would wait for the process group's timeout, 30 minutes
by default, with no output. :func:`expect_all_ranks` runs ``dist.monitored_barrier`` (torch's
own facility: rank 0 waits for the others with a timeout and names the missing ranks) before
such a collective, so it fails after :func:`collective_timeout` with a message that says
which ranks did not arrive. The barrier runs on a side gloo group, never the training group:
a barrier that only some ranks entered leaves its group's collective sequence out of step,
and monitored_barrier exists on gloo only (the training group may be NCCL). The side group is
made by :func:`prepare_side_group`, a collective that ``DataParallel`` calls when it wraps
(every rank wraps); a first save/load without one creates it, within the same timeout.
Timeout: the ``timeout=`` argument, else ``ALIGNDP_COLLECTIVE_TIMEOUT`` (seconds), else
:data:`DEFAULT_COLLECTIVE_TIMEOUT_S`. After such an error the process group is out of step:
end the job (``aligndp train`` does) rather than continue.
"""

from __future__ import annotations

import datetime
import hashlib
import os
import re
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist

from aligndp.runtime.fake_world import gather_objects, side_backend

__all__ = [
    "DEFAULT_COLLECTIVE_TIMEOUT_S",
    "TIMEOUT_ENV",
    "RanksOutOfStepError",
    "check_ranks_agree",
    "collective_timeout",
    "expect_all_ranks",
    "prepare_side_group",
]

DEFAULT_COLLECTIVE_TIMEOUT_S = 60.0
"""Seconds a rank waits for the others at :func:`expect_all_ranks` (save, load)."""
TIMEOUT_ENV = "ALIGNDP_COLLECTIVE_TIMEOUT"


class RanksOutOfStepError(RuntimeError):
    """Some ranks called a collective that the others did not reach in time."""


# ---- wrap-time agreement ([Note: ranks agree]) ----


class _ParamSummary(NamedTuple):
    """What the ranks compare of one param (sent with ``all_gather_object``)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    requires_grad: bool


def _summary(named_params: Iterable[tuple[str, torch.Tensor]], layouts: Sequence) -> dict:
    params = [
        _ParamSummary(
            name, tuple(p.shape), str(p.dtype).removeprefix("torch."), bool(p.requires_grad)
        )
        for name, p in named_params
    ]
    return {"params": params, "layouts": [layout.to_dict() for layout in layouts]}


def _digest(summary: dict) -> str:
    return hashlib.sha256(repr(summary).encode()).hexdigest()


def _param_difference(rank: int, mine: list[_ParamSummary], ref: list[_ParamSummary]) -> str | None:
    """The first way rank ``rank``'s params (``mine``) differ from rank 0's (``ref``)."""
    have, want = {p.name: p for p in mine}, {p.name: p for p in ref}
    only_here = [p.name for p in mine if p.name not in want]
    only_there = [p.name for p in ref if p.name not in have]
    if only_here or only_there:
        where = (
            f"{only_here[0]!r} exists only on rank {rank}"
            if only_here
            else f"{only_there[0]!r} exists only on rank 0"
        )
        return f"rank {rank} has {len(mine)} params and rank 0 has {len(ref)}: {where}"
    for p in mine:
        for what in ("shape", "dtype", "requires_grad"):
            value, ref_value = getattr(p, what), getattr(want[p.name], what)
            if value != ref_value:
                return (
                    f"param {p.name!r} has {what} {value} on rank {rank} but {ref_value} on rank 0"
                )
    if [p.name for p in mine] != [p.name for p in ref]:
        first = next(i for i, (a, b) in enumerate(zip(mine, ref)) if a.name != b.name)
        return (
            f"the params are registered in another order: position {first} is "
            f"{mine[first].name!r} on rank {rank} but {ref[first].name!r} on rank 0"
        )
    return None


def _layout_difference(rank: int, mine: list[dict], ref: list[dict]) -> str:
    if len(mine) != len(ref):
        return f"rank {rank} planned {len(mine)} gradient buffer(s), rank 0 {len(ref)}"
    for index, (a, b) in enumerate(zip(mine, ref)):
        for key in b:
            if a.get(key) != b[key]:
                return (
                    f"gradient buffer {index} differs in {key!r} between rank {rank} and rank 0 "
                    "(check that bucket_numel, start_alignment, grad_dtype, sharding and wgrad are "
                    "the same on every rank)"
                )
    return f"rank {rank} planned another layout than rank 0"


def check_ranks_agree(
    named_params: Iterable[tuple[str, torch.Tensor]],
    layouts: Sequence = (),
    group: dist.ProcessGroup | None = None,
) -> None:
    """Raise the same ``ValueError`` on every rank unless all ranks hold the same params and layout.

    ``named_params``: ``module.named_parameters()`` (names, shapes, dtypes and requires_grad are
    compared); ``layouts``: the planned :class:`~aligndp.plan.slots.BufferLayout` list (compared
    whole). Collective over ``group``: one ``all_gather_object`` of a digest, a second one of
    the summaries only when the digests differ. Call it before any collective that depends
    on shapes (e.g. the broadcast of rank 0's params), or a mismatch aborts there instead.
    """
    world_size = dist.get_world_size(group)
    if world_size == 1:
        return
    summary = _summary(named_params, layouts)
    digests: list[str] = gather_objects(_digest(summary), group)
    if len(set(digests)) == 1:
        return
    summaries: list[dict] = gather_objects(summary, group)
    ref = summaries[0]
    for rank in range(1, world_size):
        if digests[rank] == digests[0]:
            continue
        diff = _param_difference(rank, summaries[rank]["params"], ref["params"])
        if diff is None:
            diff = _layout_difference(rank, summaries[rank]["layouts"], ref["layouts"])
        raise ValueError(
            f"ranks disagree on the model being wrapped: {diff}. Every rank must build the same "
            "model (same code, config and seed) with the same aligndp settings before "
            "aligndp.parallelize"
        )


# ---- collectives that only some ranks call ([Note: collective timeout]) ----


def collective_timeout(timeout: float | datetime.timedelta | None = None) -> datetime.timedelta:
    """The timeout of :func:`expect_all_ranks`: ``timeout``, else ``$ALIGNDP_COLLECTIVE_TIMEOUT``
    (seconds), else :data:`DEFAULT_COLLECTIVE_TIMEOUT_S`."""
    if isinstance(timeout, datetime.timedelta):
        seconds, source = timeout.total_seconds(), "timeout"
    elif timeout is not None:
        seconds, source = timeout, "timeout"
    elif os.environ.get(TIMEOUT_ENV):
        raw, source = os.environ[TIMEOUT_ENV], TIMEOUT_ENV
        try:
            seconds = float(raw)
        except ValueError:
            raise ValueError(
                f"{TIMEOUT_ENV}={raw!r} is not a number of seconds; e.g. {TIMEOUT_ENV}=60"
            ) from None
    else:
        seconds, source = DEFAULT_COLLECTIVE_TIMEOUT_S, "default"
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0:
        raise ValueError(f"{source} must be a positive number of seconds, got {seconds!r}")
    return datetime.timedelta(seconds=float(seconds))


_SIDE_GROUPS: dict[tuple[int, ...], dist.ProcessGroup] = {}
"""Global ranks of a group -> its side gloo group for monitored barriers."""
_BROKEN: set[tuple[int, ...]] = set()
"""Side groups whose barrier timed out on this rank: gloo has closed their connections.
They stay cached (dropping one on this rank only would make the next prepare_side_group a
collective that the other ranks skip)."""


def _ranks(group: dist.ProcessGroup | None) -> tuple[int, ...]:
    return tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))


def prepare_side_group(
    group: dist.ProcessGroup | None = None,
    *,
    renew: bool = False,
    timeout: float | datetime.timedelta | None = None,
) -> dist.ProcessGroup:
    """Create (collectively, on every rank of ``group``) the side gloo group that
    :func:`expect_all_ranks` uses for ``group``; a no-op when it exists, unless ``renew``.

    A failed monitored barrier closes its gloo connections: ``renew=True`` (on every rank)
    replaces the group, for a program (or a test) that goes on after such an error.
    """
    ranks = _ranks(group)
    if renew or ranks not in _SIDE_GROUPS:
        # Over a subgroup only its ranks take part (local synchronisation); torch then names the
        # new group by its ranks, so such a group cannot be renewed (the name would collide).
        subgroup = len(ranks) < dist.get_world_size()
        if renew and subgroup and ranks in _SIDE_GROUPS:
            raise ValueError(
                "prepare_side_group(renew=True) works for a group of every rank, not the "
                f"subgroup {ranks}"
            )
        side = dist.new_group(
            list(ranks),
            backend=side_backend(),
            timeout=collective_timeout(timeout),
            use_local_synchronization=subgroup,
        )
        _SIDE_GROUPS[ranks] = side
        _BROKEN.discard(ranks)
    return _SIDE_GROUPS[ranks]


def expect_all_ranks(
    what: str,
    group: dist.ProcessGroup | None = None,
    *,
    timeout: float | datetime.timedelta | None = None,
) -> None:
    """Return once every rank of ``group`` has called this; raise :class:`RanksOutOfStepError`
    naming the missing ranks after :func:`collective_timeout` otherwise.

    ``what`` names the collective for the message, e.g. ``"aligndp.save('ckpt/step-100')"``.
    """
    if dist.get_world_size(group) == 1:
        return
    limit = collective_timeout(timeout)
    seconds = f"{limit.total_seconds():g} s"
    fix = (
        f"{what} is collective: call it on every rank (not under `if rank == 0:`), at the same "
        f"point of the program. Timeout: timeout= or {TIMEOUT_ENV} (seconds, default "
        f"{DEFAULT_COLLECTIVE_TIMEOUT_S:g})"
    )
    rank = dist.get_rank(group)
    if _ranks(group) in _BROKEN:
        raise RanksOutOfStepError(
            f"rank {rank} called {what} after an earlier collective timed out and left the "
            "ranks out of step; end the job and start it again"
        )
    try:
        side = prepare_side_group(group, timeout=limit)
    except RuntimeError as e:
        raise RanksOutOfStepError(
            f"rank {rank} called {what} but the other ranks did not join within {seconds}: {fix}"
        ) from e
    try:
        dist.monitored_barrier(side, timeout=limit, wait_all_ranks=True)
    except RuntimeError as e:
        _BROKEN.add(_ranks(group))  # its connections are closed now
        missing = re.search(r"Ranks? ([\d, ]+) failed to pass", str(e))
        if rank == 0 and missing:
            who = f"rank(s) {missing.group(1).strip()} did not reach it within {seconds}"
        elif rank == 0:
            who = f"not every rank reached it within {seconds}"
        else:
            who = (
                f"rank 0 did not reach it within {seconds} (it may have called it earlier and "
                "given up)"
            )
        raise RanksOutOfStepError(f"rank {rank} called {what} but {who}: {fix}") from e
