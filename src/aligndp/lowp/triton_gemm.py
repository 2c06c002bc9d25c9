"""Triton kernels for Hopper: block-scaled GEMMs (MXFP8, 1x128 fp8) that accumulate in
place, on the operands of :mod:`aligndp.lowp.triton_quantize`. Where Triton's Gluon runs
(sm_90, Triton 3.6) the 1x128 GEMM runs the faster kernel of :mod:`aligndp.lowp.gluon_gemm`;
the plain-Triton kernel here is its fallback. GPU only.

[Note: block-scaled GEMM]
Hopper has no MX matrix instruction, and its fp8 wgmma accumulates in float32 only inside
one instruction, so a block-scaled fp8 GEMM must promote each K block's partial product into
a float32 accumulator on the CUDA cores: ``acc += dot(A[:, kb], B[:, kb]) * sa[kb, m] *
sb[kb, n]``. Two kernels, chosen by measurement on H200 (figures:
benchmarks/results/mx_kernels_history.md):

- 1x128 fp8 (``ScaleFormat.FP32``): exactly that, promoted once per 128-wide K block, C read
  and written once by TMA at the end. On Hopper with M, N multiples of 128 it runs the Gluon
  kernel of :mod:`aligndp.lowp.gluon_gemm`, which keeps one wgmma in flight while the CUDA
  cores promote ([Note: overlapped promotion]); elsewhere a plain-Triton kernel with every
  operand and scale tile brought in by TMA, software-pipelined, which waits for each block's
  wgmma before its promotion (the tensor cores idle then).
- MXFP8 (``ScaleFormat.E8M0``): promoting every 32 elements of K costs more CUDA-core work
  than the fp8 MMA saves. E4M3 times a power of two is exact in bfloat16, so one memory-bound
  pass dequantises each operand to bfloat16 (bit-exact, scale byte 0 read as 2**-127) and a
  pipelined bf16 wgmma GEMM accumulates in place in float32: the same products summed in
  float32 as an MX GEMM, faster, for a transient bf16 copy of both operands (2 bytes per
  element). The one inexact case: in blocks with amax < 2**-116 (scale bytes 0-2) the
  dequantised values round to bfloat16 subnormals (multiples of 2**-133), a deviation of at
  most 2**-134 per element.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from aligndp.lowp.recipe import ScaleFormat
from aligndp.lowp.triton_common import QuantizedOperand, _gluon, _use_gluon
from aligndp.lowp.triton_launch import CheapLauncher

__all__ = ["dequantize_operand", "scaled_gemm"]


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


_fp8_block_gemm = CheapLauncher(_fp8_block_gemm_kernel)
_bf16_gemm = CheapLauncher(_bf16_gemm_kernel)
_mx_dequant = CheapLauncher(_mx_dequant_kernel)


def dequantize_operand(op: QuantizedOperand, *, block: int = 32) -> torch.Tensor:
    """An MXFP8 operand (E8M0 ``scale_t``) as a bfloat16 (rows, K) tensor, element for element
    ``data * 2**(byte - 127)`` (exact but for the rounding noted in [Note: block-scaled GEMM])."""
    rows, K = op.data.shape
    out = torch.empty(rows, K, dtype=torch.bfloat16, device=op.data.device)
    tile_r, tile_k = 32, 256
    _mx_dequant[(triton.cdiv(rows, tile_r), triton.cdiv(K, tile_k))](
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
            f"address (got {t.data_ptr():#x}) and 16-byte multiple row strides "
            f"(got {row_bytes} B); pad the trailing dim or allocate it with torch"
        )


def _descriptor(t: torch.Tensor, block_shape: list[int]) -> TensorDescriptor:
    _check_tma(t)
    return TensorDescriptor.from_tensor(t, block_shape)


# Configs measured on H200 at 8192^3 (benchmarks/results/mx_kernels_2026-11-30.md; the bf16
# tile's 5 stages: quantise_1x128_2026-11-30.md)
_FP8_TILE = dict(BLOCK_M=64, BLOCK_N=128, GROUP_M=16, STAGES=3, num_warps=4)
_BF16_TILE = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, STAGES=5, num_warps=4)


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
    """``out (+)= A @ B.T (+ bias)`` for quantised A (M, K), B (N, K); see
    [Note: block-scaled GEMM].

    ``out`` is (M, N), contiguous, float32 or bfloat16, 16-byte aligned with 16-byte rows (e.g.
    a main_grad view of an aligndp buffer); with ``accumulate`` it is read and added to in
    place, else overwritten. ``bias`` (at most N values, any float dtype, the rest read as 0)
    is added to every row in float32 before the store, as ``nn.Linear``'s GEMM epilogue does.
    ``scale_format`` is the operands' (``E8M0``: MXFP8, ``FP32``: 1x128 fp8). ``impl`` picks
    the 1x128 kernel: ``auto`` (Gluon where it runs), ``gluon`` or ``triton``.
    """
    (M, K), (N, K_b) = a.data.shape, b.data.shape
    if K != K_b or K % block:
        raise ValueError(
            f"GEMM operands contract over {K} and {K_b}; both must be equal multiples of {block}"
        )
    if tuple(out.shape) != (M, N) or not out.is_contiguous():
        raise ValueError(
            f"out must be a contiguous ({M}, {N}) tensor, got {tuple(out.shape)} "
            f"strides {out.stride()}"
        )
    if bias is not None and (
        bias.ndim != 1 or bias.shape[0] > N or not bias.is_contiguous() or bias.device != out.device
    ):
        raise ValueError(
            f"bias must be a contiguous 1-D tensor of at most {N} values on {out.device}, "
            f"got shape {tuple(bias.shape)} on {bias.device}"
        )
    bias_ptr, n_bias = (bias, bias.shape[0]) if bias is not None else (out, 0)
    if ScaleFormat(scale_format) is ScaleFormat.E8M0:
        a16, b16 = dequantize_operand(a, block=block), dequantize_operand(b, block=block)
        cfg = dict(_BF16_TILE)
        bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
        _bf16_gemm[(triton.cdiv(M, bm) * triton.cdiv(N, bn),)](
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
        for t in (a.data, a.scale_t, b.data, b.scale_t):  # the kernel's descriptors assume it
            if t.data_ptr() % 16 or not t.is_contiguous():
                _check_tma(t)
                raise ValueError(
                    f"the GEMM's operands must be contiguous, got shape {tuple(t.shape)} with "
                    f"strides {t.stride()}; pass QuantizedOperand tensors as the quantise made them"
                )
        if out.data_ptr() % 16:
            _check_tma(out)
        return _gluon.fp8_block_gemm(
            a.data, a.scale_t, b.data, b.scale_t, out, accumulate=accumulate, bias=bias
        )
    cfg = dict(_FP8_TILE)
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    _fp8_block_gemm[(triton.cdiv(M, bm) * triton.cdiv(N, bn),)](
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
