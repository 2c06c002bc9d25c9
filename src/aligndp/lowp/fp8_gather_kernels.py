"""Triton kernels of the ``fp8-tensor`` param all-gather codec (:mod:`aligndp.lowp.fp8_gather`):
GPU only, imported on a codec's first CUDA call.

[Note: one launch per bucket]
An FP8 param gather encodes every owned piece of a bucket before its all-gather, and decodes
every weight of it after. Done a weight at a time in torch ops that was seven launches, two
float32 temporaries and a transpose per weight, which made the 1b ZeRO-1 step at dp 1 on one
H200 markedly slower with FP8 gathers than without. Here each is one launch per bucket, and the
step costs about what it did with bf16 gathers: the encode and decode take about the time of
the layers' own weight quantise that the gather saves (docs/performance.md;
benchmarks/results/2026-12-02_fp8_param_gather_cost.md):

- :func:`encode` quantises every piece (``clamp(x / scale, ±448)`` to E4M3, the IEEE division
  of the CPU path) from its float32 master into the bucket's ``gather_data``;
- :func:`decode` writes every weight's decoded value (``data * scale`` in float32, rounded once
  to the param dtype) into ``param_data``, the transposed FP8 bytes its dgrad GEMM reads into a
  buffer kept per weight, and each scale into a slot of its own 256 bytes apart (cuBLASLt
  refuses a scale pointer 4 bytes into an array: see fp8_gather.py).

The tensors of a launch live anywhere, so the kernels read their addresses from a table (an
int64 address cast to a pointer, as Triton's grouped-GEMM example does) and each program looks
up its block or tile in a second table. Both tables are made once per set of addresses and
sizes and kept: a bucket's masters, buffers and scales never move, so every step after the
first finds its tables by one tuple of addresses. A table is a pure function of its key, so a
freed tensor whose address is reused by another of the same size is served correctly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from aligndp.lowp.triton_launch import CheapLauncher

__all__ = ["encode", "decode"]

ENCODE_BLOCK, ENCODE_WARPS = 2048, 8
"""Elements and warps per program of :func:`encode`: the fastest of eight pairs (2048-16384
elements, 4 or 8 warps) on H200 at 1b's four weight shapes
(benchmarks/results/2026-12-02_fp8_param_gather_cost.md)."""
DECODE_TILE = (16, 256, 4)
"""(rows, cols, warps) per program of :func:`decode`: the fastest of the fifteen tiles tried on
H200 at 1b's four weight shapes, faster than the 64x128 tile first used (same file)."""
SCALE_STRIDE = 64
"""float32 elements between two scales that :func:`decode` sets apart (256 bytes)."""
_MAX_TABLES = 4096
"""Tables kept before the cache starts afresh (a program whose tensors keep moving)."""


@triton.jit
def _encode_kernel(blocks_ptr, pieces_ptr, scales_ptr, src_like, dst_like, BLOCK: tl.constexpr):
    # blocks: (piece, first element) per program; pieces: (src, dst, numel, scale index)
    pid = tl.program_id(0)
    piece = tl.load(blocks_ptr + 2 * pid)
    start = tl.load(blocks_ptr + 2 * pid + 1)
    src = tl.load(pieces_ptr + 4 * piece).to(src_like.dtype)
    dst = tl.load(pieces_ptr + 4 * piece + 1).to(dst_like.dtype)
    n = tl.load(pieces_ptr + 4 * piece + 2)
    scale = tl.load(scales_ptr + tl.load(pieces_ptr + 4 * piece + 3))
    offs = start + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)
    y = tl.clamp(tl.div_rn(x, scale), -448.0, 448.0)
    tl.store(dst + offs, y.to(tl.float8e4nv), mask=mask)


