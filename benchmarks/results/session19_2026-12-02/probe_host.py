# ruff: noqa  (an archived probe, run once on the GPU as committed here)
"""Session 19 probe: where the host time of the 1x128 custom ops goes, and a device-descriptor
prototype of the Gluon GEMM (no host TensorDescriptor, no host tensormap encode)."""

import cProfile, inspect, io, pstats, sys, time
import torch, triton
import aligndp.lowp.ops as ops
from aligndp.lowp.recipe import ScaleFormat
from aligndp.lowp.triton_kernels import quantize_rows_and_columns, scaled_gemm
from aligndp.lowp import gluon_gemm as gg, gluon_quantize as gq, triton_quantize as tq
from aligndp.lowp.triton_common import QuantizedOperand
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from aligndp.lowp.triton_launch import CheapLauncher

CALLS, ROUNDS = 1000, 5


def host_us(fn):
    best = 1e9
    for _ in range(ROUNDS):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(CALLS):
            fn()
        e = time.perf_counter() - t
        torch.cuda.synchronize()
        best = min(best, e / CALLS * 1e6)
    return best


n = 768
x = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
a = quantize_rows_and_columns(x, block=128, scale_format=ScaleFormat.FP32, colwise=False)[0]
out = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)
M = N = K = n
op_l, s_l, c_l = gg._gemm_layouts(out.dtype)


