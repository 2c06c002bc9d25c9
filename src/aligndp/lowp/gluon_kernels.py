"""Gluon (Triton's explicit-layout dialect) kernels for Hopper: the one-pass row+column
quantise and the 1x128 block-scaled FP8 GEMM that accumulates in place. Imported only by
:mod:`aligndp.lowp.triton_kernels`, and only when ``triton.experimental.gluon`` with its Hopper
module imports (Triton 3.6); otherwise the plain-Triton kernels there run instead.

[Note: quantise layout]
Quantising along both dims from one read is a transpose problem: plain Triton's layouts put
a block's 32 elements across warps one way or the other, so its kernel round-trips shared
memory and stores bytes (1.05 TB/s, a quarter of a copy). Here the tile is a 4-D tensor
(TILE_M / B, B, TILE_N / B, B) in an explicit linear layout where each thread owns an 8 x 8
patch and the rest of a block, both ways, sits in neighbouring lanes of the same warp: both
block maxima are in-thread plus a few shuffles; loads are 16-byte vectors; the row-wise fp8
is stored in the load layout, and the column-wise (transposed) fp8 is the same patch with its
register order flipped (a register permutation, no shared memory), stored as 8-byte vectors
filling whole 32-byte sectors. The maximum propagates NaN, so one reduction finds NaN and inf
blocks (scale byte 255, as :mod:`aligndp.lowp.mx_format`); sm_90's ``cvt.rn.satfinite`` saturates
and keeps NaN, so no clamp is needed. 1x128 fp8 blocks span warps (the reduction then goes
through shared memory) and run a persistent grid that loads its next tile first.

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
Measured on H200 (benchmarks/results/mx_kernels_2026-11-30.md): 790-840 TFLOP/s at 8192^3.
What bounds it is power, not the pipeline: at 8192^3 every fp8 GEMM tried, ours and cuBLAS's,
runs at the 700 W cap, and this same kernel with the promotion left out (``promote=False``,
acc += p) reaches 1030-1070 TFLOP/s, so the promotion's FP32 multiply-adds and scale loads
cost about a quarter of the energy budget; cuBLAS's own 1x128 GEMM + ``add_`` reaches 770-810
(benchmarks/fp8_power.py; results/fp8_power_and_mx_training_2026-11-30.md). Consumer
registers are the other wall (192 of ~232 hold the accumulator and the two partials): variants
that keep more live spill and ran slower (scales loaded before the wgmma wait: 616-642; two K
blocks per stage: 676-690), and a K loop unrolled by 4 for static stage indices spilled 1 KB
and serialised its wgmmas at compile time.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

__all__ = ["TILE", "fp8_block_gemm", "quantize"]

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
    ACCUMULATE: gl.constexpr,
    GROUP_M: gl.constexpr,
    STAGES: gl.constexpr,
    PRODUCER_REGS: gl.constexpr,
    PROMOTE: gl.constexpr,
    HAS_BIAS: gl.constexpr,
):
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


_GL_DTYPE = {torch.float32: gl.float32, torch.bfloat16: gl.bfloat16}


@functools.cache
def _gemm_layouts(out_dtype: torch.dtype):
    """Shared-memory layouts of the GEMM's fp8 operand, scale and C tiles: built once, since
    constructing them is a good part of a small call's launch time."""
    return (
        gl.NVMMASharedLayout.get_default_for([TILE, SCALE_BLOCK], gl.float8e4nv),
        gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2),
        gl.NVMMASharedLayout.get_default_for([TILE, TILE], _GL_DTYPE[out_dtype]),
    )


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _sm_count(t: torch.Tensor) -> int:
    """Multiprocessors of ``t``'s GPU: the persistent grids' size."""
    return _num_sms(t.device.index if t.device.index is not None else torch.cuda.current_device())


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
    """``out (+)= (A * sa) @ (B * sb).T (+ bias)`` per 128-wide K block; see [Note: overlapped promotion].

    ``a`` (M, K), ``b`` (N, K) float8_e4m3fn; ``sa`` (K / 128, M), ``sb`` (K / 128, N) float32;
    ``out`` (M, N) float32 or bfloat16; all contiguous and 16-byte aligned (the caller,
    :func:`aligndp.lowp.triton_kernels.scaled_gemm`, checks), M and N multiples of :data:`TILE`;
    ``bias``: at most N values added to every row in the epilogue (missing ones read as 0).
    ``promote=False`` is a measurement aid, not a GEMM of the scaled operands: the same
    pipeline adds each K block's partial unscaled (``out (+)= A @ B.T``), so
    ``benchmarks/fp8_power.py`` can show what the per-block promotion costs.
    """
    (M, K), N = a.shape, b.shape[0]
    op_layout, s_layout, c_layout = _gemm_layouts(out.dtype)

    def desc(t, rows, cols, block, layout):
        return TensorDescriptor(t, [rows, cols], [cols, 1], block, layout)

    descs = (
        desc(a, M, K, [TILE, SCALE_BLOCK], op_layout),
        desc(sa, K // SCALE_BLOCK, M, [1, TILE], s_layout),
        desc(b, N, K, [TILE, SCALE_BLOCK], op_layout),
        desc(sb, K // SCALE_BLOCK, N, [1, TILE], s_layout),
        desc(out, M, N, [TILE, TILE], c_layout),
    )
    grid = (min((M // TILE) * (N // TILE), _sm_count(out)),)
    # 8 consumer warps + 1 producer warp; the producer gives its registers to the consumers
    bias_ptr, n_bias = (bias, bias.shape[0]) if bias is not None else (out, 0)
    _fp8_block_gemm_kernel[grid](
        *descs,
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
        num_warps=8,
        maxnreg=168,
    )
    return out


# ---------------------------------------------------------------------------------------------
# one-pass row + column quantise: [Note: quantise layout]


def _linear_layouts(
    block: int,
    reg_m: int,
    lane_m: int,
    warp_m: int,
    reg_n: int,
    lane_n: int,
    warp_n: int,
    rep_n: int = 0,
):
    """(load layout, column-store layout, TILE_M, TILE_N, num_warps) of the 4-D tile
    (TILE_M / block, block, TILE_N / block, block). The bits of a row index go, lowest first, to
    ``reg_m`` register, ``lane_m`` lane and ``warp_m`` warp bits; a column index's likewise,
    then ``rep_n`` more register bits. The column-store layout is the load layout with the row
    register bits first: the same registers, reordered."""
    assert lane_m + lane_n == 5
    log_b = block.bit_length() - 1

    def m_basis(k):
        return [0, 1 << k, 0, 0] if k < log_b else [1 << (k - log_b), 0, 0, 0]

    def n_basis(k):
        return [0, 0, 0, 1 << k] if k < log_b else [0, 0, 1 << (k - log_b), 0]

    m_bits, n_bits = iter(range(32)), iter(range(32))
    reg_ms = [m_basis(next(m_bits)) for _ in range(reg_m)]
    reg_ns = [n_basis(next(n_bits)) for _ in range(reg_n)]
    lanes = [n_basis(next(n_bits)) for _ in range(lane_n)] + [
        m_basis(next(m_bits)) for _ in range(lane_m)
    ]
    warps = [n_basis(next(n_bits)) for _ in range(warp_n)] + [
        m_basis(next(m_bits)) for _ in range(warp_m)
    ]
    rep_ns = [n_basis(next(n_bits)) for _ in range(rep_n)]
    tile_m, tile_n = 1 << (reg_m + lane_m + warp_m), 1 << (reg_n + lane_n + warp_n + rep_n)
    shape = [tile_m // block, block, tile_n // block, block]

    def layout(regs):
        return gl.DistributedLinearLayout(
            reg_bases=regs, lane_bases=lanes, warp_bases=warps, block_bases=[], shape=shape
        )

    return (
        layout(reg_ns + reg_ms + rep_ns),
        layout(reg_ms + reg_ns + rep_ns),
        tile_m,
        tile_n,
        1 << (warp_m + warp_n),
    )


# measured on H200 (benchmarks/results/mx_kernels_2026-11-30.md): block 32, 32 x 256 tiles of 4
# warps, 8 x 8 per thread; block 128, 128 x 128 tiles of 4 warps, 8 x 16 per thread, persistent
_LAYOUTS = {
    32: dict(reg_m=3, lane_m=2, warp_m=0, reg_n=3, lane_n=3, warp_n=2),
    128: dict(reg_m=3, lane_m=2, warp_m=2, reg_n=3, lane_n=3, warp_n=0, rep_n=1),
}
_PERSISTENT = {32: 0, 128: 2}  # programs per SM; 0: one program per tile
_LAYOUT_CACHE: dict[int, tuple] = {}


@gluon.jit
def _index(n: gl.constexpr, dim: gl.constexpr, rank: gl.constexpr, L: gl.constexpr):
    """arange(0, n) along ``dim`` of a rank-``rank`` tensor in layout L (size 1 elsewhere)."""
    if rank == 4:
        if dim == 0:
            r = gl.arange(0, n, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, L))))
            r = gl.expand_dims(gl.expand_dims(gl.expand_dims(r, 1), 2), 3)
        elif dim == 1:
            r = gl.arange(0, n, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, L))))
            r = gl.expand_dims(gl.expand_dims(gl.expand_dims(r, 0), 2), 3)
        elif dim == 2:
            r = gl.arange(0, n, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, L))))
            r = gl.expand_dims(gl.expand_dims(gl.expand_dims(r, 0), 1), 3)
        else:
            r = gl.arange(0, n, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, L))))
            r = gl.expand_dims(gl.expand_dims(gl.expand_dims(r, 0), 1), 2)
    else:
        if dim == 0:
            r = gl.arange(0, n, layout=gl.SliceLayout(1, gl.SliceLayout(2, L)))
            r = gl.expand_dims(gl.expand_dims(r, 1), 2)
        elif dim == 1:
            r = gl.arange(0, n, layout=gl.SliceLayout(0, gl.SliceLayout(2, L)))
            r = gl.expand_dims(gl.expand_dims(r, 0), 2)
        else:
            r = gl.arange(0, n, layout=gl.SliceLayout(0, gl.SliceLayout(1, L)))
            r = gl.expand_dims(gl.expand_dims(r, 0), 1)
    return r


