"""Triton kernels for Hopper: one-pass row+column quantisation and block-scaled GEMMs
(MXFP8, 1x128 fp8) that accumulate in place. Imported only by :mod:`aligndp.lowp.triton_backend` (GPU only).
Where Triton's Gluon runs (sm_90, Triton 3.6) the quantise and the 1x128 GEMM run the faster
kernels of :mod:`aligndp.lowp.gluon_kernels`; the plain-Triton kernels here are their fallback.

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
Hopper has no MX matrix instruction, and its fp8 wgmma accumulates in float32 only inside
one instruction, so a block-scaled fp8 GEMM must promote each K block's partial product into
a float32 accumulator on the CUDA cores: ``acc += dot(A[:, kb], B[:, kb]) * sa[kb, m] *
sb[kb, n]``. Two kernels, chosen by measurement on H200 (benchmarks/results/mx_kernels_*.md):

- 1x128 fp8 (``mx=False``): exactly that, promoted once per 128-wide K block, C read and
  written once by TMA at the end. On Hopper with M, N multiples of 128 it runs the Gluon
  kernel of :mod:`aligndp.lowp.gluon_kernels`, which keeps one wgmma in flight while the CUDA
  cores promote ([Note: overlapped promotion]); elsewhere a plain-Triton kernel with every
  operand and scale tile brought in by TMA, software-pipelined, which waits for each block's
  wgmma before its promotion (the tensor cores idle then).
- MXFP8 (``mx=True``): promoting every 32 elements of K costs more CUDA-core work than the
  fp8 MMA saves (197 TFLOP/s measured). E4M3 times a power of two is exact in bfloat16, so
  one memory-bound pass dequantises each operand to bfloat16 (bit-exact, scale byte 0 read
  as 2**-127) and a pipelined bf16 wgmma GEMM accumulates in place in float32: the same
  products summed in float32 as an MX GEMM, at about 600 TFLOP/s, for a transient bf16 copy of
  both operands (2 bytes per element). The one inexact case: in blocks with amax < 2**-116
  (scale bytes 0-2) the dequantised values round to bfloat16 subnormals (multiples of
  2**-133), a deviation of at most 2**-134 per element.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

__all__ = ["QuantizedOperand", "dequantize_operand", "quantize_rows_and_columns", "scaled_gemm"]

try:  # the faster kernels need Gluon's Hopper module (Triton 3.6)
    from aligndp.lowp import gluon_kernels as _gluon
except (ImportError, AttributeError):  # no Gluon, or one whose API moved
    _gluon = None


@functools.cache
def _is_sm90(device_index: int) -> bool:
    """Hopper, where the Gluon kernels (wgmma, setmaxnreg) run; cached: it is asked per call."""
    return torch.cuda.get_device_capability(device_index) == (9, 0)


def _device_index(t: torch.Tensor) -> int:
    return t.device.index if t.device.index is not None else torch.cuda.current_device()


class QuantizedOperand(NamedTuple):
    """One GEMM operand; see [Note: operand layout]."""

    data: torch.Tensor
    """(rows, K) float8, contiguous."""
    scale_t: torch.Tensor
    """(K / block, rows): uint8 E8M0 bytes (MXFP8) or float32 (1x128 fp8)."""


@triton.jit
def _scales(amax, has_nan, EMAX: tl.constexpr, FP8_MAX: tl.constexpr, MX: tl.constexpr):
    """(stored scale, inverse scale) for block maxima; see aligndp.lowp.mx_format.shared_exponent."""
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


_FP8 = {
    torch.float8_e4m3fn: (tl.float8e4nv, 8, 448.0),
    torch.float8_e5m2: (tl.float8e5, 15, 57344.0),
}


def quantize_rows_and_columns(
    x: torch.Tensor,
    *,
    block: int = 32,
    mx: bool = True,
    elem_dtype: torch.dtype = torch.float8_e4m3fn,
    rowwise: bool = True,
    colwise: bool = True,
    impl: str = "auto",
    tile: int = 64,
) -> tuple[QuantizedOperand | None, QuantizedOperand | None]:
    """Row-wise and/or column-wise quantisation of a 2-D CUDA tensor in one read.

    ``mx``: E8M0 power-of-two scales by the OCP FLOOR rule (MXFP8); else float32 scales
    ``amax / fp8_max`` (the 1x``block`` fp8 recipe). Both dims must be multiples of ``block``.
    ``impl``: ``auto`` runs the Gluon kernel ([Note: quantise layout]) on sm_90 for blocks of
    32 and 128 and the plain-Triton one elsewhere; ``gluon`` / ``triton`` force one. ``tile``
    (a multiple of ``block``) is the square tile of the plain-Triton kernel.
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
    scale_dtype = torch.uint8 if mx else torch.float32
    row = (
        QuantizedOperand(
            torch.empty(M, N, dtype=elem_dtype, device=x.device),
            torch.empty(N // block, M, dtype=scale_dtype, device=x.device),
        )
        if rowwise
        else None
    )
    col = (
        QuantizedOperand(
            torch.empty(N, M, dtype=elem_dtype, device=x.device),
            torch.empty(M // block, N, dtype=scale_dtype, device=x.device),
        )
        if colwise
        else None
    )
    if use_gluon:
        _gluon.quantize(x, row, col, block=block, mx=mx, out=out, emax=emax, fp8_max=fp8_max)
        return row, col
    tile = max(block, tile)
    dummy = x.new_empty(0)
    grid = (triton.cdiv(M, tile), triton.cdiv(N, tile))
    _quantize_kernel[grid](
        x,
        row.data if row else dummy,
        row.scale_t if row else dummy,
        col.data if col else dummy,
        col.scale_t if col else dummy,
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


@triton.jit
def _tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Grouped tile order: GROUP_M row tiles share their B tiles in L2."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * num_n)
    first_m = group * GROUP_M
    group_rows = tl.minimum(tl.cdiv(M, BLOCK_M) - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_n)) % group_rows
    pid_n = (pid % (GROUP_M * num_n)) // group_rows
    return pid_m * BLOCK_M, pid_n * BLOCK_N


@triton.jit
def _fp8_block_gemm_kernel(
    a_desc,
    sa_desc,
    b_desc,
    sb_desc,
    c_desc,
    bias_ptr,
    n_bias,
    M,
    N,
    K,
    ACCUMULATE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP_M: tl.constexpr,
    STAGES: tl.constexpr,
):
    off_m, off_n = _tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in tl.range(0, K // SCALE_BLOCK, num_stages=STAGES):
        a = a_desc.load([off_m, kb * SCALE_BLOCK])
        b = b_desc.load([off_n, kb * SCALE_BLOCK])
        sa = tl.reshape(sa_desc.load([kb, off_m]), (BLOCK_M,))
        sb = tl.reshape(sb_desc.load([kb, off_n]), (BLOCK_N,))
        # two broadcasts, not one outer-product tile: keeps the kernel at ~175 registers
        acc += (tl.dot(a, b.T) * sa[:, None]) * sb[None, :]
    acc = _epilogue(acc, c_desc, bias_ptr, n_bias, off_m, off_n, ACCUMULATE, HAS_BIAS, BLOCK_N)
    c_desc.store([off_m, off_n], acc.to(c_desc.dtype))


@triton.jit
def _epilogue(
    acc,
    c_desc,
    bias_ptr,
    n_bias,
    off_m,
    off_n,
    ACCUMULATE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """acc (+ old C) (+ bias[None, :], its ``n_bias`` values then zeros), in float32."""
    if ACCUMULATE:
        acc += c_desc.load([off_m, off_n]).to(tl.float32)
    if HAS_BIAS:
        cols = off_n + tl.arange(0, BLOCK_N)
        acc += tl.load(bias_ptr + cols, mask=cols < n_bias, other=0.0).to(tl.float32)[None, :]
    return acc


@triton.jit
def _bf16_gemm_kernel(
    a_desc,
    b_desc,
    c_desc,
    bias_ptr,
    n_bias,
    M,
    N,
    K,
    ACCUMULATE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    STAGES: tl.constexpr,
):
    off_m, off_n = _tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in tl.range(0, tl.cdiv(K, BLOCK_K), num_stages=STAGES):
        acc = tl.dot(a_desc.load([off_m, k * BLOCK_K]), b_desc.load([off_n, k * BLOCK_K]).T, acc)
    acc = _epilogue(acc, c_desc, bias_ptr, n_bias, off_m, off_n, ACCUMULATE, HAS_BIAS, BLOCK_N)
    c_desc.store([off_m, off_n], acc.to(c_desc.dtype))


@triton.jit
def _mx_dequant_kernel(
    data_ptr,
    scale_ptr,
    out_ptr,
    R,
    K,
    BLOCK: tl.constexpr,
    TILE_R: tl.constexpr,
    TILE_K: tl.constexpr,
):
    """out (R, K) bf16 = data (R, K) fp8 * 2**(scale_t (K / BLOCK, R) - 127), exactly."""
    NB: tl.constexpr = TILE_K // BLOCK
    r = tl.program_id(0) * TILE_R + tl.arange(0, TILE_R)[:, None, None]
    kb = tl.program_id(1) * NB + tl.arange(0, NB)[None, :, None]
    offs = r * K + kb * BLOCK + tl.arange(0, BLOCK)[None, None, :]
    mask = (r < R) & (kb < K // BLOCK)
    x = tl.load(data_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    byte = tl.load(scale_ptr + kb * R + r, mask=mask, other=127).to(tl.int32)
    scale = tl.where(byte == 0, 0x00400000, byte << 23).to(
        tl.float32, bitcast=True
    )  # byte 0: 2**-127
    tl.store(out_ptr + offs, (x * scale).to(tl.bfloat16), mask=mask)


def dequantize_operand(op: QuantizedOperand, *, block: int = 32) -> torch.Tensor:
    """An MXFP8 operand (E8M0 ``scale_t``) as a bfloat16 (rows, K) tensor, element for element
    ``data * 2**(byte - 127)`` (exact but for the rounding noted in [Note: block-scaled GEMM])."""
    rows, K = op.data.shape
    out = torch.empty(rows, K, dtype=torch.bfloat16, device=op.data.device)
    tile_r, tile_k = 32, 256
    _mx_dequant_kernel[(triton.cdiv(rows, tile_r), triton.cdiv(K, tile_k))](
        op.data, op.scale_t, out, rows, K, BLOCK=block, TILE_R=tile_r, TILE_K=tile_k, num_warps=4
    )
    return out


def _check_tma(t: torch.Tensor) -> None:
    """TMA needs 16-byte aligned bases and row strides: check here, with the fix, rather than
    fail inside the driver."""
    row_bytes = t.stride(0) * t.element_size()
    if t.data_ptr() % 16 or row_bytes % 16 or t.stride(-1) != 1:
        raise ValueError(
            f"TMA operand of shape {tuple(t.shape)} and dtype {t.dtype} needs a 16-byte aligned "
            f"address (got {t.data_ptr():#x}) and 16-byte multiple row strides (got {row_bytes} B); "
            "pad the trailing dim or allocate it with torch"
        )


def _descriptor(t: torch.Tensor, block_shape: list[int]) -> TensorDescriptor:
    _check_tma(t)
    return TensorDescriptor.from_tensor(t, block_shape)


# Configs measured on H200 at 8192^3 (benchmarks/results/mx_kernels_2026-11-30.md)
_FP8_TILE = dict(BLOCK_M=64, BLOCK_N=128, GROUP_M=16, STAGES=3, num_warps=4)
_BF16_TILE = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, STAGES=4, num_warps=4)


def _use_gluon(impl: str, t: torch.Tensor, *, shape_fits: bool, shape_rule: str) -> bool:
    """Whether a call runs its Gluon kernel: ``impl`` is ``auto`` (where it runs: Gluon
    imported, an sm_90 GPU, ``shape_fits``), ``gluon`` (there, else ``ValueError``) or ``triton``."""
    if impl not in ("auto", "gluon", "triton"):
        raise ValueError(f"impl must be 'auto', 'gluon' or 'triton', got {impl!r}")
    if impl == "triton":
        return False
    fits = _gluon is not None and shape_fits and _is_sm90(_device_index(t))
    if impl == "gluon" and not fits:
        raise ValueError(
            f"the Gluon kernel needs Triton's Gluon Hopper module (imported: {_gluon is not None}), "
            f"an sm_90 GPU and {shape_rule}; use impl='triton'"
        )
    return fits


def scaled_gemm(
    a: QuantizedOperand,
    b: QuantizedOperand,
    out: torch.Tensor,
    *,
    block: int = 32,
    mx: bool = True,
    accumulate: bool = False,
    bias: torch.Tensor | None = None,
    impl: str = "auto",
) -> torch.Tensor:
    """``out (+)= A @ B.T (+ bias)`` for quantised A (M, K), B (N, K); see [Note: block-scaled GEMM].

    ``out`` is (M, N), contiguous, float32 or bfloat16, 16-byte aligned with 16-byte rows (e.g.
    a main_grad view of an aligndp buffer); with ``accumulate`` it is read and added to in
    place, else overwritten. ``bias`` (at most N values, any float dtype, the rest read as 0)
    is added to every row in float32 before the store, as ``nn.Linear``'s GEMM epilogue does.
    ``impl`` picks the 1x128 kernel: ``auto`` (Gluon where it runs), ``gluon`` or ``triton``.
    """
    (M, K), (N, K_b) = a.data.shape, b.data.shape
    if K != K_b or K % block:
        raise ValueError(
            f"GEMM operands contract over {K} and {K_b}; both must be equal multiples of {block}"
        )
    if tuple(out.shape) != (M, N) or not out.is_contiguous():
        raise ValueError(
            f"out must be a contiguous ({M}, {N}) tensor, got {tuple(out.shape)} strides {out.stride()}"
        )
    if bias is not None and (
        bias.ndim != 1 or bias.shape[0] > N or not bias.is_contiguous() or bias.device != out.device
    ):
        raise ValueError(
            f"bias must be a contiguous 1-D tensor of at most {N} values on {out.device}, got shape "
            f"{tuple(bias.shape)} on {bias.device}"
        )
    bias_ptr, n_bias = (bias, bias.shape[0]) if bias is not None else (out, 0)
    if mx:
        a16, b16 = dequantize_operand(a, block=block), dequantize_operand(b, block=block)
        cfg = dict(_BF16_TILE)
        bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
        _bf16_gemm_kernel[(triton.cdiv(M, bm) * triton.cdiv(N, bn),)](
            _descriptor(a16, [bm, bk]),
            _descriptor(b16, [bn, bk]),
            _descriptor(out, [bm, bn]),
            bias_ptr,
            n_bias,
            M,
            N,
            K,
            ACCUMULATE=accumulate,
            HAS_BIAS=bias is not None,
            num_stages=cfg["STAGES"],
            **cfg,
        )
        return out
    if block != 128:
        raise ValueError(f"the float32-scaled fp8 recipe runs 1x128 blocks, got block={block}")
    if _use_gluon(
        impl,
        out,
        shape_fits=_gluon is not None and M % _gluon.TILE == 0 and N % _gluon.TILE == 0,
        shape_rule=f"M, N multiples of 128 (got {M}, {N})",
    ):
        for t in (a.data, a.scale_t, b.data, b.scale_t, out):
            _check_tma(t)
        return _gluon.fp8_block_gemm(
            a.data, a.scale_t, b.data, b.scale_t, out, accumulate=accumulate, bias=bias
        )
    cfg = dict(_FP8_TILE)
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    _fp8_block_gemm_kernel[(triton.cdiv(M, bm) * triton.cdiv(N, bn),)](
        _descriptor(a.data, [bm, block]),
        _descriptor(a.scale_t, [1, bm]),
        _descriptor(b.data, [bn, block]),
        _descriptor(b.scale_t, [1, bn]),
        _descriptor(out, [bm, bn]),
        bias_ptr,
        n_bias,
        M,
        N,
        K,
        ACCUMULATE=accumulate,
        HAS_BIAS=bias is not None,
        SCALE_BLOCK=block,
        num_stages=cfg["STAGES"],
        **cfg,
    )
    return out