def descs():
    d = lambda t, r, c, b, l: TensorDescriptor(t, [r, c], [c, 1], b, l)
    return (
        d(a.data, M, K, [128, 128], op_l),
        d(a.scale_t, K // 128, M, [1, 128], s_l),
        d(a.data, N, K, [128, 128], op_l),
        d(a.scale_t, K // 128, N, [1, 128], s_l),
        d(out, M, N, [128, 128], c_l),
    )


D = descs()
grid = (min(36, gg._sm_count(0)),)
gargs = (*D, out, 0, M, N, K, False, 8, 4, 40, True, False)
gkw = dict(num_warps=8, maxnreg=168)
gg._gemm[grid](*gargs, **gkw)
gg._gemm[grid](*gargs, **gkw)
env = gg._gemm._env
run, function, meta = next(iter(gg._gemm._kernels.values()))
nl = inspect.getclosurevars(run.launch).nonlocals
print(
    "launch closure names:",
    sorted(nl),
    "scratch",
    run.global_scratch_size,
    run.profile_scratch_size,
)
from triton.backends.nvidia.driver import make_tensordesc_arg

tmeta = nl.get("tensordesc_meta")
key, bound = gg._gemm._key(env, gargs, gkw)
stream = env.stream(0)
rows = {
    "GEMM op (compiled path)": lambda: torch.ops.aligndp.scaled_mm(
        a.data, a.scale_t, a.data, a.scale_t, 128, False, torch.bfloat16, None
    ),
    "  ops._scaled_mm direct": lambda: ops._scaled_mm(
        a.data, a.scale_t, a.data, a.scale_t, 128, False, torch.bfloat16, None
    ),
    "  scaled_gemm (no out alloc)": lambda: scaled_gemm(
        a, a, out, block=128, scale_format=ScaleFormat.FP32
    ),
    "  gluon fp8_block_gemm": lambda: gg.fp8_block_gemm(
        a.data, a.scale_t, a.data, a.scale_t, out, accumulate=False
    ),
    "  5 Gluon TensorDescriptors": descs,
    "  CheapLauncher key+launch (descs prebuilt)": lambda: gg._gemm[grid](*gargs, **gkw),
    "  CheapLauncher _key only": lambda: gg._gemm._key(env, gargs, gkw),
    "  run() only (key prebuilt)": lambda: run(
        grid[0], 1, 1, stream, function, meta, None, None, None, *bound
    ),
    "  torch.empty 768x768 bf16": lambda: torch.empty(n, n, device="cuda", dtype=torch.bfloat16),
    "  a.new_empty": lambda: a.data.new_empty(n, n, dtype=torch.bfloat16),
    "  env.stream": lambda: env.stream(0),
    "  ScaleFormat(FP32)": lambda: ScaleFormat(ScaleFormat.FP32),
}
if tmeta:
    rows["  5 make_tensordesc_arg (encode)"] = lambda: [
        make_tensordesc_arg(d, m) for d, m in zip(D, tmeta)
    ]
row_q = quantize_rows_and_columns(x, block=128, scale_format=ScaleFormat.FP32)
L, LM, LC, tm, tn, nw = gq._layouts(128)
qargs = (x, row_q[0].data, row_q[0].scale_t, row_q[1].data, row_q[1].scale_t, M, N)
qkw = dict(
    BLOCK=128,
    TILE_M=tm,
    TILE_N=tn,
    EMAX=8,
    FP8_MAX=448.0,
    MX=False,
    OUT=triton.language.float8e4nv,
    ROWWISE=True,
    COLWISE=True,
    EVEN=True,
    PERSISTENT=True,
    L=L,
    LM=LM,
    LC=LC,
    num_warps=nw,
)
qgrid = (min(36, 2 * gg._sm_count(0)),)
gq._quantize[qgrid](*qargs, **qkw)
ws = {}
rows.update(
    {
        "quantise op (compiled path)": lambda: torch.ops.aligndp.quantize_rc(
            x, 128, False, True, True
        ),
        "  ops._quantize_rc_separate direct": lambda: ops._quantize_rc_separate(
            x, 128, False, True, True
        ),
        "  quantize_rows_and_columns one alloc": lambda: quantize_rows_and_columns(
            x, block=128, scale_format=ScaleFormat.FP32
        ),
        "  same, workspace": lambda: quantize_rows_and_columns(
            x, block=128, scale_format=ScaleFormat.FP32, workspace=ws
        ),
        "  gluon quantize (prealloc)": lambda: gq.quantize(
            x,
            row_q[0],
            row_q[1],
            block=128,
            scale_format=ScaleFormat.FP32,
            out=triton.language.float8e4nv,
            emax=8,
            fp8_max=448.0,
        ),
        "  CheapLauncher key+launch": lambda: gq._quantize[qgrid](*qargs, **qkw),
        "  CheapLauncher _key only": lambda: gq._quantize._key(env, qargs, qkw),
        "  4 torch.empty (separate outputs)": lambda: [
            torch.empty(n, n, device="cuda", dtype=torch.float8_e4m3fn) for _ in range(4)
        ],
        "  _operand one alloc x2": lambda: [
            tq._operand((n, n), (n // 128, n), torch.float8_e4m3fn, torch.float32, x.device, True)
            for _ in range(2)
        ],
        "  x.contiguous()": lambda: x.contiguous(),
        "  _use_gluon": lambda: tq._use_gluon("auto", x, shape_fits=True, shape_rule="r"),
    }
)


# ---- device-descriptor prototype ----
@gluon.jit
def _dev_kernel(
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
    a_desc = tma.make_tensor_descriptor(a_ptr, [M, K], [K, 1], [128, 128], OP_L)
    sa_desc = tma.make_tensor_descriptor(sa_ptr, [K // 128, M], [M, 1], [1, 128], S_L)
    b_desc = tma.make_tensor_descriptor(b_ptr, [N, K], [K, 1], [128, 128], OP_L)
    sb_desc = tma.make_tensor_descriptor(sb_ptr, [K // 128, N], [N, 1], [1, 128], S_L)
    c_desc = tma.make_tensor_descriptor(c_ptr, [M, N], [N, 1], [128, 128], C_L)
    BLOCK_M: gl.constexpr = 128
    BLOCK_N: gl.constexpr = 128
    BK: gl.constexpr = 128
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BLOCK_M, BK], OP_L)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BLOCK_N, BK], OP_L)
    sa_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, 1, BLOCK_M], S_L)
    sb_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, 1, BLOCK_N], S_L)
    c_smem = gl.allocate_shared_memory(c_desc.dtype, [BLOCK_M, BLOCK_N], C_L)
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
                gg._consumer,
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
                gg._producer,
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


_dev = CheapLauncher(_dev_kernel)
triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))


