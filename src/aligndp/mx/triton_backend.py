"""The Hopper backends of MXLinear: MXFP8 (``triton``) and 1x128 blockwise FP8 (``fp8``).

Both quantise each operand along its GEMM's contraction dim with one Triton pass and run the
block-scaled GEMM of :mod:`aligndp.mx.triton_kernels`, whose wgrad accumulates in place into
``main_grad`` after the pointer checks of :class:`~aligndp.mx.backends.WgradBackend`.
Importing this module imports Triton; :func:`aligndp.mx.backends.get_backend` does so lazily.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from aligndp.mx.backends import WgradBackend, pad_tokens
from aligndp.mx.format import padded_length
from aligndp.mx.triton_kernels import QuantizedOperand, quantize_rows_and_columns, scaled_gemm

__all__ = ["TritonMXBackend", "TritonFP8Backend"]


def _pad_2d(t: torch.Tensor, multiple: int) -> torch.Tensor:
    """Zero-pad both dims of a 2-D tensor to multiples of ``multiple`` (exact for GEMMs)."""
    rows, cols = t.shape
    extra_rows, extra_cols = padded_length(rows, multiple) - rows, padded_length(cols, multiple) - cols
    return F.pad(t, (0, extra_cols, 0, extra_rows)) if extra_rows or extra_cols else t


class TritonMXBackend(WgradBackend):
    """MXFP8 E4M3, 1x32 E8M0 blocks; numerics of :class:`~aligndp.mx.backends.ReferenceBackend`
    up to float32 summation order."""

    name = "triton"
    recipe = "mxfp8"
    block = 32
    mx = True

    def _quantize(self, t: torch.Tensor, *, rowwise: bool) -> QuantizedOperand:
        """``t`` (rows, cols) as a K-major operand: rows of ``t`` (rowwise) or of ``t.T``."""
        row, col = quantize_rows_and_columns(_pad_2d(t, self.block), block=self.block, mx=self.mx,
                                             rowwise=rowwise, colwise=not rowwise)
        return row if rowwise else col

    def _gemm(self, a: QuantizedOperand, b: QuantizedOperand, rows: int, cols: int, dtype) -> torch.Tensor:
        out = torch.empty(a.data.shape[0], b.data.shape[0], dtype=dtype, device=a.data.device)
        scaled_gemm(a, b, out, block=self.block, mx=self.mx)
        return out[:rows, :cols]

    def forward(self, x, weight):
        a, b = self._quantize(x, rowwise=True), self._quantize(weight, rowwise=True)
        return self._gemm(a, b, x.shape[0], weight.shape[0], x.dtype)

    def dgrad(self, grad_out, weight):
        a, b = self._quantize(grad_out, rowwise=True), self._quantize(weight, rowwise=False)
        return self._gemm(a, b, grad_out.shape[0], weight.shape[1], grad_out.dtype)

    def _wgrad_operands(self, grad_out, x) -> tuple[QuantizedOperand, QuantizedOperand]:
        return (self._quantize(pad_tokens(grad_out, self.block), rowwise=False),
                self._quantize(pad_tokens(x, self.block), rowwise=False))

    def wgrad(self, grad_out, x):
        a, b = self._wgrad_operands(grad_out, x)
        return self._gemm(a, b, grad_out.shape[1], x.shape[1], torch.float32)

    def wgrad_accumulate(self, grad_out, x, main_grad):
        self.check(main_grad, grad_out, x)
        if grad_out.shape[1] % self.block or x.shape[1] % self.block:
            main_grad.add_(self.wgrad(grad_out, x))  # ragged feature dims: no in-place kernel
            return
        a, b = self._wgrad_operands(grad_out, x)
        scaled_gemm(a, b, main_grad, block=self.block, mx=self.mx, accumulate=True)


class TritonFP8Backend(TritonMXBackend):
    """1x128 blockwise FP8 E4M3 with float32 scales ``amax / 448`` along the contraction dim;
    the GEMM promotes to float32 once per 128-wide K block."""

    name = "fp8"
    recipe = "fp8"
    block = 128
    mx = False