@gluon.jit
def _max_nan(a, b):
    return gl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@gluon.jit
def _max_num(a, b):
    return gl.maximum(a, b)


@gluon.jit
def _block_scales(
    ax, axis: gl.constexpr, EMAX: gl.constexpr, FP8_MAX: gl.constexpr, MX: gl.constexpr
):
    """(stored scale, inverse scale) of the blocks of |x| along ``axis``; bit-exact with
    aligndp.lowp.mx_format.shared_exponent (MX) and with the plain-Triton kernel (fp8)."""
    if MX:
        amax = gl.reduce(ax, axis, _max_nan)  # NaN anywhere -> NaN -> exponent field 255, like inf
        field = (amax.to(gl.int32, bitcast=True) >> 23) & 0xFF
        biased = gl.where(field == 255, 255, gl.maximum(field - EMAX, 0))
        inv = gl.where(biased == 255, 0.0, ((254 - biased) << 23).to(gl.float32, bitcast=True))
        return biased.to(gl.uint8), inv
    else:
        amax = gl.reduce(ax, axis, _max_num)  # NaN ignored, as tl.max in the plain-Triton kernel
        safe = gl.where(amax > 0, amax, FP8_MAX)
        return gl.div_rn(safe, FP8_MAX), gl.div_rn(FP8_MAX, safe)


