"""Triton kernels of the ``fp8-tensor`` recipe (:mod:`aligndp.lowp.recipe_fp8_tensor`): GPU only.

A per-tensor scale needs the whole tensor's amax before the first element can be cast, so a
quantise is two passes: :func:`_amax_kernel` (a grid-stride max of ``|x|`` per program, one
``atomic_max`` each into a float32 scalar) and :func:`_cast_kernel` (each tile scaled, clamped
to ±448 and cast to E4M3, written row-major and, when asked, transposed as well, so the GEMM
that wants the other layout needs no separate transpose of the FP8 tensor).

Host cost per quantise ([Note: compiled MX layers] removes it under torch.compile): two
launches (the floor for current scaling: [Note: quantise cost] in recipe_fp8_tensor.py), each
through the cached compiled kernel ([Note: cheap launches] in triton_launch.py), one per-device
lookup, and one allocation and its five views, none of either where the caller passes a
workspace (``grad_out``, used up within its backward: its views are made once per shape).
The amax scalar is a per-device workspace that is never zeroed by a launch of its own: each
cast program takes a ticket (``atomic_add``, acquire-release, after its read of the amax), and
the program that takes the last ticket sets the amax and the ticket back to 0 for the next
quantise on the stream. The FP8 data, its transpose and the scale share
one allocation (each FP8 tensor 256-byte aligned). Quantises on two streams at once would share
the workspace: the recipe quantises on the current stream only.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from aligndp.lowp.triton_launch import CheapLauncher

__all__ = ["quantize_per_tensor"]

E4M3_MAX = 448.0
AMAX_FLOOR = tl.constexpr(1e-30)
"""Smallest amax a scale is taken from (the CPU path uses the same): ``1e-30 / 448`` is still a
normal float32."""


@triton.jit
def _amax_kernel(x_ptr, amax_ptr, n, BLOCK: tl.constexpr, UNROLL: tl.constexpr):
    # UNROLL independent loads per iteration keep more bytes in flight per program
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    step = BLOCK * UNROLL * tl.num_programs(0)
    for start in range(tl.program_id(0) * BLOCK * UNROLL, n, step):
        for u in tl.static_range(UNROLL):
            offs = start + u * BLOCK + tl.arange(0, BLOCK)
            v = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
            acc = tl.maximum(acc, tl.abs(v))
    tl.atomic_max(amax_ptr, tl.max(acc, axis=0))


@triton.jit
def _cast_kernel(
    x_ptr,
    amax_ptr,
    ticket_ptr,
    q_ptr,
    qt_ptr,
    scale_ptr,
    M,
    N,
    BM: tl.constexpr,
    BN: tl.constexpr,
    WRITE_T: tl.constexpr,
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    # the floor keeps the scale a normal float32: the GPU flushes denormals to zero, and
    # 0 / 0 would turn an all-zero tensor into NaNs
    # IEEE divisions (div_rn, not the approximate ``/``): the same bits as torch's CPU path
    scale = tl.div_rn(tl.maximum(tl.load(amax_ptr), AMAX_FLOOR), 448.0)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    x = tl.load(x_ptr + rm[:, None] * N + rn[None, :], mask=mask, other=0.0).to(tl.float32)
    y = tl.clamp(tl.div_rn(x, scale), -448.0, 448.0)
    tl.store(q_ptr + rm[:, None] * N + rn[None, :], y.to(tl.float8e4nv), mask=mask)
    if WRITE_T:
        # the transposed tile is loaded again with swapped strides (from L1/L2: this program
        # just read it) rather than transposed in registers: tl.trans of a tile loaded from
        # float32 came out as NaN bytes on H200 (Triton 3.6), and this way both stores stay
        # row-major and coalesced
        mask_t = (rn[:, None] < N) & (rm[None, :] < M)
        xt = tl.load(x_ptr + rm[None, :] * N + rn[:, None], mask=mask_t, other=0.0)
        yt = tl.clamp(tl.div_rn(xt.to(tl.float32), scale), -448.0, 448.0)
        tl.store(qt_ptr + rn[:, None] * M + rm[None, :], yt.to(tl.float8e4nv), mask=mask_t)
    if (pid_m == 0) & (pid_n == 0):
        tl.store(scale_ptr, scale)
    # every program has read the amax before its ticket; the last one resets the workspace
    ticket = tl.atomic_add(ticket_ptr, 1)
    if ticket == tl.num_programs(0) * tl.num_programs(1) - 1:
        tl.store(amax_ptr, 0.0)  # no program reads either after its ticket
        tl.store(ticket_ptr, 0)


TILE = (64, 64, 4)
"""(rows, cols, warps) of one program of the cast kernel: the fastest of eight tiles tried on
H200 for both layouts (benchmarks/results/fp8_tensor_step_2026-11-30.md)."""
AMAX_LOOP = (2048, 4)
"""(elements per load, loads per iteration) of the amax kernel: faster than one load of 4096
per iteration on H200 (docs/performance.md)."""


_amax = CheapLauncher(_amax_kernel)
_cast = CheapLauncher(_cast_kernel)


@functools.cache
def _device_state(index: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The device's amax (float32) and ticket (int32) scalars, zeroed once here (every cast
    leaves them zeroed again: module docstring), and its amax grid's size (4 programs per SM)."""
    device = torch.device("cuda", index)
    programs = 4 * torch.cuda.get_device_properties(index).multi_processor_count
    return (
        torch.zeros((), dtype=torch.float32, device=device),
        torch.zeros((), dtype=torch.int32, device=device),
        programs,
    )


