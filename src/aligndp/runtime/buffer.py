"""Flat buffers allocated from a layout, and the param views bound into them.

One :class:`FlatBuffer` per :class:`~aligndp.plan.slots.BufferLayout`: ``grad_data`` always,
``param_data`` when an optimizer shards params (then ``param.data`` is rebound to a view of
it, values preserved), and ``gather_data`` (bytes, the same geometry) where the layout gathers
params as a 1-byte payload ([Note: FP8 param gather] in gather_codec.py). Every param gets
``main_grad``, a view at its layout offset.

[Note: alignment contract] continued: the layout fixes element offsets; this module makes
the byte addresses follow. Storage comes from an :class:`Allocator` (the allocation hook of
the collectives backend, [Note: collectives seam] in collectives.py); the default one
over-allocates and starts the buffer at the first address aligned to
``start_alignment * itemsize`` bytes. Whatever allocator made it, the buffer's real
``data_ptr()`` and every view's are checked — a CPU allocator only promises 64 B, an fp32
view with 64-element starts needs 256 B.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from aligndp.plan.slots import BufferLayout, ParamSlot
from aligndp.plan.validate import validate

__all__ = [
    "Allocator",
    "AlignedAllocator",
    "FlatBuffer",
    "aligned_empty",
    "check_allocation",
    "check_pointer_alignment",
]


class Allocator(Protocol):
    """Where a :class:`FlatBuffer` gets its storage (a collectives backend is one)."""

    name: str
    """Named in errors about the storage it returned."""

    def allocate(
        self, numel: int, *, dtype: torch.dtype, device: torch.device, align_bytes: int
    ) -> torch.Tensor:
        """A contiguous 1-D tensor of ``numel`` elements whose ``data_ptr()`` is a multiple
        of ``align_bytes``; its values do not matter (the buffer zeroes it)."""
        ...


def aligned_empty(
    numel: int, *, dtype: torch.dtype, device: torch.device, align_bytes: int
) -> torch.Tensor:
    """A zeroed 1-D tensor of ``numel`` elements whose ``data_ptr()`` is a multiple of
    ``align_bytes``."""
    item = dtype.itemsize
    slack = max(align_bytes // item, 1)
    raw = torch.zeros(numel + slack, dtype=dtype, device=device)
    skip = (-raw.data_ptr() % align_bytes) // item
    assert (raw.data_ptr() + skip * item) % align_bytes == 0, (
        "allocation not aligned to the element size"
    )
    return raw[skip : skip + numel]


class AlignedAllocator:
    """The default allocation: torch's allocator, over-allocated (:func:`aligned_empty`)."""

    name = "torch"

    def allocate(
        self, numel: int, *, dtype: torch.dtype, device: torch.device, align_bytes: int
    ) -> torch.Tensor:
        return aligned_empty(numel, dtype=dtype, device=device, align_bytes=align_bytes)


def check_allocation(
    tensor: torch.Tensor,
    *,
    allocator: str,
    numel: int,
    dtype: torch.dtype,
    device: torch.device,
    align_bytes: int,
) -> None:
    """Raise ``ValueError`` unless ``allocator``'s ``tensor`` is what was asked for: a
    contiguous 1-D ``numel``-element ``dtype`` tensor on ``device`` at an ``align_bytes``
    multiple."""
    got = (tuple(tensor.shape), tensor.dtype, tensor.device, tensor.is_contiguous())
    if got != ((numel,), dtype, device, True):
        raise ValueError(
            f"collectives backend {allocator!r} allocated a {tuple(tensor.shape)} {tensor.dtype} "
            f"tensor on {tensor.device} (contiguous: {tensor.is_contiguous()}) when asked for "
            f"a contiguous ({numel},) {dtype} tensor on {device}: fix its allocate()"
        )
    ptr = tensor.data_ptr()
    if ptr % align_bytes:
        raise ValueError(
            f"collectives backend {allocator!r} allocated a buffer at address {ptr:#x}, "
            f"{ptr % align_bytes} B past a {align_bytes}-byte boundary: the layout's "
            f"{align_bytes // dtype.itemsize}-element starts of {dtype} need {align_bytes}-byte "
            "aligned addresses ([Note: alignment contract]); its allocate() must return "
            "storage aligned to align_bytes"
        )


def check_pointer_alignment(
    view: torch.Tensor, *, slot: ParamSlot, align_bytes: int, what: str
) -> None:
    """Raise ``ValueError`` if ``view``'s real address is not a multiple of ``align_bytes``."""
    ptr = view.data_ptr()
    if ptr % align_bytes:
        raise ValueError(
            f"param {slot.name!r} {what} view starts at element {slot.start} "
            f"(address {ptr:#x}, {ptr % align_bytes} B past a {align_bytes}-byte boundary): "
            f"the layout's {align_bytes // view.element_size()}-element start rule needs "
            f"{align_bytes}-byte addresses; allocate the buffer with aligned_empty()"
        )


