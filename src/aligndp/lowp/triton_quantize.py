"""Triton kernel for Hopper: one-pass row+column quantisation into fp8 GEMM operands
([Note: operand layout] in :mod:`aligndp.lowp.triton_common`), with E8M0 (MXFP8) or float32
(1x128 fp8) block scales. Where Triton's Gluon runs (sm_90, Triton 3.6) the faster kernel of
:mod:`aligndp.lowp.gluon_quantize` runs instead; this one is its fallback. GPU only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from aligndp.lowp.recipe import ScaleFormat
from aligndp.lowp.triton_common import QuantizedOperand, _gluon, _use_gluon
from aligndp.lowp.triton_launch import CheapLauncher

__all__ = ["quantize_rows_and_columns"]


@triton.jit
def _scales(amax, has_nan, EMAX: tl.constexpr, FP8_MAX: tl.constexpr, MX: tl.constexpr):
    """(stored scale, inverse scale) for block maxima; see
    aligndp.lowp.mx_format.shared_exponent."""
    if MX:
        field = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF
        biased = tl.minimum(tl.maximum(field - 127 - EMAX, -127), 127) + 127
        biased = tl.where((field == 255) | has_nan, 255, biased)
        inv_bits = tl.minimum(tl.maximum(254 - biased, 1), 254)
        inv = (inv_bits << 23).to(tl.float32, bitcast=True)
        inv = tl.where(biased == 255, 0.0, inv)
        return biased.to(tl.uint8), inv
    else:
        # floored at 1e-30 (fp8-tensor's AMAX_FLOOR): below ~1.3e-36, 448 / amax overflows to
        # inf and the block's zeros would become NaN (0 * inf)
        safe = tl.where(amax > 0, tl.maximum(amax, 1e-30), FP8_MAX)
        return tl.math.div_rn(safe, FP8_MAX), tl.math.div_rn(FP8_MAX, safe)


@triton.jit
def _to_fp8(x, inv, FP8_MAX: tl.constexpr, OUT: tl.constexpr):
    """Scale, saturate (keeping NaN) and round to nearest even into fp8."""
    v = x * inv
    v = tl.where(v != v, v, tl.minimum(tl.maximum(v, -FP8_MAX), FP8_MAX))
    return v.to(OUT)


@triton.jit
def _quantize_kernel(
    x_ptr,
    row_ptr,
    row_scale_ptr,
    col_ptr,
    col_scale_ptr,
    M,
    N,
    BLOCK: tl.constexpr,
    TILE_M: tl.constexpr,
    TILE_N: tl.constexpr,
    EMAX: tl.constexpr,
    FP8_MAX: tl.constexpr,
    MX: tl.constexpr,
    OUT: tl.constexpr,
    ROWWISE: tl.constexpr,
    COLWISE: tl.constexpr,
):
    offs_m = tl.program_id(0) * TILE_M + tl.arange(0, TILE_M)
    offs_n = tl.program_id(1) * TILE_N + tl.arange(0, TILE_N)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    x = tl.load(x_ptr + offs_m[:, None] * N + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
    if ROWWISE:
        xb = tl.reshape(x, (TILE_M, TILE_N // BLOCK, BLOCK))
        amax = tl.max(tl.abs(xb), axis=2)
        nan = tl.max((xb != xb).to(tl.int32), axis=2) > 0
        scale, inv = _scales(amax, nan, EMAX, FP8_MAX, MX)
        q = tl.reshape(_to_fp8(xb, inv[:, :, None], FP8_MAX, OUT), (TILE_M, TILE_N))
        tl.store(row_ptr + offs_m[:, None] * N + offs_n[None, :], q, mask=mask)
        offs_kb = tl.program_id(1) * (TILE_N // BLOCK) + tl.arange(0, TILE_N // BLOCK)
        smask = (offs_kb[:, None] < N // BLOCK) & (offs_m[None, :] < M)
        tl.store(
            row_scale_ptr + offs_kb[:, None] * M + offs_m[None, :], tl.trans(scale), mask=smask
        )
    if COLWISE:
        xc = tl.reshape(x, (TILE_M // BLOCK, BLOCK, TILE_N))
        amax = tl.max(tl.abs(xc), axis=1)
        nan = tl.max((xc != xc).to(tl.int32), axis=1) > 0
        scale, inv = _scales(amax, nan, EMAX, FP8_MAX, MX)
        q = tl.reshape(_to_fp8(xc, inv[:, None, :], FP8_MAX, OUT), (TILE_M, TILE_N))
        tl.store(col_ptr + offs_n[:, None] * M + offs_m[None, :], tl.trans(q), mask=tl.trans(mask))
        offs_kb = tl.program_id(0) * (TILE_M // BLOCK) + tl.arange(0, TILE_M // BLOCK)
        smask = (offs_kb[:, None] < M // BLOCK) & (offs_n[None, :] < N)
        tl.store(col_scale_ptr + offs_kb[:, None] * N + offs_n[None, :], scale, mask=smask)


_quantize = CheapLauncher(_quantize_kernel)

_FP8 = {
    torch.float8_e4m3fn: (tl.float8e4nv, 8, 448.0),
    torch.float8_e5m2: (tl.float8e5, 15, 57344.0),
}


def _operand(
    data_shape, scale_shape, elem_dtype, scale_dtype, device, one, workspace=None, role=""
) -> QuantizedOperand:
    """Empty data and scales, in one allocation (``one``: the scales 256-byte aligned after the
    data) or two; the one made for this ``role`` and shape on an earlier call when
    ``workspace`` (a dict) holds it (a square tensor's rows and columns have equal shapes, so
    the role keeps them apart)."""
    if workspace is not None:
        key = (role, device, tuple(data_shape), tuple(scale_shape), elem_dtype, scale_dtype, one)
        made = workspace.get(key)
        if made is None:
            made = workspace[key] = _operand(
                data_shape, scale_shape, elem_dtype, scale_dtype, device, one
            )
        return made
    if not one:
        return QuantizedOperand(
            torch.empty(data_shape, dtype=elem_dtype, device=device),
            torch.empty(scale_shape, dtype=scale_dtype, device=device),
        )
    # both as strided views of the whole buffer: four view ops, not six (host cost per call)
    (rows, cols), (s_rows, s_cols) = data_shape, scale_shape
    data_bytes = -(-rows * cols * elem_dtype.itemsize // 256) * 256
    size = scale_dtype.itemsize
    buf = torch.empty(data_bytes + s_rows * s_cols * size, dtype=torch.uint8, device=device)
    data = buf.view(elem_dtype).as_strided(data_shape, (cols, 1))
    scale = buf.view(scale_dtype).as_strided(scale_shape, (s_cols, 1), data_bytes // size)
    return QuantizedOperand(data, scale)


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
) -> tuple[QuantizedOperand | None, QuantizedOperand | None]:
    """Row-wise and/or column-wise quantisation of a 2-D CUDA tensor in one read.

    ``scale_format``: ``E8M0`` power-of-two scales by the OCP FLOOR rule (MXFP8), or ``FP32``
    scales ``amax / fp8_max`` (the 1x``block`` fp8 recipe). Both dims must be multiples of
    ``block``.
    ``impl``: ``auto`` runs the Gluon kernel ([Note: quantise layout]) on sm_90 for blocks of
    32 and 128 and the plain-Triton one elsewhere; ``gluon`` / ``triton`` force one. ``tile``
    (a multiple of ``block``) is the square tile of the plain-Triton kernel.
    ``one_allocation``: each operand's data and scales share one allocation (False: two, as a
    custom op's outputs must not share storage).
    ``workspace``: a dict whose operands of these shapes are reused (made on first use): the
    next quantise of the same shape into it overwrites the result, so only for operands used
    up before then (``grad_out`` in backward).
    """
    if x.ndim != 2 or not x.is_cuda or x.shape[0] % block or x.shape[1] % block:
        raise ValueError(
            f"expected a 2-D CUDA tensor with both dims multiples of {block}, got "
            f"{tuple(x.shape)} on {x.device}; zero-pad it first"
        )
    if x.numel() >= 2**31:
        raise ValueError(
            f"{tuple(x.shape)} has {x.numel()} elements; the kernels index with 32 bits, so "
            "quantise it in pieces of fewer than 2**31 elements"
        )
    use_gluon = _use_gluon(
        impl, x, shape_fits=block in (32, 128), shape_rule=f"block 32 or 128 (got {block})"
    )
    x = x.contiguous()
    M, N = x.shape
    out, emax, fp8_max = _FP8[elem_dtype]
    mx = ScaleFormat(scale_format) is ScaleFormat.E8M0
    scale_dtype = torch.uint8 if mx else torch.float32
    # one allocation per layout (data and scales), not two: the host cost of a quantise is
    # per call. The layouts stay apart because they live apart (forward keeps only the column
    # one of x and the weight for backward).
    one, dev = one_allocation, x.device
    row = col = None
    if rowwise:
        row = _operand((M, N), (N // block, M), elem_dtype, scale_dtype, dev, one, workspace, "row")
    if colwise:
        col = _operand((N, M), (M // block, N), elem_dtype, scale_dtype, dev, one, workspace, "col")
    if row is None and col is None:
        return row, col
    if use_gluon:
        _gluon.quantize(
            x, row, col, block=block, scale_format=scale_format, out=out, emax=emax, fp8_max=fp8_max
        )
        return row, col
    tile = max(block, tile)
    spare = row or col  # pointers for the layout not written: never read, no allocation
    grid = (triton.cdiv(M, tile), triton.cdiv(N, tile))
    _quantize[grid](
        x,
        (row or spare).data,
        (row or spare).scale_t,
        (col or spare).data,
        (col or spare).scale_t,
        M,
        N,
        BLOCK=block,
        TILE_M=tile,
        TILE_N=tile,
        EMAX=emax,
        FP8_MAX=fp8_max,
        MX=mx,
        OUT=out,
        ROWWISE=rowwise,
        COLWISE=colwise,
        num_warps=8,
    )
    return row, col