def _outputs(x: torch.Tensor, m: int, n: int, transposed: bool):
    """``(q, q_t, scale)`` in one new allocation ``[q][q_t][scale]``, each FP8 tensor 256-byte
    aligned as a tensor of its own would be (cuBLASLt may pick its GEMM by the operands'
    alignment: the same bits as the torch-op path under torch.compile need the same pick)."""
    numel_256 = -(-m * n // 256) * 256
    end = numel_256 * (2 if transposed else 1)
    buf = torch.empty(end + 4, dtype=torch.uint8, device=x.device)
    fp8 = buf.view(torch.float8_e4m3fn)
    q = fp8.as_strided((m, n), (n, 1))
    q_t = fp8.as_strided((n, m), (m, 1), numel_256) if transposed else None
    return q, q_t, buf.view(torch.float32).as_strided((), (), end // 4)


def quantize_per_tensor(
    x: torch.Tensor, *, transposed: bool, workspace: dict | None = None
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """``(q, q_t, scale)`` of a contiguous 2-D CUDA tensor: E4M3 ``q`` (rows, cols), its
    transpose ``q_t`` (cols, rows) when ``transposed`` (else None), and the float32 0-d scale
    ``amax / 448`` with ``q * scale ≈ x``. With a ``workspace`` dict the three are the ones
    made for this shape on its first use (views built once, kept with their buffer), which
    the next call of the same shape rewrites."""
    assert x.is_cuda and x.dim() == 2 and x.is_contiguous(), "internal: 2-D contiguous CUDA"
    m, n = x.shape
    index = x.get_device()
    amax, ticket, programs = _device_state(index)
    if workspace is None:
        q, q_t, scale = _outputs(x, m, n, transposed)
    else:
        made = workspace.get((index, m, n, transposed))
        if made is None:
            made = workspace[(index, m, n, transposed)] = _outputs(x, m, n, transposed)
        q, q_t, scale = made
    numel = m * n
    block, unroll = AMAX_LOOP
    _amax[(max(1, min(-(-numel // (block * unroll)), programs)),)](
        x, amax, numel, BLOCK=block, UNROLL=unroll, num_warps=8
    )
    bm, bn, warps = TILE
    _cast[(-(-m // bm), -(-n // bn))](
        x,
        amax,
        ticket,
        q,
        q if q_t is None else q_t,
        scale,
        m,
        n,
        BM=bm,
        BN=bn,
        WRITE_T=transposed,
        num_warps=warps,
    )
    return q, q_t, scale
