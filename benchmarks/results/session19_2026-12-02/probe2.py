# ruff: noqa  (an archived probe, run once on the GPU as committed here)
"""Session 19 probe 2: the device-descriptor Gluon GEMM (module) against the host-descriptor one
(HEAD's module, old_gluon_gemm.py) and a variant whose partitions make their own descriptors:
GPU time at the 1b shapes, interleaved, and host time per call."""

import sys, time
import torch, triton

sys.path.insert(0, ".gpu/s19")
import old_gluon_gemm as old
from aligndp.lowp import gluon_gemm as new
import aligndp.lowp.ops  # noqa
from aligndp.lowp.recipe import ScaleFormat
from aligndp.lowp.triton_kernels import quantize_rows_and_columns
from aligndp.lowp.triton_launch import CheapLauncher
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma


@gluon.jit
def _producer_p(
    a_ptr,
    sa_ptr,
    b_ptr,
    sb_ptr,
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
    OP_L: gl.constexpr,
    S_L: gl.constexpr,
):
    a_desc = tma.make_tensor_descriptor(a_ptr, [M, K], [K, 1], [128, 128], OP_L)
    sa_desc = tma.make_tensor_descriptor(sa_ptr, [K // 128, M], [M, 1], [1, 128], S_L)
    b_desc = tma.make_tensor_descriptor(b_ptr, [N, K], [K, 1], [128, 128], OP_L)
    sb_desc = tma.make_tensor_descriptor(sb_ptr, [K // 128, N], [N, 1], [1, 128], S_L)
    new._producer(
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
    )


@gluon.jit
def _consumer_p(
    c_ptr,
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
    C_L: gl.constexpr,
):
    c_desc = tma.make_tensor_descriptor(c_ptr, [M, N], [N, 1], [128, 128], C_L)
    new._consumer(
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
        ACCUMULATE,
        GROUP_M,
        STAGES,
        PROMOTE,
        HAS_BIAS,
    )


@gluon.jit
def _kernel_p(
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
    OP_L: gl.constexpr,
    S_L: gl.constexpr,
    C_L: gl.constexpr,
):
    a_bufs = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, 128, 128], OP_L)
    b_bufs = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, 128, 128], OP_L)
    sa_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, 1, 128], S_L)
    sb_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, 1, 128], S_L)
    c_smem = gl.allocate_shared_memory(c_ptr.dtype.element_ty, [128, 128], C_L)
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
                _consumer_p,
                (
                    c_ptr,
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
                    C_L,
                ),
            ),
            (
                _producer_p,
                (
                    a_ptr,
                    sa_ptr,
                    b_ptr,
                    sb_ptr,
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
                    OP_L,
                    S_L,
                ),
            ),
        ],
        [1],
        [PRODUCER_REGS],
    )


_p = CheapLauncher(_kernel_p)


def part_gemm(a, sa, b, sb, out, accumulate):
    M, K = a.shape
    N = b.shape[0]
    g = (min((M // 128) * (N // 128), new._sm_count(out.get_device())),)
    _p[g](
        a,
        sa,
        b,
        sb,
        out,
        out,
        0,
        M,
        N,
        K,
        accumulate,
        8,
        4,
        40,
        True,
        False,
        *new._gemm_layouts(out.dtype),
        num_warps=8,
        maxnreg=168,
    )
    return out


def q(m, k):
    return quantize_rows_and_columns(
        torch.randn(m, k, device="cuda", dtype=torch.bfloat16),
        block=128,
        scale_format=ScaleFormat.FP32,
        colwise=False,
    )[0]


variants = {
    "host-desc (HEAD)": lambda A, B, o, acc: old.fp8_block_gemm(
        A.data, A.scale_t, B.data, B.scale_t, o, accumulate=acc
    ),
    "device-desc (new)": lambda A, B, o, acc: new.fp8_block_gemm(
        A.data, A.scale_t, B.data, B.scale_t, o, accumulate=acc
    ),
    "device-desc in partitions": lambda A, B, o, acc: part_gemm(
        A.data, A.scale_t, B.data, B.scale_t, o, acc
    ),
}
shapes = [
    (8192, 6144, 2048),
    (8192, 2048, 2048),
    (8192, 8192, 2048),
    (8192, 2048, 8192),
    (6144, 2048, 8192),
    (2048, 8192, 8192),
    (2048, 2048, 8192),
    (768, 768, 768),
]
for m, n, k in shapes:
    A, B = q(m, k), q(n, k)
    ref = None
    for name, f in list(variants.items()):
        for odt, acc in [(torch.float32, True), (torch.bfloat16, False)]:
            o = torch.ones(m, n, device="cuda", dtype=odt)
            try:
                f(A, B, o, acc)
            except Exception as e:  # noqa
                print(f"{name} failed: {type(e).__name__}: {str(e)[:300]}")
                variants.pop(name)
                break
            r = old.fp8_block_gemm(
                A.data,
                A.scale_t,
                B.data,
                B.scale_t,
                torch.ones(m, n, device="cuda", dtype=odt),
                accumulate=acc,
            )
            if not torch.equal(o, r):
                print(f"{name} {m}x{n}x{k} {odt} acc={acc}: NOT EQUAL")
    o = torch.zeros(m, n, device="cuda")
    times = {name: [] for name in variants}
    for _ in range(5):
        for name, f in variants.items():
            for _ in range(3):
                f(A, B, o, True)
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for _ in range(20):
                f(A, B, o, True)
            e.record()
            torch.cuda.synchronize()
            times[name].append(s.elapsed_time(e) / 20 * 1000)
    print(
        f"{m}x{n}x{k} GPU us (median of 5 x 20): "
        + ", ".join(f"{k_}: {sorted(v)[2]:.1f}" for k_, v in times.items())
    )


def host_us(fn, calls=1000, rounds=5):
    best = 1e9
    for _ in range(rounds):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t) / calls * 1e6)
        torch.cuda.synchronize()
    return best


A = q(768, 768)
o = torch.empty(768, 768, device="cuda", dtype=torch.bfloat16)
x = torch.randn(768, 768, device="cuda", dtype=torch.bfloat16)
rows = {name: (lambda f=f: f(A, A, o, False)) for name, f in variants.items()}
rows["GEMM op (compiled path)"] = lambda: torch.ops.aligndp.scaled_mm(
    A.data, A.scale_t, A.data, A.scale_t, 128, False, torch.bfloat16, None
)
rows["quantise op (compiled path)"] = lambda: torch.ops.aligndp.quantize_rc(
    x, 128, False, True, True
)
print("\nhost us per call, 768^3, best of 5 x 1000, interleaved 3 times")
res = {}
for _ in range(3):
    for name, fn in rows.items():
        fn()
        res.setdefault(name, []).append(host_us(fn))
for name, v in res.items():
    print(f"| {name} | " + " / ".join(f"{x:.1f}" for x in v) + " |")