@gluon.jit
def _quantize_tile(
    x,
    row_ptr,
    row_scale_ptr,
    col_ptr,
    col_scale_ptr,
    M,
    N,
    pid_m,
    pid_n,
    BLOCK: gl.constexpr,
    TILE_M: gl.constexpr,
    TILE_N: gl.constexpr,
    EMAX: gl.constexpr,
    FP8_MAX: gl.constexpr,
    MX: gl.constexpr,
    OUT: gl.constexpr,
    ROWWISE: gl.constexpr,
    COLWISE: gl.constexpr,
    EVEN: gl.constexpr,
    L: gl.constexpr,
    LC: gl.constexpr,
):
    A: gl.constexpr = TILE_M // BLOCK
    C: gl.constexpr = TILE_N // BLOCK
    xf = x.to(gl.float32)
    ax = gl.abs(xf)
    if ROWWISE:
        scale, inv = _block_scales(ax, 3, EMAX, FP8_MAX, MX)  # (A, BLOCK, C)
        q = (xf * gl.expand_dims(inv, 3)).to(OUT)
        m = pid_m * TILE_M + _index(A, 0, 4, L) * BLOCK + _index(BLOCK, 1, 4, L)
        n = pid_n * TILE_N + _index(C, 2, 4, L) * BLOCK + _index(BLOCK, 3, 4, L)
        SR: gl.constexpr = gl.SliceLayout(3, L)
        sm = pid_m * TILE_M + _index(A, 0, 3, SR) * BLOCK + _index(BLOCK, 1, 3, SR)
        skb = pid_n * C + _index(C, 2, 3, SR)
        if EVEN:
            gl.store(row_ptr + m * N + n, q)
            gl.store(row_scale_ptr + skb * M + sm, scale)
        else:
            gl.store(row_ptr + m * N + n, q, mask=(m < M) & (n < N))
            gl.store(row_scale_ptr + skb * M + sm, scale, mask=(sm < M) & (skb < N // BLOCK))
    if COLWISE:
        scale, inv = _block_scales(ax, 1, EMAX, FP8_MAX, MX)  # (A, C, BLOCK)
        q = gl.convert_layout((xf * gl.expand_dims(inv, 1)).to(OUT), LC)  # a register permutation
        m = pid_m * TILE_M + _index(A, 0, 4, LC) * BLOCK + _index(BLOCK, 1, 4, LC)
        n = pid_n * TILE_N + _index(C, 2, 4, LC) * BLOCK + _index(BLOCK, 3, 4, LC)
        SC: gl.constexpr = gl.SliceLayout(1, L)
        skb = pid_m * A + _index(A, 0, 3, SC)
        sn = pid_n * TILE_N + _index(C, 1, 3, SC) * BLOCK + _index(BLOCK, 2, 3, SC)
        if EVEN:
            gl.store(col_ptr + n * M + m, q)
            gl.store(col_scale_ptr + skb * N + sn, scale)
        else:
            gl.store(col_ptr + n * M + m, q, mask=(m < M) & (n < N))
            gl.store(col_scale_ptr + skb * N + sn, scale, mask=(skb < M // BLOCK) & (sn < N))


@gluon.jit
def _load_tile(
    x_ptr,
    M,
    N,
    pid_m,
    pid_n,
    BLOCK: gl.constexpr,
    TILE_M: gl.constexpr,
    TILE_N: gl.constexpr,
    EVEN: gl.constexpr,
    L: gl.constexpr,
):
    m = pid_m * TILE_M + _index(TILE_M // BLOCK, 0, 4, L) * BLOCK + _index(BLOCK, 1, 4, L)
    n = pid_n * TILE_N + _index(TILE_N // BLOCK, 2, 4, L) * BLOCK + _index(BLOCK, 3, 4, L)
    if EVEN:
        return gl.load(x_ptr + m * N + n)
    return gl.load(x_ptr + m * N + n, mask=(m < M) & (n < N), other=0.0)


@gluon.jit
def _quantize_kernel(
    x_ptr,
    row_ptr,
    row_scale_ptr,
    col_ptr,
    col_scale_ptr,
    M,
    N,
    BLOCK: gl.constexpr,
    TILE_M: gl.constexpr,
    TILE_N: gl.constexpr,
    EMAX: gl.constexpr,
    FP8_MAX: gl.constexpr,
    MX: gl.constexpr,
    OUT: gl.constexpr,
    ROWWISE: gl.constexpr,
    COLWISE: gl.constexpr,
    EVEN: gl.constexpr,
    PERSISTENT: gl.constexpr,
    L: gl.constexpr,
    LC: gl.constexpr,
):
    num_n = gl.cdiv(N, TILE_N)
    t = gl.program_id(0)
    if PERSISTENT:  # loop over tiles, loading the next one before quantising this one
        num_tiles = gl.cdiv(M, TILE_M) * num_n
        x = _load_tile(x_ptr, M, N, t // num_n, t % num_n, BLOCK, TILE_M, TILE_N, EVEN, L)
        while t < num_tiles:
            nxt = gl.minimum(
                t + gl.num_programs(0), num_tiles - 1
            )  # the last prefetch re-reads a valid tile
            x_next = _load_tile(
                x_ptr, M, N, nxt // num_n, nxt % num_n, BLOCK, TILE_M, TILE_N, EVEN, L
            )
            _quantize_tile(
                x,
                row_ptr,
                row_scale_ptr,
                col_ptr,
                col_scale_ptr,
                M,
                N,
                t // num_n,
                t % num_n,
                BLOCK,
                TILE_M,
                TILE_N,
                EMAX,
                FP8_MAX,
                MX,
                OUT,
                ROWWISE,
                COLWISE,
                EVEN,
                L,
                LC,
            )
            x = x_next
            t = t + gl.num_programs(0)
    else:
        x = _load_tile(x_ptr, M, N, t // num_n, t % num_n, BLOCK, TILE_M, TILE_N, EVEN, L)
        _quantize_tile(
            x,
            row_ptr,
            row_scale_ptr,
            col_ptr,
            col_scale_ptr,
            M,
            N,
            t // num_n,
            t % num_n,
            BLOCK,
            TILE_M,
            TILE_N,
            EMAX,
            FP8_MAX,
            MX,
            OUT,
            ROWWISE,
            COLWISE,
            EVEN,
            L,
            LC,
        )


def quantize(
    x: torch.Tensor, row, col, *, block: int, mx: bool, out, emax: int, fp8_max: float
) -> None:
    """Fill the preallocated ``row`` / ``col`` operands (either may be None) from ``x`` (M, N);
    the contract of :func:`aligndp.lowp.triton_kernels.quantize_rows_and_columns` (which checks
    shapes and allocates). ``block`` is 32 or 128."""
    if block not in _LAYOUT_CACHE:
        _LAYOUT_CACHE[block] = _linear_layouts(block, **_LAYOUTS[block])
    L, LC, tile_m, tile_n, num_warps = _LAYOUT_CACHE[block]
    M, N = x.shape
    dummy = x.new_empty(0)
    tiles = triton.cdiv(M, tile_m) * triton.cdiv(N, tile_n)
    persistent = _PERSISTENT[block]
    if persistent:
        grid = (min(tiles, persistent * _sm_count(x)),)
    else:
        grid = (tiles,)
    _quantize_kernel[grid](
        x,
        row.data if row else dummy,
        row.scale_t if row else dummy,
        col.data if col else dummy,
        col.scale_t if col else dummy,
        M,
        N,
        BLOCK=block,
        TILE_M=tile_m,
        TILE_N=tile_n,
        EMAX=emax,
        FP8_MAX=fp8_max,
        MX=mx,
        OUT=out,
        ROWWISE=row is not None,
        COLWISE=col is not None,
        EVEN=M % tile_m == 0 and N % tile_n == 0,
        PERSISTENT=bool(persistent),
        L=L,
        LC=LC,
        num_warps=num_warps,
    )
