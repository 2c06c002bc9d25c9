"""Gluon (Triton's explicit-layout dialect) kernel for Hopper: the one-pass row+column
quantise. Imported only through :mod:`aligndp.lowp.gluon_kernels`, and only when
``triton.experimental.gluon`` with its Hopper module imports (Triton 3.6); otherwise the
plain-Triton kernel of :mod:`aligndp.lowp.triton_quantize` runs instead.

[Note: quantise layout]
Quantising along both dims from one read is a transpose problem: plain Triton's layouts put
a block's 32 elements across warps one way or the other, so its kernel round-trips shared
memory and stores bytes (a quarter of a copy's bandwidth; figures in
benchmarks/results/mx_kernels_history.md). Here the tile is a 4-D tensor
(TILE_M / B, B, TILE_N / B, B) in an explicit linear layout where each thread owns an 8 x 8
patch and the rest of a block, both ways, sits in neighbouring lanes of the same warp: both
block maxima are in-thread plus a few shuffles; loads are 16-byte vectors; the row-wise fp8
is stored in the load layout, and the column-wise (transposed) fp8 is the same patch with its
register order flipped (a register permutation, no shared memory), stored as 8-byte vectors
filling whole 32-byte sectors. The maximum propagates NaN, so one reduction finds NaN and inf
blocks (scale byte 255, as :mod:`aligndp.lowp.mx_format`); sm_90's ``cvt.rn.satfinite`` saturates
and keeps NaN, so no clamp is needed.

A 128 x 128 tile of 1x128 blocks holds 16 K elements, more than one warp can hold in registers, so
in any one layout the blocks of one of the two directions span warps. Reducing across warps (shared
memory and barriers for each maximum) made the column half the slower one. Instead the tile is
quantised row-wise in its load layout, where a row block sits in one warp, then moved once, through
shared memory, into a second layout where a column block sits in one warp (:data:`_COLUMN_LAYOUTS`),
faster both ways (docs/performance.md). The grid is persistent, two 4-warp programs per SM, each
loading its next tile before quantising this one. Registers (246 per thread) are not what holds it
there: variants with 111-165 registers and twice the warps per SM, a shared-memory staged tile,
other tile orders and cheaper divisions all land on the same time
(benchmarks/results/quantise_1x128_2026-11-30.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from aligndp.lowp.gluon_gemm import _sm_count
from aligndp.lowp.recipe import ScaleFormat
from aligndp.lowp.triton_launch import CheapLauncher

__all__ = ["quantize"]


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


# measured on H200 (benchmarks/results/mx_kernels_2026-11-30.md, quantise_1x128_2026-11-30.md):
# block 32, 32 x 256 tiles of 4 warps, 8 x 8 per thread, both ways in the load layout; block 128,
# 128 x 128 tiles of 4 warps, persistent, rows in a layout of 8 x 16 per thread (a row block in
# one warp), columns in one of 16 x 8 per thread (a column block in one warp)
_LAYOUTS = {
    32: dict(reg_m=3, lane_m=2, warp_m=0, reg_n=3, lane_n=3, warp_n=2),
    128: dict(reg_m=3, lane_m=2, warp_m=2, reg_n=3, lane_n=3, warp_n=0, rep_n=1),
}
_COLUMN_LAYOUTS = {128: dict(reg_m=4, lane_m=3, warp_m=0, reg_n=3, lane_n=2, warp_n=2)}
"""Where a column block would span warps in the load layout: the layout the tile is moved to
(one trip through shared memory) for the column-wise half, so its block maxima stay in one warp
and each thread stores 16 consecutive bytes of the transposed copy."""
_PERSISTENT = {32: 0, 128: 2}  # programs per SM; 0: one program per tile
_LAYOUT_CACHE: dict[int, tuple] = {}


def _layouts(block: int) -> tuple:
    """(load layout, column layout, column-store layout, TILE_M, TILE_N, num_warps)."""
    if block not in _LAYOUT_CACHE:
        L, LC, tile_m, tile_n, num_warps = _linear_layouts(block, **_LAYOUTS[block])
        LM = L
        if block in _COLUMN_LAYOUTS:
            LM, LC, *shape = _linear_layouts(block, **_COLUMN_LAYOUTS[block])
            assert shape == [tile_m, tile_n, num_warps], (block, shape)
        _LAYOUT_CACHE[block] = (L, LM, LC, tile_m, tile_n, num_warps)
    return _LAYOUT_CACHE[block]


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
        safe = gl.where(amax > 0, gl.maximum(amax, 1e-30), FP8_MAX)  # as the Triton kernel
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
    LM: gl.constexpr,
    LC: gl.constexpr,
):
    A: gl.constexpr = TILE_M // BLOCK
    C: gl.constexpr = TILE_N // BLOCK
    xf = x.to(gl.float32)
    if ROWWISE:
        scale, inv = _block_scales(gl.abs(xf), 3, EMAX, FP8_MAX, MX)  # (A, BLOCK, C)
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
        xm = gl.convert_layout(xf, LM)  # 1x32: LM is L, nothing moves; 1x128: via shared memory
        scale, inv = _block_scales(gl.abs(xm), 1, EMAX, FP8_MAX, MX)  # (A, C, BLOCK)
        q = gl.convert_layout((xm * gl.expand_dims(inv, 1)).to(OUT), LC)  # a register permutation
        m = pid_m * TILE_M + _index(A, 0, 4, LC) * BLOCK + _index(BLOCK, 1, 4, LC)
        n = pid_n * TILE_N + _index(C, 2, 4, LC) * BLOCK + _index(BLOCK, 3, 4, LC)
        SC: gl.constexpr = gl.SliceLayout(1, LM)
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
    LM: gl.constexpr,
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
                LM,
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
            LM,
            LC,
        )


_quantize = CheapLauncher(_quantize_kernel)  # [Note: cheap launches] in triton_launch.py


def quantize(
    x: torch.Tensor,
    row,
    col,
    *,
    block: int,
    scale_format: ScaleFormat,
    out,
    emax: int,
    fp8_max: float,
) -> None:
    """Fill the preallocated ``row`` / ``col`` operands (either may be None) from ``x`` (M, N);
    the contract of :func:`aligndp.lowp.triton_kernels.quantize_rows_and_columns` (which checks
    shapes and allocates). ``block`` is 32 or 128."""
    L, LM, LC, tile_m, tile_n, num_warps = _layouts(block)
    M, N = x.shape
    spare = row or col  # pointers for the layout not written: never read, no allocation
    tiles = triton.cdiv(M, tile_m) * triton.cdiv(N, tile_n)
    persistent = _PERSISTENT[block]
    grid = (min(tiles, persistent * _sm_count(x.get_device())) if persistent else tiles,)
    _quantize[grid](  # in signature order: no binding of keywords per call
        x,
        (row or spare).data,
        (row or spare).scale_t,
        (col or spare).data,
        (col or spare).scale_t,
        M,
        N,
        block,  # BLOCK
        tile_m,  # TILE_M
        tile_n,  # TILE_N
        emax,  # EMAX
        fp8_max,  # FP8_MAX
        ScaleFormat(scale_format) is ScaleFormat.E8M0,  # MX
        out,  # OUT
        row is not None,  # ROWWISE
        col is not None,  # COLWISE
        M % tile_m == 0 and N % tile_n == 0,  # EVEN
        bool(persistent),  # PERSISTENT
        L,
        LM,
        LC,
        num_warps=num_warps,
    )
