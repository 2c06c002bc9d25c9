"""The Hopper kernels' contracts (``aligndp.lowp.triton_kernels``) in plain torch on CPU, so a
test can run the Python around them — the fp8 / mxfp8 backend, the custom ops of
[Note: compiled MX layers] and the grad sink — where Triton cannot run.

Same signatures, shapes, dtypes and in-place behaviour as the real kernels ([Note: operand
layout] in aligndp/lowp/triton_common.py): quantise blocks of ``block`` elements along each
GEMM's contraction dim (float32 scales ``amax / 448`` by
:func:`aligndp.lowp.fp8_blocks.quantize_blocks`, or E8M0 by
:func:`aligndp.lowp.fp8_blocks.quantize_mx_blocks`), and a GEMM that dequantises, multiplies in
float32 and writes ``out`` or adds to it (``accumulate``) — a workspace, when given, is reused
per shape and role as the real quantise does. The numerics are the book's, not the kernels'
summation order: tests compare two runs through these stand-ins, never them with the GPU.
"""

from __future__ import annotations

import types

import torch

from aligndp.lowp.fp8_blocks import quantize_blocks, quantize_mx_blocks
from aligndp.lowp.recipe import ScaleFormat
from aligndp.lowp.triton_common import QuantizedOperand


def _quantize_along_rows(x: torch.Tensor, block: int, mx: bool):
    """(data (M, N), scale_t (N / block, M)) of ``x`` (M, N) in blocks along N."""
    return (quantize_mx_blocks if mx else quantize_blocks)(x, block)


def quantize_rows_and_columns(
    x: torch.Tensor,
    *,
    block: int = 32,
    scale_format: ScaleFormat = ScaleFormat.E8M0,
    elem_dtype: torch.dtype = torch.float8_e4m3fn,
    rowwise: bool = True,
    colwise: bool = True,
    impl: str = "auto",
    tile: int = 64,
    one_allocation: bool = True,
    workspace: dict | None = None,
):
    assert x.ndim == 2 and not x.shape[0] % block and not x.shape[1] % block, x.shape
    mx = ScaleFormat(scale_format) is ScaleFormat.E8M0
    scale_dtype = torch.uint8 if mx else torch.float32
    out = []
    for wanted, role, t in ((rowwise, "row", x), (colwise, "col", x.T)):
        if not wanted:
            out.append(None)
            continue
        data, scale_t = _quantize_along_rows(t.contiguous(), block, mx)
        key = (role, tuple(data.shape), tuple(scale_t.shape), scale_dtype)
        op = None if workspace is None else workspace.get(key)
        if op is None:
            op = QuantizedOperand(torch.empty_like(data), torch.empty_like(scale_t.contiguous()))
            if workspace is not None:
                workspace[key] = op
        op.data.copy_(data)
        op.scale_t.copy_(scale_t)
        out.append(op)
    return tuple(out)


def _dequantize(op: QuantizedOperand, block: int, mx: bool) -> torch.Tensor:
    scale = op.scale_t.T.float()
    if mx:
        scale = torch.exp2(scale - 127)
    return op.data.float() * scale.repeat_interleave(block, dim=1)


def dequantize_operand(op: QuantizedOperand, *, block: int = 32) -> torch.Tensor:
    return _dequantize(op, block, True).bfloat16()


def scaled_gemm(
    a: QuantizedOperand,
    b: QuantizedOperand,
    out: torch.Tensor,
    *,
    block: int = 32,
    scale_format: ScaleFormat = ScaleFormat.E8M0,
    accumulate: bool = False,
    bias: torch.Tensor | None = None,
    impl: str = "auto",
) -> torch.Tensor:
    for t in (*a, *b, out):  # TMA descriptors: row-major, even for a tensor of one row
        if t.stride() != (t.shape[1], 1):
            raise ValueError(f"GEMM tensor {tuple(t.shape)} strides {t.stride()}: not row-major")
    for op in (a, b):
        if tuple(op.scale_t.shape) != (op.data.shape[1] // block, op.data.shape[0]):
            raise ValueError(f"scales {tuple(op.scale_t.shape)} for data {tuple(op.data.shape)}")
    mx = ScaleFormat(scale_format) is ScaleFormat.E8M0
    product = _dequantize(a, block, mx) @ _dequantize(b, block, mx).T
    if bias is not None:
        product[:, : bias.shape[0]] += bias.float()
    if accumulate:
        product += out.float()
    return out.copy_(product)


def module() -> types.ModuleType:
    """A stand-in for ``aligndp.lowp.triton_kernels`` (put it in ``sys.modules``)."""
    fake = types.ModuleType("aligndp.lowp.triton_kernels")
    for name in ("QuantizedOperand", "quantize_rows_and_columns", "scaled_gemm"):
        setattr(fake, name, globals()[name])
    fake.dequantize_operand = dequantize_operand
    return fake
