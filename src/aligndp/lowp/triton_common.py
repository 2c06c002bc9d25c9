"""What the Triton quantise and GEMM kernels share: the operand type and the Gluon dispatch.

GPU only in use, but importable anywhere: without Triton's Gluon (or without Triton) the Gluon
kernels are simply absent and the plain-Triton ones run.

[Note: operand layout]
Every GEMM operand is a :class:`QuantizedOperand`: ``data`` (rows, K) fp8, K-major (what
Hopper's fp8 wgmma wants for both operands), and ``scale_t`` (K / block, rows), i.e. the
scales transposed so one K-block's scales for a row tile are one coalesced load. The
quantise kernel writes, from one read of X (M, N):
  row-wise: data (M, N) quantised along N, scale_t (N / block, M)
  col-wise: data (N, M) = X.T quantised along M, scale_t (M / block, N)
so ``colwise.data == quantize_mxfp8(X, dim=0).data.T`` and ``colwise.scale_t ==
quantize_mxfp8(X, dim=0).scale`` bit for bit (see tests/test_mx_gpu.py).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

__all__ = ["QuantizedOperand"]

try:  # the faster kernels need Gluon's Hopper module (Triton 3.6)
    import aligndp.lowp.gluon_kernels as _gluon
except (ImportError, AttributeError):  # no Gluon, or one whose API moved
    _gluon = None


@functools.cache
def _is_sm90(device_index: int) -> bool:
    """Hopper, where the Gluon kernels (wgmma, setmaxnreg) run; cached: it is asked per call."""
    return torch.cuda.get_device_capability(device_index) == (9, 0)


def _device_index(t: torch.Tensor) -> int:
    """The index of ``t``'s CUDA device (``get_device()``: no ``torch.device`` built per call)."""
    return t.get_device()


class QuantizedOperand(NamedTuple):
    """One GEMM operand; see [Note: operand layout]."""

    data: torch.Tensor
    """(rows, K) float8, contiguous."""
    scale_t: torch.Tensor
    """(K / block, rows): uint8 E8M0 bytes (MXFP8) or float32 (1x128 fp8)."""


def _use_gluon(impl: str, t: torch.Tensor, *, shape_fits: bool, shape_rule: str) -> bool:
    """Whether a call runs its Gluon kernel: ``impl`` is ``auto`` (where it runs: Gluon
    imported, an sm_90 GPU, ``shape_fits``), ``gluon`` (there, else ``ValueError``) or
    ``triton``."""
    if impl not in ("auto", "gluon", "triton"):
        raise ValueError(f"impl must be 'auto', 'gluon' or 'triton', got {impl!r}")
    if impl == "triton":
        return False
    fits = _gluon is not None and shape_fits and _is_sm90(_device_index(t))
    if impl == "gluon" and not fits:
        raise ValueError(
            "the Gluon kernel needs Triton's Gluon Hopper module "
            f"(imported: {_gluon is not None}), an sm_90 GPU and {shape_rule}; use impl='triton'"
        )
    return fits
