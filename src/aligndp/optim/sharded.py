"""ZeRO-1: torch's own elementwise optimizer stepping only this rank's slices of sharded buffers.

[Note: owned segments]
Rank r owns slice r of every bucket of a sharded buffer (``layout.shard_range(bucket, r)``).
A param may straddle two slices and a slice may hold only padding, so this rank's share of
one param is the intersection of the param's ``[start, end)`` with its slice: at most one
:class:`OwnedSegment` per param and rank (a param lies in one bucket; a slice is contiguous).
Padding is never stepped — only real elements have segments — so over all ranks the
segments partition the real elements of every buffer exactly once, which is also what lets
a checkpoint write each element once (aligndp/checkpoint.py).

Each segment gets an fp32 master tensor the torch optimizer steps: for fp32 params the
master *is* the ``param_data`` view (no copy); for 16-bit params it is a view of one fp32
flat tensor per buffer, cast back into ``param_data`` after every step. Gradients are the
reduce-scattered ``grad_data`` views (cast to fp32 first where the grad buffer is 16-bit).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist

from aligndp.buffer import FlatBuffer
from aligndp.checkpoint import FlatPiece, model_space_to_torch_state, torch_state_to_model_space
from aligndp.collectives import all_reduce_sum
from aligndp.ddp import DataParallel
from aligndp.layout import BufferLayout, Mode
from aligndp.optim.base import ELEMENTWISE_OPTIMIZERS, DataParallelOptimizer
from aligndp.optim.replicated import clip_by_total_norm
from aligndp.param_gather import ParamGather

__all__ = ["OwnedSegment", "owned_segments", "check_elementwise", "global_grad_norm", "ShardedOptimizer"]


@dataclasses.dataclass(frozen=True)
class OwnedSegment:
    """This rank's part of one param: buffer elements ``[start, end)`` = flat param ``[offset, offset + numel)``."""

    name: str
    index: int
    """The param's registration index within its buffer (``ParamSlot.index``)."""
    bucket: int
    start: int
    end: int
    offset: int

    @property
    def numel(self) -> int:
        return self.end - self.start


def owned_segments(layout: BufferLayout, *, rank: int) -> tuple[OwnedSegment, ...]:
    """Rank's real elements of a sharded buffer, one segment per param it (partly) owns. Pure."""
    if layout.mode is not Mode.SHARDED:
        raise ValueError(f"owned_segments needs a sharded layout, got mode {layout.mode.value!r}")
    if not 0 <= rank < layout.dp_size:
        raise ValueError(f"rank {rank} is outside dp_size {layout.dp_size}")
    segments = []
    for b in range(len(layout.buckets)):
        lo, hi = layout.shard_range(b, rank)
        for p in layout.params_in_bucket(b):
            start, end = max(p.start, lo), min(p.end, hi)
            if start < end:
                segments.append(OwnedSegment(p.name, p.index, b, start, end, start - p.start))
    return tuple(segments)


def check_elementwise(optimizer: object) -> None:
    """Refuse optimizers whose update of one element depends on other elements (e.g. Muon).

    ZeRO-1 steps arbitrary slices that cut params apart; only elementwise updates are exact there.
    """
    allowed = tuple(ELEMENTWISE_OPTIMIZERS.values())
    if isinstance(optimizer, str):
        ok = optimizer.lower() in ELEMENTWISE_OPTIMIZERS
    else:
        ok = optimizer in allowed
    if not ok:
        name = optimizer if isinstance(optimizer, str) else getattr(optimizer, "__name__", repr(optimizer))
        raise ValueError(
            f"sharding='zero1' steps arbitrary slices of params, which is exact only for elementwise optimizers "
            f"({', '.join(c.__name__ for c in allowed)}); {name!r} is not one of them. For whole-tensor "
            "optimizers such as Muon use the layer-wise mode (optimizer='muon', every param whole on one rank)"
        )


