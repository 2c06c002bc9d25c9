"""Gluon (Triton's explicit-layout dialect) kernel for Hopper: the 1x128 block-scaled FP8
GEMM that accumulates in place. Imported only through :mod:`aligndp.lowp.gluon_kernels`, and
only when ``triton.experimental.gluon`` with its Hopper module imports (Triton 3.6); otherwise
the plain-Triton kernel of :mod:`aligndp.lowp.triton_gemm` runs instead.

[Note: overlapped promotion]
``C (+)= sum_kb sa[kb, m] * sb[kb, n] * (A[:, kb] @ B[:, kb].T)`` needs each 128-wide K
block's fp8 wgmma result scaled and added into a float32 accumulator on the CUDA cores.
Plain Triton waits for every wgmma before that promotion, so the tensor cores idle through it.
Here each K block's wgmma is issued (async, into a fresh partial) *before* the previous
block's partial is promoted, with ``warpgroup_mma_wait(num_outstanding=1)``, so one wgmma is
always in flight during the promotion (DeepGEMM's schedule). Roles (``gl.warp_specialize``):
one producer warp runs a STAGES-deep TMA ring (A, B and both scale rows per stage, one
``ready`` mbarrier each, released through an ``empty`` mbarrier); two consumer warpgroups
(one 8-warp partition) compute a 128x128 tile, 64 rows each. The grid is persistent (one CTA
per SM looping over tiles in grouped order), so the producer fills the next tile's stages
during the epilogue. The K loop is unrolled by two so the two in-flight partials keep fixed
registers: a loop-carried copy of an in-flight wgmma accumulator makes ptxas serialise every
wgmma (its info C7514). Old C is TMA-loaded when a tile starts and added at its end. The
consumers release a stage after reading its scales with no proxy fence, as CUTLASS's and
DeepGEMM's pipelines do (the mbarrier orders the reads before the producer's next TMA write).
Measured throughput, what bounds it (power, then consumer registers) and the variants tried:
benchmarks/results/mx_kernels_history.md.
"""

from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from aligndp.lowp.triton_launch import CheapLauncher, ensure_scratch_allocator

__all__ = ["SCALE_BLOCK", "TILE", "fp8_block_gemm"]

SCALE_BLOCK = 128
TILE = 128
"""M and N must be multiples of this (the fp8 backend pads to 128 anyway)."""


@gluon.jit
def _tile_coords(t, num_m, num_n, GROUP_M: gl.constexpr):
    per_group = GROUP_M * num_n
    first_m = (t // per_group) * GROUP_M
    rows = gl.minimum(num_m - first_m, GROUP_M)
    return first_m + (t % per_group) % rows, (t % per_group) // rows


@gluon.jit
def _scale_row(bufs, s, L: gl.constexpr):
    """One stage's [1, L] scale box viewed as a plain 1-D shared array."""
    return bufs.index(s)._reinterpret(gl.float32, [L], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))


