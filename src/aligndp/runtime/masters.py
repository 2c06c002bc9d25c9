"""The masters of a rank's owned pieces, kept with the model's buckets.

[Note: masters with the buckets]
What an optimizer steps for one owned piece (:class:`~aligndp.plan.slots.OwnedPiece`, the one
type for a rank's piece of a param) is a :class:`Master`: the piece, the param it belongs to,
its ``param_data`` view and its ``grad_data`` view, and the tensor stepped — a separate fp32
copy (16-bit params with ``master_weights``, and params gathered in FP8) or the ``param_data``
view itself ([Note: master weights] in aligndp/optim/sharded.py). A ZeRO-1 piece's master is
1-D; a layer-wise piece is a whole param and its master has the param's shape.

They are built once per bucket (:func:`bucket_masters`, the build step ``attach_masters`` of
aligndp/build.py) and kept by the bucket's :class:`~aligndp.runtime.bucket.Bucket`
(``bucket.masters``), next to the param all-gather they feed: launching a bucket's gather
first casts its separate masters back into ``param_data`` (one ``_foreach_copy_``) and hands
an FP8 gather the masters it encodes ([Note: FP8 param gather] in gather_codec.py). So the
optimizer parts (ZeRO-1, whole-matrix) read ``bucket.masters`` and only step them; neither
builds masters nor a param -> bucket map of its own, and no launch takes the optimizer's
tensors as an argument.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import torch.nn as nn

from aligndp.plan.slots import OwnedPiece
from aligndp.plan.spec import Mode
from aligndp.runtime.buffer import FlatBuffer
from aligndp.runtime.step_state import GradSlot

__all__ = ["Master", "bucket_masters", "keeps_fp32_master", "refresh_master"]


def keeps_fp32_master(param_dtype: torch.dtype, *, master_weights: bool) -> bool:
    """True when a param of ``param_dtype`` is stepped through a separate fp32 master copy
    ([Note: master weights]); False: the optimizer steps the param's own storage."""
    return master_weights and param_dtype != torch.float32


@dataclasses.dataclass(eq=False)
class Master:
    """What an optimizer steps for one owned piece ([Note: masters with the buckets])."""

    piece: OwnedPiece
    param: nn.Parameter
    buffer: FlatBuffer
    master: torch.Tensor
    """The tensor stepped: fp32 copy, or ``view`` itself (1-D; the param's shape if whole)."""
    view: torch.Tensor
    """The piece of ``param_data`` (shaped like ``master``) the bucket casts it back into."""
    grad: torch.Tensor
    """The piece of ``grad_data`` (shaped like ``master``): the reduced gradient once reduced."""
    cast_back: bool
    """True when ``master`` is a separate fp32 copy (16-bit params with master_weights, and
    FP8-gathered params), False when it is the ``param_data`` view."""
    coded: bool = False
    """Gathered in FP8: the gather encodes ``master`` and decodes into ``param_data``, so the
    bucket does not cast it back."""


def bucket_masters(
    buffer: FlatBuffer,
    slots: Sequence[GradSlot],
    params: Sequence[nn.Parameter],
    *,
    master_weights: bool,
) -> tuple[Master, ...]:
    """The masters of this rank's owned pieces of one bucket (its ``slots`` and ``params``),
    in buffer order; one fp32 flat tensor per bucket holds the separate ones."""
    coded = buffer.gather_data is not None  # [Note: FP8 param gather]: masters always
    separate = coded or keeps_fp32_master(buffer.layout.param_dtype, master_weights=master_weights)
    whole = buffer.layout.mode is Mode.LAYERWISE
    owned = sorted(
        ((s.owned, p) for s, p in zip(slots, params) if s.owned is not None and s.owned.numel),
        key=lambda item: item[0].start,
    )
    flat = None
    if separate and owned:
        numel = sum(piece.numel for piece, _ in owned)
        flat = torch.empty(numel, dtype=torch.float32, device=buffer.device)
    masters, cursor = [], 0
    for piece, param in owned:
        shape = param.shape if whole else (piece.numel,)
        view = buffer.param_data[piece.start : piece.end].view(shape)
        grad = buffer.grad_data[piece.start : piece.end].view(shape)
        master = view
        if flat is not None:
            master = flat[cursor : cursor + piece.numel].view(shape)
            master.copy_(view)
            cursor += piece.numel
        masters.append(Master(piece, param, buffer, master, view, grad, flat is not None, coded))
    return tuple(masters)


@torch.no_grad()
def refresh_master(
    master: torch.Tensor, param: torch.Tensor, written: torch.Tensor | None = None
) -> None:
    """``master`` (fp32) takes ``param``'s value wherever the param differs from what the step
    last wrote into it: ``written`` (an FP8 gather's decoded value) or the master's cast."""
    written = master.to(param.dtype) if written is None else written
    master.copy_(torch.where(param == written, master, param.float()))