def dev_gemm(a_, sa, b_, sb, o, accumulate, bias=None):
    Mm, Kk = a_.shape
    Nn = b_.shape[0]
    ol, sl, cl = gg._gemm_layouts(o.dtype)
    g = (min((Mm // 128) * (Nn // 128), gg._sm_count(o.get_device())),)
    _dev[g](
        a_,
        sa,
        b_,
        sb,
        o,
        bias if bias is not None else o,
        0 if bias is None else bias.shape[0],
        Mm,
        Nn,
        Kk,
        accumulate,
        8,
        4,
        40,
        True,
        bias is not None,
        ol,
        sl,
        cl,
        num_warps=8,
        maxnreg=168,
    )
    return o


ok = True
for m_, n_, k_ in [(768, 768, 768), (8192, 2048, 2048), (2048, 6144, 8192), (256, 384, 640)]:
    A = quantize_rows_and_columns(
        torch.randn(m_, k_, device="cuda", dtype=torch.bfloat16),
        block=128,
        scale_format=ScaleFormat.FP32,
        colwise=False,
    )[0]
    B = quantize_rows_and_columns(
        torch.randn(n_, k_, device="cuda", dtype=torch.bfloat16),
        block=128,
        scale_format=ScaleFormat.FP32,
        colwise=False,
    )[0]
    for odt, acc in [(torch.bfloat16, False), (torch.float32, True), (torch.float32, False)]:
        base = torch.randn(m_, n_, device="cuda").to(odt)
        o1, o2 = base.clone(), base.clone()
        gg.fp8_block_gemm(A.data, A.scale_t, B.data, B.scale_t, o1, accumulate=acc)
        dev_gemm(A.data, A.scale_t, B.data, B.scale_t, o2, acc)
        same = torch.equal(o1, o2)
        ok &= same
        print(f"dev-desc {m_}x{n_}x{k_} {odt} acc={acc}: equal={same}")
    # GPU time, interleaved
    o = torch.empty(m_, n_, device="cuda", dtype=torch.float32)
    for name, f in [
        (
            "host-desc",
            lambda: gg.fp8_block_gemm(A.data, A.scale_t, B.data, B.scale_t, o, accumulate=True),
        ),
        ("dev-desc", lambda: dev_gemm(A.data, A.scale_t, B.data, B.scale_t, o, True)),
    ] * 2:
        for _ in range(3):
            f()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(50):
            f()
        e.record()
        torch.cuda.synchronize()
        print(f"  {name} {m_}x{n_}x{k_} GPU us/call {s.elapsed_time(e) / 50 * 1000:.1f}")
print("dev-desc all equal:", ok)
o768 = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)
dev_gemm(a.data, a.scale_t, a.data, a.scale_t, o768, False)
rows["dev-desc gemm (prealloc out)"] = lambda: dev_gemm(
    a.data, a.scale_t, a.data, a.scale_t, o768, False
)
rows["  torch.empty 1 KB int8 (scratch alloc)"] = lambda: torch.empty(
    84480, dtype=torch.int8, device="cuda"
)

print(
    f"\nhost us per call, {n}x{n}, best of {ROUNDS}x{CALLS}, {torch.cuda.get_device_name()}, triton {triton.__version__}"
)
for name, fn in rows.items():
    fn()
    fn()
    print(f"| {name} | {host_us(fn):.1f} |")

for name in ["GEMM op (compiled path)", "quantise op (compiled path)"]:
    fn = rows[name]
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(2000):
        fn()
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(22)
    print(f"\n==== cProfile {name} (2000 calls)\n" + s.getvalue()[-5000:])