@gluon.jit
def _issue(a_bufs, b_bufs, ready, g, zero, STAGES: gl.constexpr):
    """Wait for K block ``g`` (a running count over all tiles) and issue its wgmma, async."""
    s = g % STAGES
    mbarrier.wait(ready.index(s), (g // STAGES) & 1)
    return warpgroup_mma(
        a_bufs.index(s), b_bufs.index(s).permute((1, 0)), zero, use_acc=False, is_async=True
    )


@gluon.jit
def _promote(
    acc,
    p,
    sa_bufs,
    sb_bufs,
    empty,
    g,
    row_l: gl.constexpr,
    col_l: gl.constexpr,
    STAGES: gl.constexpr,
    PROMOTE: gl.constexpr,
):
    """acc += p * sa[:, None] * sb[None, :] with block ``g``'s scales, then release its stage.
    With PROMOTE False (a measurement aid, see :func:`fp8_block_gemm`) acc += p, scales unread."""
    BLOCK_M: gl.constexpr = sa_bufs.type.shape[2]
    BLOCK_N: gl.constexpr = sb_bufs.type.shape[2]
    s = g % STAGES
    if not PROMOTE:
        mbarrier.arrive(empty.index(s), count=1)
        return acc + p
    sa = _scale_row(sa_bufs, s, BLOCK_M).load(row_l)
    sb = _scale_row(sb_bufs, s, BLOCK_N).load(col_l)
    mbarrier.arrive(empty.index(s), count=1)
    return acc + (p * gl.expand_dims(sa, 1)) * gl.expand_dims(sb, 0)


@gluon.jit
def _producer(
    a_desc,
    sa_desc,
    b_desc,
    sb_desc,
    a_bufs,
    b_bufs,
    sa_bufs,
    sb_bufs,
    ready,
    empty,
    M,
    N,
    K,
    GROUP_M: gl.constexpr,
    STAGES: gl.constexpr,
):
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    NBYTES: gl.constexpr = (
        a_desc.block_type.nbytes
        + b_desc.block_type.nbytes
        + sa_desc.block_type.nbytes
        + sb_desc.block_type.nbytes
    )
    num_m = M // BLOCK_M
    num_n = N // BLOCK_N
    it = 0
    for t in range(gl.program_id(0), num_m * num_n, gl.num_programs(0)):
        pid_m, pid_n = _tile_coords(t, num_m, num_n, GROUP_M)
        for kb in range(K // BK):
            s = it % STAGES
            mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
            bar = ready.index(s)
            mbarrier.expect(bar, NBYTES)
            tma.async_copy_global_to_shared(
                a_desc, [pid_m * BLOCK_M, kb * BK], bar, a_bufs.index(s)
            )
            tma.async_copy_global_to_shared(
                b_desc, [pid_n * BLOCK_N, kb * BK], bar, b_bufs.index(s)
            )
            tma.async_copy_global_to_shared(sa_desc, [kb, pid_m * BLOCK_M], bar, sa_bufs.index(s))
            tma.async_copy_global_to_shared(sb_desc, [kb, pid_n * BLOCK_N], bar, sb_bufs.index(s))
            it += 1


@gluon.jit
def _consumer(
    c_desc,
    a_bufs,
    b_bufs,
    sa_bufs,
    sb_bufs,
    c_smem,
    ready,
    empty,
    c_bar,
    bias_ptr,
    n_bias,
    M,
    N,
    K,
    ACCUMULATE: gl.constexpr,
    GROUP_M: gl.constexpr,
    STAGES: gl.constexpr,
    PROMOTE: gl.constexpr,
    HAS_BIAS: gl.constexpr,
):
    BLOCK_M: gl.constexpr = a_bufs.type.shape[1]
    BLOCK_N: gl.constexpr = b_bufs.type.shape[1]
    BK: gl.constexpr = a_bufs.type.shape[2]
    mma: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[BLOCK_M // 16, 1], instr_shape=[16, BLOCK_N, 32]
    )
    row_l: gl.constexpr = gl.SliceLayout(1, mma)
    col_l: gl.constexpr = gl.SliceLayout(0, mma)
    num_m = M // BLOCK_M
    num_n = N // BLOCK_N
    KB = K // BK
    zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma)
    it = 0
    tile_i = 0
    for t in range(gl.program_id(0), num_m * num_n, gl.num_programs(0)):
        pid_m, pid_n = _tile_coords(t, num_m, num_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        if ACCUMULATE:  # old C is needed only at the end: ask for it now
            tma.store_wait(pendings=0)  # the previous tile's store has read c_smem
            mbarrier.expect(c_bar, c_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(c_desc, [off_m, off_n], c_bar, c_smem)
        # invariant at the loop top: pa holds K block `it + 2j` in flight
        acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma)
        pa = _issue(a_bufs, b_bufs, ready, it, zero, STAGES)
        for j in range((KB - 1) // 2):
            g = it + 2 * j
            pb = _issue(a_bufs, b_bufs, ready, g + 1, zero, STAGES)
            p = warpgroup_mma_wait(num_outstanding=1, deps=(pa,))
            acc = _promote(acc, p, sa_bufs, sb_bufs, empty, g, row_l, col_l, STAGES, PROMOTE)
            pa = _issue(a_bufs, b_bufs, ready, g + 2, zero, STAGES)
            p = warpgroup_mma_wait(num_outstanding=1, deps=(pb,))
            acc = _promote(acc, p, sa_bufs, sb_bufs, empty, g + 1, row_l, col_l, STAGES, PROMOTE)
        g = it + KB - 1
        if KB % 2 == 0:  # pa = block KB - 2 in flight; block KB - 1 not issued yet
            pb = _issue(a_bufs, b_bufs, ready, g, zero, STAGES)
            p = warpgroup_mma_wait(num_outstanding=1, deps=(pa,))
            acc = _promote(acc, p, sa_bufs, sb_bufs, empty, g - 1, row_l, col_l, STAGES, PROMOTE)
            p = warpgroup_mma_wait(num_outstanding=0, deps=(pb,))
            acc = _promote(acc, p, sa_bufs, sb_bufs, empty, g, row_l, col_l, STAGES, PROMOTE)
        else:  # pa = block KB - 1 in flight
            p = warpgroup_mma_wait(num_outstanding=0, deps=(pa,))
            acc = _promote(acc, p, sa_bufs, sb_bufs, empty, g, row_l, col_l, STAGES, PROMOTE)
        it += KB
        if ACCUMULATE:
            mbarrier.wait(c_bar, tile_i & 1)
            acc = acc + c_smem.load(mma).to(gl.float32)
        else:
            tma.store_wait(pendings=0)  # the previous tile's store has read c_smem
        if HAS_BIAS:
            cols = off_n + gl.arange(0, BLOCK_N, layout=col_l)
            acc = acc + gl.expand_dims(
                gl.load(bias_ptr + cols, mask=cols < n_bias, other=0.0).to(gl.float32), 0
            )
        c_smem.store(acc.to(c_desc.dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(c_desc, [off_m, off_n], c_smem)
        tile_i += 1
    tma.store_wait(pendings=0)


@gluon.jit
def _fp8_block_gemm_kernel(
    a_ptr,
    sa_ptr,
    b_ptr,
    sb_ptr,
    c_ptr,
    bias_ptr,
    n_bias,
    M,
    N,
    K,
    ACCUMULATE: gl.constexpr,
    GROUP_M: gl.constexpr,
    STAGES: gl.constexpr,
    PRODUCER_REGS: gl.constexpr,
    PROMOTE: gl.constexpr,
    HAS_BIAS: gl.constexpr,
    OP_LAYOUT: gl.constexpr,
    SCALE_LAYOUT: gl.constexpr,
    C_LAYOUT: gl.constexpr,
):
    # [Note: descriptors on the device] in triton_launch.py
    T: gl.constexpr = 128  # TILE and SCALE_BLOCK
    a_desc = tma.make_tensor_descriptor(a_ptr, [M, K], [K, 1], [T, T], OP_LAYOUT)
    sa_desc = tma.make_tensor_descriptor(sa_ptr, [K // T, M], [M, 1], [1, T], SCALE_LAYOUT)
    b_desc = tma.make_tensor_descriptor(b_ptr, [N, K], [K, 1], [T, T], OP_LAYOUT)
    sb_desc = tma.make_tensor_descriptor(sb_ptr, [K // T, N], [N, 1], [1, T], SCALE_LAYOUT)
    c_desc = tma.make_tensor_descriptor(c_ptr, [M, N], [N, 1], [T, T], C_LAYOUT)
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BLOCK_M, BK], a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BLOCK_N, BK], b_desc.layout)
    sa_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, 1, BLOCK_M], sa_desc.layout)
    sb_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, 1, BLOCK_N], sb_desc.layout)
    c_smem = gl.allocate_shared_memory(c_desc.dtype, [BLOCK_M, BLOCK_N], c_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    c_bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    mbarrier.init(c_bar.index(0), count=1)
    gl.warp_specialize(
        [
            (
                _consumer,
                (
                    c_desc,
                    a_bufs,
                    b_bufs,
                    sa_bufs,
                    sb_bufs,
                    c_smem,
                    ready,
                    empty,
                    c_bar.index(0),
                    bias_ptr,
                    n_bias,
                    M,
                    N,
                    K,
                    ACCUMULATE,
                    GROUP_M,
                    STAGES,
                    PROMOTE,
                    HAS_BIAS,
                ),
            ),
            (
                _producer,
                (
                    a_desc,
                    sa_desc,
                    b_desc,
                    sb_desc,
                    a_bufs,
                    b_bufs,
                    sa_bufs,
                    sb_bufs,
                    ready,
                    empty,
                    M,
                    N,
                    K,
                    GROUP_M,
                    STAGES,
                ),
            ),
        ],
        [1],
        [PRODUCER_REGS],
    )


# GluonJITFunction subclasses JITFunction (only its AST source differs): the same launch path
_gemm = CheapLauncher(_fp8_block_gemm_kernel)

_GL_DTYPE = {torch.float32: gl.float32, torch.bfloat16: gl.bfloat16}


@functools.cache
def _gemm_layouts(out_dtype: torch.dtype):
    """The shared-memory layouts of the fp8 operand, scale and C tiles, built once per dtype."""
    return (
        gl.NVMMASharedLayout.get_default_for([TILE, SCALE_BLOCK], gl.float8e4nv),
        gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2),
        gl.NVMMASharedLayout.get_default_for([TILE, TILE], _GL_DTYPE[out_dtype]),
    )


@functools.cache
def _sm_count(device_index: int) -> int:
    """Multiprocessors of the GPU: the persistent grids' size."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def fp8_block_gemm(
    a: torch.Tensor,
    sa: torch.Tensor,
    b: torch.Tensor,
    sb: torch.Tensor,
    out: torch.Tensor,
    *,
    accumulate: bool,
    bias: torch.Tensor | None = None,
    group_m: int = 8,
    stages: int = 4,
    promote: bool = True,
) -> torch.Tensor:
    """``out (+)= (A * sa) @ (B * sb).T (+ bias)`` per 128-wide K block; see
    [Note: overlapped promotion].

    ``a`` (M, K), ``b`` (N, K) float8_e4m3fn; ``sa`` (K / 128, M), ``sb`` (K / 128, N) float32;
    ``out`` (M, N) float32 or bfloat16; all contiguous and 16-byte aligned (the caller,
    :func:`aligndp.lowp.triton_kernels.scaled_gemm`, checks), M and N multiples of :data:`TILE`;
    ``bias``: at most N values added to every row in the epilogue (missing ones read as 0).
    ``promote=False`` is a measurement aid, not a GEMM of the scaled operands: the same
    pipeline adds each K block's partial unscaled (``out (+)= A @ B.T``), so
    ``benchmarks/fp8_power.py`` can show what the per-block promotion costs.
    """
    (M, K), N = a.shape, b.shape[0]
    ensure_scratch_allocator()
    grid = (min((M // TILE) * (N // TILE), _sm_count(out.get_device())),)
    # 8 consumer warps + 1 producer warp; the producer gives its registers to the consumers
    bias_ptr, n_bias = (bias, bias.shape[0]) if bias is not None else (out, 0)
    _gemm[grid](
        a,
        sa,
        b,
        sb,
        out,
        bias_ptr,
        n_bias,
        M,
        N,
        K,
        accumulate,
        group_m,
        stages,
        40,
        promote,
        bias is not None,
        *_gemm_layouts(out.dtype),
        num_warps=8,
        maxnreg=168,
    )
    return out
