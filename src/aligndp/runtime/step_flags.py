"""The int32 flags of the end-of-backward agreement: what each rank encodes, what all decode.

[Note: step states] (DESIGN.md): at the end of every synchronised backward the ranks sum one
int32 vector and every rank decides the same from it. Its layout, ``n`` params in
registration order:

    [0, n)          had a gradient on this rank (used)
    [n, 2n)         received a gradient after its bucket's collective started (late)
    [2n, 3n)        read in forward before its all-gather was waited for (stale read)
    with check_finite:
    [3n, 4n)        non-finite local gradient elements before the reduction
    [4n, 4n + dp)   the same, summed per rank (slot r holds rank r's total)
"""

from __future__ import annotations

from collections.abc import Container, Mapping, Sequence
from typing import NamedTuple

import torch
import torch.nn as nn

__all__ = [
    "Agreed",
    "PendingFlags",
    "decode_flags",
    "encode_flags",
    "flag_values",
    "nonfinite_counts",
]


class Agreed(NamedTuple):
    """What every rank decides from the summed flags."""

    used: list[nn.Parameter]
    """Params some rank had a gradient for, in registration order."""
    nonfinite: str
    """``"'name': k element(s), ... on rank r, ..."``; empty when every gradient was finite."""
    problems: str
    """The error message of late or stale-read params; empty when there are none."""


class PendingFlags(NamedTuple):
    """Summed flags being copied to the host without waiting (read at the next reduction)."""

    host: torch.Tensor
    event: torch.cuda.Event | None
    """Recorded after the copy on CUDA; None where the flags already are on the host."""


def flag_values(
    params: Sequence[nn.Parameter],
    *,
    used: Sequence[bool],
    late: Container[nn.Parameter],
    stale_read: Container[nn.Parameter],
) -> list[int]:
    """This rank's used, late and stale-read flags as Python ints (``used`` by param index;
    no param is hashed when ``late`` and ``stale_read`` are empty, the usual case)."""
    n = len(params)
    flags = [1 if u else 0 for u in used]
    flags += [1 if p in late else 0 for p in params] if late else [0] * n
    flags += [1 if p in stale_read else 0 for p in params] if stale_read else [0] * n
    return flags


def encode_flags(
    values: list[int],
    *,
    nonfinite: torch.Tensor | None,
    rank: int,
    dp_size: int,
    device: torch.device,
) -> torch.Tensor:
    """This rank's flags on ``device`` (:func:`flag_values`, then with check_finite the
    per-param counts ``nonfinite``, an int32 tensor on ``device``, and the per-rank totals)."""
    local = torch.tensor(values, dtype=torch.int32)
    if device.type == "cuda":
        local = local.pin_memory().to(device, non_blocking=True)
    if nonfinite is None:
        return local
    on_rank = torch.zeros(dp_size, dtype=torch.int32, device=device)
    on_rank[rank] = nonfinite.sum()
    return torch.cat([local, nonfinite, on_rank])


def decode_flags(
    values: Sequence[int], *, params: Sequence[nn.Parameter], names: Mapping[nn.Parameter, str]
) -> Agreed:
    """The decision every rank takes from the summed flags (``values``, as Python ints)."""
    n = len(params)
    used = [p for p, v in zip(params, values[:n]) if v]
    late = [names[p] for p, v in zip(params, values[n : 2 * n]) if v]
    stale = [names[p] for p, v in zip(params, values[2 * n : 3 * n]) if v]
    nonfinite = ", ".join(
        f"{names[p]!r}: {v} element(s)" for p, v in zip(params, values[3 * n : 4 * n]) if v
    )
    if nonfinite:
        ranks = [r for r, v in enumerate(values[4 * n :]) if v]
        nonfinite = f"{nonfinite} on " + ", ".join(f"rank {r}" for r in ranks)
    problems = []
    if late:
        problems.append(
            f"params {late[:5]} received a gradient after their bucket's collective started "
            "(a fused-wgrad layer used more often than in the previous step); that contribution "
            "is lost: call opt.zero_grad() and repeat the step, or build the model so every "
            "fused layer is used the same number of times per step"
        )
    if stale:
        problems.append(
            f"params {stale[:5]} were read in forward before their all-gather was waited for "
            "(read outside their own module's forward, e.g. F.linear(x, self.head.weight) or a "
            "tied weight), so the forward used stale values: use overlap_param_gather=False, or "
            "call the module that owns them"
        )
    return Agreed(used, nonfinite, "; ".join(problems))


def to_host_async(flags: torch.Tensor) -> PendingFlags:
    """``flags`` copied to pinned host memory behind an event, without waiting for them."""
    if flags.device.type != "cuda":
        return PendingFlags(flags, None)
    host = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=True)
    host.copy_(flags, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return PendingFlags(host, event)


def nonfinite_counts(
    bucket: torch.Tensor, *, starts: torch.Tensor, ends: torch.Tensor
) -> torch.Tensor:
    """Non-finite (NaN, +Inf, -Inf) elements of ``bucket[starts[k]:ends[k]]`` for every k.

    One pass over the bucket whatever the number of params in it, and no host sync: the
    non-finite mask's running count (int32 while the bucket allows, else int64), read at
    each span's ends. ``starts``/``ends``: int64 tensors on the bucket's device.
    """
    if bucket.numel() == 0:
        return torch.zeros(starts.shape, dtype=torch.int64, device=bucket.device)
    bad = ~torch.isfinite(bucket)
    count_dtype = torch.int32 if bucket.numel() < 2**31 else torch.int64
    running = torch.cumsum(bad, 0, dtype=count_dtype)  # running[i] = bad[: i + 1].sum()

    def before(stop: torch.Tensor) -> torch.Tensor:  # bad[:stop].sum() for every stop
        return torch.where(stop > 0, running[(stop - 1).clamp(min=0)], 0)

    return before(ends) - before(starts)