def global_grad_norm(local_sq_sums: Iterable[torch.Tensor], *, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Global gradient 2-norm from each rank's sums of squares of the real elements it owns.

    One all-reduce for any mix of buffers (sharded slices, layerwise whole params): callers
    pass one partial sum per kind and must together cover every element exactly once.
    """
    sums = list(local_sq_sums)
    total = torch.stack([s.float() for s in sums]).sum() if sums else torch.zeros(())
    if dist.get_world_size(group) > 1:
        all_reduce_sum(total, group=group)
    return total.sqrt()


@dataclasses.dataclass
class _Piece:
    """A segment bound to tensors: the param it belongs to, its buffer, its fp32 master."""

    segment: OwnedSegment
    param: torch.nn.Parameter
    buffer: FlatBuffer
    master: torch.Tensor
    cast_back: bool
    """True when the master is a separate fp32 copy (16-bit params), False when it is the param_data view."""


class ShardedOptimizer(DataParallelOptimizer):
    """ZeRO-1 over ``buffers`` (sharded :class:`FlatBuffer` s of ``model``); composable.

    ``step()`` = finish grad sync, bind fp32 grads, clip by the global norm, step the inner
    torch optimizer on the owned masters, cast back, all-gather. A composite optimizer (e.g.
    layer-wise Muon for matrices + this for the rest) calls the pieces instead:
    :meth:`prepare_grads`, :meth:`local_grad_sq_sum` (into :func:`global_grad_norm`),
    :meth:`scale_grads`, :meth:`step_owned`, and ``self.gather``.
    """

    def __init__(
        self,
        model: DataParallel,
        buffers: Sequence[FlatBuffer],
        opt_class: type[torch.optim.Optimizer] = torch.optim.AdamW,
        *,
        max_grad_norm: float | None = None,
        overlap_param_gather: bool = False,
        **optimizer_kwargs,
    ) -> None:
        check_elementwise(opt_class)
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be > 0 or None, got {max_grad_norm!r}")
        for buf in buffers:
            if buf.layout.mode is not Mode.SHARDED or buf.param_data is None:
                raise ValueError(f"ShardedOptimizer steps sharded buffers only, got a {buf.layout.mode.value} buffer")
        self.rank, self.dp_size = model.rank, model.dp_size
        self.buffers = list(buffers)
        self.max_grad_norm = max_grad_norm
        self.pieces = [piece for buf in self.buffers for piece in self._bind(buf)]
        masters = [p.master for p in self.pieces]
        # a rank that owns only padding still needs param_groups (lr schedulers): a placeholder
        # without a grad is skipped by every torch optimizer
        inner = opt_class(masters or [torch.zeros(0, device=self._device)], **optimizer_kwargs)
        super().__init__(model, [inner])
        self.gather = ParamGather(self.buffers, group=model.process_group, module=model.module,
                                  overlap=overlap_param_gather)

    @property
    def _device(self) -> torch.device:
        return self.buffers[0].device if self.buffers else torch.device("cpu")

    def _bind(self, buf: FlatBuffer) -> list[_Piece]:
        segments = owned_segments(buf.layout, rank=self.rank)
        params = {s.index: p for p, s in zip(buf.params, buf.slots)}
        if buf.layout.param_dtype == torch.float32:
            flat, cursor = None, None  # masters are the param_data views themselves
        else:
            flat = torch.empty(sum(s.numel for s in segments), dtype=torch.float32, device=buf.device)
            cursor = 0
        pieces = []
        for s in segments:
            if flat is None:
                master = buf.param_data[s.start:s.end]
            else:
                master = flat[cursor:cursor + s.numel]
                master.copy_(buf.param_data[s.start:s.end])
                cursor += s.numel
            pieces.append(_Piece(s, params[s.index], buf, master, cast_back=flat is not None))
        return pieces

    # ---- the composable pieces of a step ----
    @torch.no_grad()
    def prepare_grads(self) -> list[torch.Tensor]:
        """Bind each master's ``.grad`` to its reduced gradient (fp32); returns them in piece order."""
        grads = []
        for p in self.pieces:
            g = p.buffer.grad_data[p.segment.start:p.segment.end]
            p.master.grad = g if g.dtype == torch.float32 else g.float()
            grads.append(p.master.grad)
        return grads

    @torch.no_grad()
    def local_grad_sq_sum(self) -> torch.Tensor:
        """Sum of squares of this rank's owned gradient elements (after :meth:`prepare_grads`)."""
        grads = [p.master.grad for p in self.pieces if p.master.grad is not None]
        if not grads:
            return torch.zeros((), dtype=torch.float32, device=self._device)
        return torch.stack(torch._foreach_norm(grads)).square().sum()

    @torch.no_grad()
    def scale_grads(self, max_norm: float, total_norm: torch.Tensor) -> None:
        """Clip with torch's coefficient ``max_norm / (total_norm + 1e-6)``, clamped to 1."""
        clip_by_total_norm([p.master.grad for p in self.pieces if p.master.grad is not None],
                           max_norm=max_norm, total_norm=total_norm)

    @torch.no_grad()
    def step_owned(self) -> None:
        """Inner optimizer step on the masters, cast back into ``param_data``, drop the grads."""
        self.inner[0].step()
        low = [p for p in self.pieces if p.cast_back]
        if low:
            torch._foreach_copy_([p.buffer.param_data[p.segment.start:p.segment.end] for p in low],
                                 [p.master for p in low])
        for p in self.pieces:
            p.master.grad = None  # never leave an alias of grad_data behind

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("closures are not supported: run forward/backward before step()")
        self.model.finish_grad_sync()
        self.gather.wait_all()  # the previous step's gather reads the slice we are about to write
        self.prepare_grads()
        if self.max_grad_norm is not None:
            total = global_grad_norm([self.local_grad_sq_sum()], group=self.model.process_group)
            self.scale_grads(self.max_grad_norm, total)
        self.step_owned()
        self.gather.launch()

    # ---- model-space state ([Note: model-space state] in aligndp/checkpoint.py) ----
    def owned_range(self, name: str) -> tuple[int, int]:
        """``[lo, hi)`` of the flattened param ``name`` this rank steps; ``(0, 0)`` if none."""
        for p in self.pieces:
            if p.segment.name == name:
                return p.segment.offset, p.segment.offset + p.segment.numel
        return 0, 0

    def model_space_state_dict(self) -> dict[str, object]:
        """Owned fp32 params and optimizer state keyed by param name; see aligndp/checkpoint.py."""
        self.gather.wait_all()
        names = [p.segment.name for p in self.pieces]
        extents = {p.segment.name: (p.segment.offset, p.param.numel()) for p in self.pieces}
        sd: dict[str, object] = {f"param.{p.segment.name}": FlatPiece(p.master.detach(), p.segment.offset,
                                                                       p.param.numel()) for p in self.pieces}
        return sd | torch_state_to_model_space(self.inner[0], names, extents)

    @torch.no_grad()
    def load_model_space_state_dict(self, sd: dict[str, object]) -> None:
        """Inverse of :meth:`model_space_state_dict` for this rank's (possibly different) ownership."""
        self.gather.wait_all()
        for p in self.pieces:
            piece = sd[f"param.{p.segment.name}"]
            p.master.copy_(piece.tensor)
            p.buffer.param_data[p.segment.start:p.segment.end].copy_(p.master)
        model_space_to_torch_state(self.inner[0], [p.segment.name for p in self.pieces], sd)
        self.gather.launch()
        self.gather.wait_all()