class FlatBuffer:
    """Storage for one layout; binds ``main_grad`` (and optionally ``param.data``) views."""

    def __init__(
        self,
        layout: BufferLayout,
        params: Sequence[torch.nn.Parameter],
        *,
        with_param_data: bool = False,
        allocator: Allocator | None = None,
    ) -> None:
        """``params`` in registration order, matching the layout's slots by ``index``;
        ``allocator``: where the storage comes from (default :class:`AlignedAllocator`)."""
        validate(layout)
        slots = sorted(layout.params, key=lambda s: s.index)
        if len(slots) != len(params):
            raise ValueError(f"layout has {len(slots)} params but {len(params)} were given")
        devices = {p.device for p in params}
        if len(devices) != 1:
            raise ValueError(
                f"params of one buffer live on {len(devices)} devices "
                f"{sorted(map(str, devices))}: move the whole module to one device "
                "(module.to(device)) before wrapping it"
            )
        self.layout = layout
        self.device = devices.pop()
        self.allocator: Allocator = allocator if allocator is not None else AlignedAllocator()
        self.params: list[torch.nn.Parameter] = list(params)
        self.slots: list[ParamSlot] = slots
        for p, s in zip(params, slots):
            if tuple(p.shape) != s.shape or p.dtype != layout.param_dtype:
                raise ValueError(
                    f"param {s.name!r} is {tuple(p.shape)} {p.dtype} but the layout planned "
                    f"{s.shape} {layout.param_dtype}: plan the layout from this module's params"
                )
        self.grad_data = self._allocate(layout.grad_dtype)
        self.param_data = self._allocate(layout.param_dtype) if with_param_data else None
        self.gather_data: torch.Tensor | None = None
        """uint8 storage of the low-precision all-gather (``layout.gather_dtype`` set)."""
        if with_param_data and layout.gather_dtype is not None:
            assert layout.gather_dtype.itemsize == 1, "a gather payload is one byte per element"
            self.gather_data = self._allocate(torch.uint8)
        self.main_grads: list[torch.Tensor] = []
        for p, s in zip(params, slots):
            view = self.grad_data[s.start : s.end].view(s.shape)
            check_pointer_alignment(
                view, slot=s, align_bytes=self._align_bytes(layout.grad_dtype), what="main_grad"
            )
            self.main_grads.append(view)
            p.main_grad = view  # the documented name consumers read (Megatron's convention)
            if self.param_data is not None:
                pview = self.param_data[s.start : s.end].view(s.shape)
                check_pointer_alignment(
                    pview, slot=s, align_bytes=self._align_bytes(layout.param_dtype), what="param"
                )
                pview.copy_(p.data)
                p.data = pview
            if self.gather_data is not None:
                check_pointer_alignment(
                    self.gather_data[s.start : s.end],
                    slot=s,
                    align_bytes=self._align_bytes(torch.uint8),
                    what="gather",
                )

    def _align_bytes(self, dtype: torch.dtype) -> int:
        return self.layout.start_alignment * dtype.itemsize

    def _allocate(self, dtype: torch.dtype) -> torch.Tensor:
        """The allocator's storage, checked ([Note: alignment contract]) and zeroed."""
        numel, align_bytes = self.layout.padded_numel, self._align_bytes(dtype)
        storage = self.allocator.allocate(
            numel, dtype=dtype, device=self.device, align_bytes=align_bytes
        )
        check_allocation(
            storage,
            allocator=self.allocator.name,
            numel=numel,
            dtype=dtype,
            device=self.device,
            align_bytes=align_bytes,
        )
        return storage.zero_()  # padding is never written afterwards ([Note: lazy zeroing])

    def bucket_grad(self, bucket: int) -> torch.Tensor:
        b = self.layout.buckets[bucket]
        return self.grad_data[b.start : b.end]

    def bucket_param(self, bucket: int) -> torch.Tensor:
        assert self.param_data is not None, "this buffer holds no param_data"
        b = self.layout.buckets[bucket]
        return self.param_data[b.start : b.end]

    def bucket_gather(self, bucket: int) -> torch.Tensor:
        assert self.gather_data is not None, "this buffer has no low-precision gather"
        b = self.layout.buckets[bucket]
        return self.gather_data[b.start : b.end]

    def zero_grad(self) -> None:
        self.grad_data.zero_()
