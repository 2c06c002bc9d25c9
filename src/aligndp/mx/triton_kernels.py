"""Triton kernels for Hopper: one-pass row+column quantisation and a block-scaled fp8 GEMM
that accumulates in place. Imported only by :mod:`aligndp.mx.triton_backend` (GPU only).

[Note: operand layout]
Every GEMM operand is a :class:`QuantizedOperand`: ``data`` (rows, K) fp8, K-major (what
Hopper's fp8 wgmma wants for both operands), and ``scale_t`` (K / block, rows), i.e. the
scales transposed so one K-block's scales for a row tile are one coalesced load. The
quantise kernel writes, from one read of X (M, N):
  row-wise: data (M, N) quantised along N, scale_t (N / block, M)
  col-wise: data (N, M) = X.T quantised along M, scale_t (M / block, N)
so ``colwise.data == quantize_mxfp8(X, dim=0).data.T`` and ``colwise.scale_t ==
quantize_mxfp8(X, dim=0).scale`` bit for bit (see tests/test_mx_gpu.py).

[Note: block-scaled GEMM]
C (+)= sum over K-blocks kb of dot(A[:, kb], B[:, kb]) * sa[kb, m] * sb[kb, n]: one fp8
``tl.dot`` per scale block (K = 32 for MXFP8, 128 for the 1x128 fp8 recipe), its float32
partial multiplied by the outer product of the two scale vectors and added into a float32
accumulator; C is read and written once at the end. MX scale bytes become floats by an
exponent shift; byte 0 (2**-127, blocks with amax < 2**-118) reads as 0 there, a documented
deviation of < 2**-109 in absolute terms per element.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

__all__ = ["QuantizedOperand", "quantize_rows_and_columns", "scaled_gemm"]


class QuantizedOperand(NamedTuple):
    """One GEMM operand; see [Note: operand layout]."""

    data: torch.Tensor
    """(rows, K) float8, contiguous."""
    scale_t: torch.Tensor
    """(K / block, rows): uint8 E8M0 bytes (MXFP8) or float32 (1x128 fp8)."""


@triton.jit
def _scales(amax, has_nan, EMAX: tl.constexpr, FP8_MAX: tl.constexpr, MX: tl.constexpr):
    """(stored scale, inverse scale) for block maxima; see aligndp.mx.format.shared_exponent."""
    if MX:
        field = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF
        biased = tl.minimum(tl.maximum(field - 127 - EMAX, -127), 127) + 127
        biased = tl.where((field == 255) | has_nan, 255, biased)
        inv_bits = tl.minimum(tl.maximum(254 - biased, 1), 254)
        inv = (inv_bits << 23).to(tl.float32, bitcast=True)
        inv = tl.where(biased == 255, 0.0, inv)
        return biased.to(tl.uint8), inv
    else:
        safe = tl.where(amax > 0, amax, FP8_MAX)
        return tl.math.div_rn(safe, FP8_MAX), tl.math.div_rn(FP8_MAX, safe)


@triton.jit
def _to_fp8(x, inv, FP8_MAX: tl.constexpr, OUT: tl.constexpr):
    """Scale, saturate (keeping NaN) and round to nearest even into fp8."""
    v = x * inv
    v = tl.where(v != v, v, tl.minimum(tl.maximum(v, -FP8_MAX), FP8_MAX))
    return v.to(OUT)


@triton.jit
def _quantize_kernel(x_ptr, row_ptr, row_scale_ptr, col_ptr, col_scale_ptr, M, N,
                     BLOCK: tl.constexpr, TILE_M: tl.constexpr, TILE_N: tl.constexpr,
                     EMAX: tl.constexpr, FP8_MAX: tl.constexpr, MX: tl.constexpr, OUT: tl.constexpr,
                     ROWWISE: tl.constexpr, COLWISE: tl.constexpr):
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
        tl.store(row_scale_ptr + offs_kb[:, None] * M + offs_m[None, :], tl.trans(scale), mask=smask)
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


_FP8 = {torch.float8_e4m3fn: (tl.float8e4nv, 8, 448.0), torch.float8_e5m2: (tl.float8e5, 15, 57344.0)}


def quantize_rows_and_columns(x: torch.Tensor, *, block: int = 32, mx: bool = True,
                              elem_dtype: torch.dtype = torch.float8_e4m3fn, rowwise: bool = True,
                              colwise: bool = True, tile: int = 64) -> tuple[QuantizedOperand | None, QuantizedOperand | None]:
    """Row-wise and/or column-wise quantisation of a 2-D CUDA tensor in one read.

    ``mx``: E8M0 power-of-two scales by the OCP FLOOR rule (MXFP8); else float32 scales
    ``amax / fp8_max`` (the 1x``block`` fp8 recipe). Both dims must be multiples of ``block``;
    ``tile`` (a multiple of ``block``) is the square tile one program reads.
    """
    if x.ndim != 2 or not x.is_cuda or x.shape[0] % block or x.shape[1] % block:
        raise ValueError(f"expected a 2-D CUDA tensor with both dims multiples of {block}, got "
                         f"{tuple(x.shape)} on {x.device}; zero-pad it first")
    x = x.contiguous()
    M, N = x.shape
    out, emax, fp8_max = _FP8[elem_dtype]
    scale_dtype = torch.uint8 if mx else torch.float32
    row = QuantizedOperand(torch.empty(M, N, dtype=elem_dtype, device=x.device),
                           torch.empty(N // block, M, dtype=scale_dtype, device=x.device)) if rowwise else None
    col = QuantizedOperand(torch.empty(N, M, dtype=elem_dtype, device=x.device),
                           torch.empty(M // block, N, dtype=scale_dtype, device=x.device)) if colwise else None
    tile = max(block, tile)
    dummy = x.new_empty(0)
    grid = (triton.cdiv(M, tile), triton.cdiv(N, tile))
    _quantize_kernel[grid](
        x, row.data if row else dummy, row.scale_t if row else dummy, col.data if col else dummy,
        col.scale_t if col else dummy, M, N, BLOCK=block, TILE_M=tile, TILE_N=tile, EMAX=emax,
        FP8_MAX=fp8_max, MX=mx, OUT=out, ROWWISE=rowwise, COLWISE=colwise, num_warps=8,
    )
    return row, col


def _gemm_configs():
    shapes = [(128, 128, 8, 4), (128, 128, 8, 6), (128, 256, 8, 3), (256, 128, 8, 3)]
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "GROUP_M": 8}, num_warps=w, num_stages=s)
            for bm, bn, w, s in shapes]


@triton.autotune(configs=_gemm_configs(), key=["M", "N", "K", "SCALE_BLOCK", "ACCUMULATE"], restore_value=["c_ptr"])
@triton.jit
def _scaled_gemm_kernel(a_ptr, sa_ptr, b_ptr, sb_ptr, c_ptr, M, N, K,
                        SCALE_BLOCK: tl.constexpr, MX: tl.constexpr, ACCUMULATE: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    # grouped tile order so GROUP_M row tiles share B tiles in L2
    pid = tl.program_id(0)
    num_m, num_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * num_n)
    first_m = group * GROUP_M
    group_rows = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_n)) % group_rows
    pid_n = (pid % (GROUP_M * num_n)) // group_rows
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    offs_k = tl.arange(0, SCALE_BLOCK)
    a_ptrs = a_ptr + offs_m[:, None] * K + offs_k[None, :]
    b_ptrs = b_ptr + offs_n[:, None] * K + offs_k[None, :]
    # [Note: K-loop loads] Triton 3.6 stops software-pipelining this loop because of the scale
    # loads (any non-operand load does), so operand tiles load synchronously: measured 144
    # TFLOP/s (MXFP8) and 524 (1x128) on H200. Hoisting scales into per-chunk register tiles
    # restored pipelining but the in-register row pick cost more (38 / 43 TFLOP/s); the fix is
    # TMA descriptors or a warp-specialised kernel, not done yet.
    sa_ptrs = sa_ptr + offs_m
    sb_ptrs = sb_ptr + offs_n
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(0, K // SCALE_BLOCK):
        a = tl.load(a_ptrs)
        b = tl.load(b_ptrs)
        partial = tl.dot(a, tl.trans(b))
        sa = tl.load(sa_ptrs)
        sb = tl.load(sb_ptrs)
        if MX:
            sa = (sa.to(tl.int32) << 23).to(tl.float32, bitcast=True)
            sb = (sb.to(tl.int32) << 23).to(tl.float32, bitcast=True)
        acc += partial * (sa[:, None] * sb[None, :])
        a_ptrs += SCALE_BLOCK
        b_ptrs += SCALE_BLOCK
        sa_ptrs += M
        sb_ptrs += N
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    c_ptrs = c_ptr + rows[:, None] * N + cols[None, :]
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    if ACCUMULATE:
        acc += tl.load(c_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)


def scaled_gemm(a: QuantizedOperand, b: QuantizedOperand, out: torch.Tensor, *, block: int = 32,
                mx: bool = True, accumulate: bool = False) -> torch.Tensor:
    """``out (+)= A @ B.T`` for quantised A (M, K), B (N, K); see [Note: block-scaled GEMM].

    ``out`` is (M, N), contiguous, float32 or bfloat16, e.g. a main_grad view; with
    ``accumulate`` it is read and added to in place, else overwritten.
    """
    (M, K), (N, K_b) = a.data.shape, b.data.shape
    if K != K_b or K % block:
        raise ValueError(f"GEMM operands contract over {K} and {K_b}; both must be equal multiples of {block}")
    if tuple(out.shape) != (M, N) or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous ({M}, {N}) tensor, got {tuple(out.shape)} strides {out.stride()}")
    grid = lambda meta: (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)  # noqa: E731
    _scaled_gemm_kernel[grid](a.data, a.scale_t, b.data, b.scale_t, out, M, N, K,
                              SCALE_BLOCK=block, MX=mx, ACCUMULATE=accumulate)
    return out
