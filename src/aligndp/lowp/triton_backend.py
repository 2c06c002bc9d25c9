"""The Hopper backend of MXLinear, for the recipes its kernels implement: MXFP8 (backend
``triton``: E8M0 scales, 1x32 blocks) and 1x128 blockwise FP8 (backend ``fp8``: float32
scales); the block and scale format come from the recipe.

Both quantise each operand along its GEMM's contraction dim and run the block-scaled GEMM of
:mod:`aligndp.lowp.triton_kernels`, whose wgrad accumulates in place into ``main_grad`` (or
writes it) after the pointer checks of :class:`~aligndp.lowp.backends.WgradBackend`. Inside
MXLinear every tensor is quantised once, rows and columns in one pass, for both GEMMs that
read it: ``x`` (forward, then wgrad, saved as fp8), the weight (forward, then dgrad) and
``grad_out`` (dgrad and wgrad): three quantise launches per layer and step instead of six,
and fp8 rather than ``x`` kept for backward. Importing this module imports Triton;
:func:`aligndp.lowp.backends.get_backend` does so lazily.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from aligndp.lowp.backends import WgradBackend, pad_tokens, put_wgrad
from aligndp.lowp.fp8_blocks import quantize_blocks, quantize_mx_blocks
from aligndp.lowp.mx_format import padded_length
from aligndp.lowp.ops import compiling, quantize_rc, scaled_mm
from aligndp.lowp.readback_barrier import install as install_readback_barrier
from aligndp.lowp.recipe import ScaleFormat
from aligndp.lowp.triton_kernels import QuantizedOperand, scaled_gemm
from aligndp.plan.fused import GradTarget

__all__ = ["TritonBackend"]


def _pad_2d(t: torch.Tensor, multiple: int) -> torch.Tensor:
    """Zero-pad both dims of a 2-D tensor to multiples of ``multiple`` (exact for GEMMs)."""
    rows, cols = t.shape
    extra_rows, extra_cols = (
        padded_length(rows, multiple) - rows,
        padded_length(cols, multiple) - cols,
    )
    return F.pad(t, (0, extra_cols, 0, extra_rows)) if extra_rows or extra_cols else t


class _Saved(NamedTuple):
    """What one MXLinear call keeps for its backward: the column-wise (K = tokens / out-features)
    operands of ``x`` and the weight, and the unpadded shapes."""

    x_col: QuantizedOperand
    weight_col: QuantizedOperand
    tokens: int
    in_features: int
    out_features: int


class TritonBackend(WgradBackend):
    """E4M3 operands in the recipe's blocks along each GEMM's contraction dim. E8M0 scales
    (MXFP8): the numerics of :class:`~aligndp.lowp.backends.ReferenceBackend` up to float32
    summation order; float32 scales ``amax / 448`` (1x128 fp8): the GEMM promotes to float32
    once per K block."""

    name = "triton"
    scale_formats = (ScaleFormat.E8M0, ScaleFormat.FP32)

    def __init__(self, recipe, *, name: str | None = None):
        super().__init__(recipe, name=name)
        self._grad_out_buffers: dict = {}
        """Quantised ``grad_out`` operands by shape, reused by every backward of this backend:
        the dgrad and the wgrad (right after, in the same backward) use them up before the
        next layer's backward writes them again; stream order does the rest. Never ``x`` or
        the weight, which outlive their call."""
        self._fuse_into_graph = not install_readback_barrier()
        """Compiled, quantise graph-computed operands in torch ops (Inductor fuses them into
        their producer) rather than through the one-pass kernel: only where Inductor's kernels
        could not be given the read-back barrier ([Note: read-back barrier])."""

    @property
    def _mx(self) -> bool:
        return self.recipe.scale_format is ScaleFormat.E8M0

    def _quantize(
        self,
        t: torch.Tensor,
        *,
        rowwise: bool = True,
        colwise: bool = True,
        workspace: dict | None = None,
        produced: bool = True,
    ) -> tuple[QuantizedOperand | None, QuantizedOperand | None]:
        """``t`` (rows, cols), padded to the block, as K-major operands in one pass: its rows
        (``rowwise``) and the rows of ``t.T`` (``colwise``); None for one not asked for. Into
        ``workspace``'s operands when given (only for operands used up before the next
        quantise of that shape). Compiled, through the ``aligndp::quantize_rc`` op, which reads
        ``t`` once for both layouts; only without the read-back barrier is a ``t``
        ``produced`` by the graph (an activation or a gradient, not a weight) quantised in torch
        ops that Inductor fuses into its producer ([Note: read-back barrier])."""
        t = _pad_2d(t, self.block)
        if produced and self._fuse_into_graph and compiling():
            blocks = quantize_mx_blocks if self._mx else quantize_blocks
            return tuple(
                QuantizedOperand(*blocks(v, self.block)) if wanted else None
                for wanted, v in ((rowwise, t), (colwise, t.T))
            )
        pairs = quantize_rc(
            t,
            block=self.block,
            mx=self._mx,
            rowwise=rowwise,
            colwise=colwise,
            workspace=workspace,
        )
        return tuple(None if p is None else QuantizedOperand(*p) for p in pairs)

    def _gemm(
        self,
        a: QuantizedOperand,
        b: QuantizedOperand,
        rows: int,
        cols: int,
        dtype,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        out = scaled_mm(a, b, block=self.block, mx=self._mx, out_dtype=dtype, bias=bias)
        # the slice only where a dim was padded to the block: a view op per GEMM otherwise
        return out if out.shape == (rows, cols) else out[:rows, :cols]

    def forward(self, x, weight):
        a = self._quantize(x, colwise=False)[0]
        b = self._quantize(weight, colwise=False, produced=False)[0]
        return self._gemm(a, b, x.shape[0], weight.shape[0], x.dtype)

    def dgrad(self, grad_out, weight):
        a = self._quantize(grad_out, colwise=False)[0]
        b = self._quantize(weight, rowwise=False, produced=False)[1]
        return self._gemm(a, b, grad_out.shape[0], weight.shape[1], grad_out.dtype)

    def _wgrad_operands(self, grad_out, x) -> tuple[QuantizedOperand, QuantizedOperand]:
        return (
            self._quantize(pad_tokens(grad_out, self.block), rowwise=False)[1],
            self._quantize(pad_tokens(x, self.block), rowwise=False)[1],
        )

    def wgrad(self, grad_out, x):
        a, b = self._wgrad_operands(grad_out, x)
        return self._gemm(a, b, grad_out.shape[1], x.shape[1], torch.float32)

    def wgrad_into(self, grad_out, x, target):
        self.check(target.view, grad_out, x)
        self._into(*self._wgrad_operands(grad_out, x), target)

    def _into(self, a: QuantizedOperand, b: QuantizedOperand, target: GradTarget) -> None:
        """``view += A @ B.T`` (``=`` unless ``target.accumulate``), in place unless a feature
        dim was padded to the block."""
        rows, cols = target.view.shape
        if rows % self.block or cols % self.block:  # ragged feature dims: no in-place kernel
            put_wgrad(target, self._gemm(a, b, rows, cols, torch.float32))
        else:
            scaled_gemm(
                a,
                b,
                target.view,
                block=self.block,
                scale_format=self.recipe.scale_format,
                accumulate=target.accumulate,
            )

    def quantize_weight(self, weight):
        """Its rows (forward) and columns (dgrad), in one pass."""
        return self._quantize(weight, produced=False)

    def forward_for_backward(self, x, weight, bias=None, *, weight_q=None):
        x_row, x_col = self._quantize(x)
        w_row, w_col = weight_q if weight_q is not None else self.quantize_weight(weight)
        y = self._gemm(
            x_row, w_row, x.shape[0], weight.shape[0], x.dtype, bias=bias
        )  # bias in the epilogue
        return y, _Saved(x_col, w_col, x.shape[0], x.shape[1], weight.shape[0])

    def backward_parts(self, saved, grad_out, weight, *, need_dgrad, need_wgrad, weight_q=None):
        x_col, w_col, tokens, n_in, n_out = saved
        if not (need_dgrad or need_wgrad):  # only the bias wants a gradient
            return None, None
        dy_row, dy_col = self._quantize(
            grad_out, rowwise=need_dgrad, colwise=need_wgrad, workspace=self._grad_out_buffers
        )
        grad_x = self._gemm(dy_row, w_col, tokens, n_in, grad_out.dtype) if need_dgrad else None
        parts = (*dy_col, *x_col) if need_wgrad else None
        return grad_x, parts

    def wgrad_from_parts(self, parts, target, shape):
        dy_col, x_col = QuantizedOperand(*parts[:2]), QuantizedOperand(*parts[2:])
        if target is None:
            return self._gemm(dy_col, x_col, *shape, torch.float32)
        self.check_main_grad(target.view, shape=shape, device=parts[0].device)
        self._into(dy_col, x_col, target)
        return None