@triton.jit
def _decode_kernel(
    tiles_ptr,
    weights_ptr,
    scales_ptr,
    scale_slots_ptr,
    data_like,
    out_like,
    BM: tl.constexpr,
    BN: tl.constexpr,
    STRIDE: tl.constexpr,
):
    # tiles: (weight, tile row, tile col) per program; weights: (data, out, data_t, rows, cols)
    pid = tl.program_id(0)
    w = tl.load(tiles_ptr + 3 * pid)
    tm = tl.load(tiles_ptr + 3 * pid + 1)
    tn = tl.load(tiles_ptr + 3 * pid + 2)
    data = tl.load(weights_ptr + 5 * w).to(data_like.dtype)
    out = tl.load(weights_ptr + 5 * w + 1).to(out_like.dtype)
    data_t = tl.load(weights_ptr + 5 * w + 2).to(data_like.dtype)
    m = tl.load(weights_ptr + 5 * w + 3)
    n = tl.load(weights_ptr + 5 * w + 4)
    scale = tl.load(scales_ptr + w)
    rm = tm * BM + tl.arange(0, BM)
    rn = tn * BN + tl.arange(0, BN)
    mask = (rm[:, None] < m) & (rn[None, :] < n)
    x = tl.load(data + rm[:, None] * n + rn[None, :], mask=mask, other=0.0)
    y = x.to(tl.float32) * scale
    tl.store(out + rm[:, None] * n + rn[None, :], y.to(out_like.dtype.element_ty), mask=mask)
    # transposed in registers, as bytes (reloading the tile with swapped strides, as the
    # quantise's cast kernel does, was slower here: docs/performance.md)
    mask_t = (rn[:, None] < n) & (rm[None, :] < m)
    dst_t = data_t.to(tl.pointer_type(tl.uint8), bitcast=True)
    tl.store(
        dst_t + rn[:, None] * m + rm[None, :], tl.trans(x.to(tl.uint8, bitcast=True)), mask=mask_t
    )
    if (tm == 0) & (tn == 0):
        tl.store(scale_slots_ptr + w * STRIDE, scale)


_encode = CheapLauncher(_encode_kernel)
_decode = CheapLauncher(_decode_kernel)
_tables: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _table(key: tuple, device: torch.device, make) -> tuple[torch.Tensor, torch.Tensor]:
    """The (programs, rows) int64 tables of ``key``, made by ``make()`` as two lists once."""
    found = _tables.get(key)
    if found is None:
        if len(_tables) >= _MAX_TABLES:
            _tables.clear()
        programs, rows = make()
        found = _tables[key] = tuple(
            torch.tensor(t, dtype=torch.int64).to(device, non_blocking=True)
            for t in (programs, rows)
        )
    return found


def encode(
    values: list[torch.Tensor], scales: torch.Tensor, index: list[int], outs: list[torch.Tensor]
) -> None:
    """``outs[j] = E4M3(clamp(values[j] / scales[index[j]], ±448))``: 1-D CUDA tensors,
    ``values`` float32, ``outs`` float8_e4m3fn of the same lengths, ``scales`` contiguous
    float32; one launch."""
    assert scales.is_contiguous() and all(v.dtype == torch.float32 for v in values), "internal"
    rows = [(v.data_ptr(), o.data_ptr(), v.numel(), k) for v, o, k in zip(values, outs, index)]
    key = ("encode", ENCODE_BLOCK, scales.device.index, *rows)

    def make():
        blocks = [
            (p, start) for p, (_, _, n, _) in enumerate(rows) for start in range(0, n, ENCODE_BLOCK)
        ]
        return [x for b in blocks for x in b], [x for r in rows for x in r]

    blocks, pieces = _table(key, scales.device, make)
    _encode[(blocks.numel() // 2,)](
        blocks, pieces, scales, values[0], outs[0], BLOCK=ENCODE_BLOCK, num_warps=ENCODE_WARPS
    )


def decode(
    datas: list[torch.Tensor],
    scales: torch.Tensor,
    outs: list[torch.Tensor],
    transposes: list[torch.Tensor],
    scale_slots: torch.Tensor,
) -> None:
    """For every weight ``i`` (2-D CUDA tensors): ``outs[i] = datas[i] * scales[i]`` (float32
    product, rounded once to ``outs``' dtype), ``transposes[i] = datas[i].T`` (contiguous) and
    ``scale_slots[i * SCALE_STRIDE] = scales[i]``; one launch."""
    assert scales.is_contiguous() and scale_slots.is_contiguous(), "internal"
    assert len({o.dtype for o in outs}) == 1, "internal: one param dtype per bucket"
    assert all(d.dim() == 2 for d in datas), "internal: the weights of Linear layers"
    bm, bn, warps = DECODE_TILE
    rows = [
        (d.data_ptr(), o.data_ptr(), t.data_ptr(), *d.shape)
        for d, o, t in zip(datas, outs, transposes)
    ]
    key = ("decode", DECODE_TILE, scales.device.index, *rows)

    def make():
        tiles = [
            (w, i, j)
            for w, (*_, m, n) in enumerate(rows)
            for i in range(-(-m // bm))
            for j in range(-(-n // bn))
        ]
        return [x for t in tiles for x in t], [x for r in rows for x in r]

    tiles, weights = _table(key, scales.device, make)
    _decode[(tiles.numel() // 3,)](
        tiles,
        weights,
        scales,
        scale_slots,
        datas[0],
        outs[0],
        BM=bm,
        BN=bn,
        STRIDE=SCALE_STRIDE,
        num_warps=warps,
    )
