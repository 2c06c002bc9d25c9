"""The Hopper kernels' block-scaled operands in torch ops: the ``fp8`` recipe's 1x128 blocks
(:func:`quantize_blocks`) and MXFP8's 1x32 (:func:`quantize_mx_blocks`).

The CPU stand-in kernels of the tests quantise through them: one definition of each format
beside the kernels. Compiled graphs use them only where Inductor's kernels could not be given
the read-back barrier ([Note: read-back barrier] in readback_barrier.py): there the graph's own
operands (activations, gradients) are quantised with these, and Inductor fuses each block amax,
scale and cast into the kernels around the operand's producer, which removes the racing
read-back at the cost of reading the operand again per layout ([Note: compiled MX layers] in
ops.py).
"""

from __future__ import annotations

import torch

from aligndp.lowp.mx_format import mx_blocks
from aligndp.lowp.recipe_fp8_tensor import AMAX_FLOOR, E4M3_MAX

__all__ = ["quantize_blocks", "quantize_mx_blocks"]


def quantize_blocks(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (M, N), any strides, N a multiple of ``block``, in 1x``block`` blocks along N:
    ``(data, scale_t)`` = ((M, N) E4M3, (N / block, M) float32), both row-major, the layout of
    [Note: operand layout] in triton_common.py. Per block, ``safe = max(amax, 1e-30)`` (448 for
    an all-zero block); data ``x * (448 / safe)`` saturated at 448 (NaN kept), rounded to
    nearest even; scale ``safe / 448``. The Hopper quantise kernels' arithmetic, step for step
    (Inductor's division may round the inverse differently in its last bit)."""
    m, n = x.shape
    blocks = x.float().reshape(m, n // block, block)
    amax = blocks.abs().amax(-1)
    safe = torch.where(amax > 0, amax.clamp(min=AMAX_FLOOR), E4M3_MAX)
    # tensor by tensor, rounded once as the kernels' div_rn: torch computes ``448 / safe`` as
    # ``safe.reciprocal() * 448``, and on CUDA ``safe / 448`` as ``safe * (1 / 448)``
    fp8_max = torch.full_like(safe, E4M3_MAX)
    scaled = blocks * (fp8_max / safe).unsqueeze(-1)
    data = scaled.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).reshape(m, n)
    return _dense(data), _dense((safe / fp8_max).T)


def quantize_mx_blocks(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (M, N) in MXFP8 blocks of ``block`` along N: ``(data, scale_t)`` = ((M, N) E4M3,
    (N / block, M) uint8 biased E8M0 exponents), row-major as :func:`quantize_blocks`'s. The rule
    of :func:`aligndp.lowp.mx_format.mx_blocks`, which the MXFP8 kernels match bit for bit."""
    data, scale = mx_blocks(x, block)
    return _dense(data), _dense(scale.T)


def _dense(t: torch.Tensor) -> torch.Tensor:
    """``t`` with row-major strides. Not ``contiguous()``: that keeps a one-row transpose's
    strides (1, 1), which counts as contiguous but is no 16-byte row stride for a TMA
    descriptor (a K = 128 operand's scales are one row)."""
    return t.clone(memory_format=torch.contiguous_format)
