"""Hopper backends against the CPU-tested reference. Skipped without CUDA; Triton is imported
only after that check, so collecting this file on CPU never imports it."""

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (Hopper) for the Triton backends", allow_module_level=True)

from aligndp.lowp import MXLinear, get_backend, get_recipe, quantize_mxfp8  # noqa: E402
from aligndp.lowp.backends import ReferenceBackend  # noqa: E402
from aligndp.lowp.recipe import ScaleFormat  # noqa: E402
from aligndp.plan.fused import GradTarget  # noqa: E402
from tests.models import order_tolerance  # noqa: E402

DEV = "cuda"


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("impl", ["gluon", "triton"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(320, 192), (2048, 512)])  # masked edge tiles; whole tiles only
def test_quantize_kernel_is_bit_exact_with_format(impl, dtype, shape):
    from aligndp.lowp.triton_kernels import quantize_rows_and_columns

    g = torch.Generator(device=DEV).manual_seed(0)
    rows, cols = shape
    x = (
        torch.randn(rows, cols, generator=g, device=DEV)
        * torch.exp2(torch.randint(-20, 20, (rows, 1), device=DEV))
    ).to(dtype)
    x[0, :32] = 0.0
    x[40, 7] = float("nan")
    x[41, 70] = float("inf")
    x[100:132, 64] = 1e-30  # tiny blocks in the column direction
    row, col = quantize_rows_and_columns(x, impl=impl)
    ref_row, ref_col = quantize_mxfp8(x, dim=-1), quantize_mxfp8(x, dim=0)
    assert torch.equal(row.data.view(torch.uint8), ref_row.data.view(torch.uint8))
    assert torch.equal(row.scale_t, ref_row.scale.view(torch.uint8).T)
    assert torch.equal(col.data.view(torch.uint8), ref_col.data.view(torch.uint8).T)
    assert torch.equal(col.scale_t, ref_col.scale.view(torch.uint8))
    only_row, none = quantize_rows_and_columns(x, colwise=False, impl=impl)
    none2, only_col = quantize_rows_and_columns(x, rowwise=False, impl=impl)
    assert none is None and none2 is None
    assert torch.equal(only_row.data.view(torch.uint8), row.data.view(torch.uint8))
    assert torch.equal(only_col.scale_t, col.scale_t)


def test_fp8_1x128_quantise_kernels_agree_with_torch():
    """The 1x128 fp8 recipe (scale amax / 448, data x * (448 / amax) rounded to nearest even):
    Gluon and plain-Triton kernels equal each other bit for bit and a torch reference."""
    from aligndp.lowp.fp8_blocks import quantize_blocks
    from aligndp.lowp.triton_kernels import quantize_rows_and_columns

    g = torch.Generator(device=DEV).manual_seed(2)
    x = torch.randn(640, 384, generator=g, device=DEV, dtype=torch.bfloat16) * 7
    x[:128, 5] = 0.0  # an all-zero column block: scale 1, data 0
    x[7, 128:256] = 0.0  # a row block below the amax floor: 448 / amax would overflow to inf,
    x[7, 130] = 1e-37  # and its zeros become NaN (0 * inf); floored at 1e-30, they stay 0
    outs = [
        quantize_rows_and_columns(x, block=128, scale_format=ScaleFormat.FP32, impl=impl)
        for impl in ("gluon", "triton")
    ]
    for (row, col), (row2, col2) in [outs]:
        assert torch.equal(row.data.view(torch.uint8), row2.data.view(torch.uint8)) and torch.equal(
            row.scale_t, row2.scale_t
        )
        assert torch.equal(col.data.view(torch.uint8), col2.data.view(torch.uint8)) and torch.equal(
            col.scale_t, col2.scale_t
        )
    row, col = outs[0]
    assert row.data.float().isfinite().all() and col.data.float().isfinite().all()
    # the torch-ops quantise compiled graphs use (eager torch: correctly rounded division, as
    # the kernels' div_rn)
    for got, want in ((row, quantize_blocks(x, 128)), (col, quantize_blocks(x.T, 128))):
        assert torch.equal(got.data.view(torch.uint8), want[0].view(torch.uint8))
        assert torch.equal(got.scale_t, want[1])
    assert (col.scale_t > 0).all() and col.scale_t[0, 5] == 1.0


@pytest.mark.parametrize("fresh", [False, True])
@pytest.mark.parametrize("backend", ["triton", "fp8"])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_wgrad_accumulates_in_place(backend, grad_dtype, fresh):
    """main_grad (a view at element 256 of a buffer) += dy.T @ x, twice; triton (dequantised
    bf16 products, exact, summed in fp32) must match the reference to within float32 summation
    order; fp8 (1x128) must be within fp8 error of fp32. A fresh view (NaN garbage) is
    overwritten by the first wgrad, then added to."""
    be = get_backend(backend)
    g = torch.Generator(device=DEV).manual_seed(1)
    dy = torch.randn(1000, 384, generator=g, device=DEV, dtype=torch.bfloat16)
    x = torch.randn(1000, 256, generator=g, device=DEV, dtype=torch.bfloat16)
    buffer = torch.zeros(256 + 384 * 256 + 64, device=DEV, dtype=grad_dtype)
    view = buffer[256 : 256 + 384 * 256].view(384, 256)
    view.copy_(torch.randn(384, 256, generator=g, device=DEV))
    start = torch.zeros_like(view, dtype=torch.float32) if fresh else view.float().clone()
    if fresh:
        view.fill_(float("nan"))
    be.wgrad_into(dy, x, GradTarget(view, accumulate=not fresh))
    be.wgrad_into(dy, x, GradTarget(view, accumulate=True))
    exact = start + 2 * (dy.float().T @ x.float())
    assert not buffer[:256].any() and not buffer[256 + 384 * 256 :].any()
    if backend == "triton":
        ref = start + 2 * ReferenceBackend(get_recipe("mxfp8")).wgrad(dy, x)
        tol = 1e-5 if grad_dtype == torch.float32 else 4e-3
        assert rel_err(view, ref) < tol
    assert rel_err(view, exact) < 0.06


@pytest.mark.parametrize("backend", ["triton", "fp8"])
def test_misaligned_main_grad_raises_before_the_kernel(backend):
    be = get_backend(backend)
    buffer = torch.zeros(10 + 64 * 64, device=DEV)
    dy = torch.randn(64, 64, device=DEV, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="element 10"):
        be.wgrad_into(dy, dy, GradTarget(buffer[10:].view(64, 64), accumulate=True))


@pytest.mark.parametrize("backend", ["triton", "fp8"])
def test_mxlinear_on_gpu_matches_reference_backend(backend):
    torch.manual_seed(0)
    lin = torch.nn.Linear(256, 96, device=DEV, dtype=torch.bfloat16)
    ours, ref = MXLinear.from_linear(lin, backend=backend), MXLinear.from_linear(lin)
    x = torch.randn(4, 50, 256, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    y, y_ref = ours(x), ref(xr)
    y.float().sin().sum().backward()
    wg, bg = lin.weight.grad.clone(), lin.bias.grad.clone()
    lin.weight.grad = lin.bias.grad = None
    y_ref.float().sin().sum().backward()
    bound = (
        2e-2 if backend == "triton" else 0.08
    )  # bf16 outputs vs the MX reference; fp8 is another recipe
    assert (
        rel_err(y, y_ref) < bound
        and rel_err(x.grad, xr.grad) < bound
        and rel_err(wg, lin.weight.grad) < bound
    )
    assert rel_err(bg, lin.bias.grad) < bound  # the GPU backends add the bias in the GEMM epilogue


@pytest.mark.parametrize(
    "scale_format,impl",
    [(ScaleFormat.E8M0, "auto"), (ScaleFormat.FP32, "gluon"), (ScaleFormat.FP32, "triton")],
)
@pytest.mark.parametrize("accumulate", [False, True])
def test_gemm_bias_epilogue(scale_format, impl, accumulate):
    """``scaled_gemm(bias=...)`` adds the bias to every row in float32 before the store, in all
    three GEMM kernels; a bias shorter than N (a padded output) reads as zeros past its end."""
    from aligndp.lowp.triton_kernels import (
        dequantize_operand,
        quantize_rows_and_columns,
        scaled_gemm,
    )

    g = torch.Generator(device=DEV).manual_seed(6)
    block = 32 if scale_format is ScaleFormat.E8M0 else 128
    x = torch.randn(256, 384, generator=g, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(384, 384, generator=g, device=DEV, dtype=torch.bfloat16)
    a, b = (
        quantize_rows_and_columns(x, block=block, scale_format=scale_format)[0],
        quantize_rows_and_columns(w, block=block, scale_format=scale_format)[0],
    )
    bias = torch.randn(300, generator=g, device=DEV)
    start = torch.randn(256, 384, generator=g, device=DEV)
    out = scaled_gemm(
        a,
        b,
        start.clone(),
        block=block,
        scale_format=scale_format,
        accumulate=accumulate,
        bias=bias,
        impl=impl,
    )
    plain = scaled_gemm(
        a,
        b,
        start.clone(),
        block=block,
        scale_format=scale_format,
        accumulate=accumulate,
        impl=impl,
    )
    padded = torch.cat([bias, bias.new_zeros(84)])
    # the start, the product and the bias added in fp32 in some order (tests/models.py)
    assert rel_err(out, plain + padded) < order_tolerance(terms=3)
    if scale_format is ScaleFormat.E8M0:  # and the product itself, against the dequantised operands
        exact = dequantize_operand(a).double() @ dequantize_operand(b).double().T + padded.double()
        # fp32 accumulation over the 384-long contraction against float64
        assert rel_err(out, exact + (start.double() if accumulate else 0)) < order_tolerance(
            terms=384
        )


@pytest.mark.parametrize("backend", ["triton", "fp8"])
@pytest.mark.parametrize(
    "out_features", [384, 96]
)  # 96: padded to the fp8 block, so no in-place kernel
def test_mxlinear_fused_wgrad_on_gpu_equals_unfused(backend, out_features):
    """MXLinear's GPU path quantises x, the weight and grad_out once each (rows and columns in
    one pass) and keeps x as fp8 for backward. Over two micro-batches of 200 tokens (not a
    block multiple), the wgrad accumulated into a main_grad view must equal the sum of the
    unfused wgrads, and grad_x must not depend on whether the wgrad is fused."""
    from aligndp.runtime.buffer import aligned_empty
    from tests.test_mx_linear import RecordingSink

    torch.manual_seed(1)
    lin = torch.nn.Linear(256, out_features, device=DEV, dtype=torch.bfloat16)
    mxl = MXLinear.from_linear(lin, backend=backend)
    batches = [
        torch.randn(4, 50, 256, device=DEV, dtype=torch.bfloat16, requires_grad=True)
        for _ in range(2)
    ]
    expected = torch.zeros(out_features, 256, device=DEV)
    grads_x = []
    for xb in batches:
        mxl.weight.grad = None
        mxl(xb).float().sin().sum().backward()
        expected += mxl.weight.grad.float()
        grads_x.append(xb.grad.clone())
        xb.grad = None
    mxl.weight.grad = None
    buffer = aligned_empty(
        256 + out_features * 256, dtype=torch.float32, device=torch.device(DEV), align_bytes=256
    )
    buffer.zero_()
    sink = RecordingSink({mxl.weight: buffer[256:].view(out_features, 256)})
    mxl.bind_grad_sink(sink)
    for xb, gx in zip(batches, grads_x):
        mxl(xb).float().sin().sum().backward()
        assert torch.equal(xb.grad, gx)
    assert mxl.weight.grad is None and sink.ready == [mxl.weight] * 2 and not buffer[:256].any()
    # unfused grads went through bf16 (the weight's dtype) before summing: compare at bf16 precision
    assert rel_err(sink.views[mxl.weight], expected) < 4e-3


def test_mx_dequantize_and_gemm_read_tiny_and_nan_blocks_exactly():
    """Scale byte 0 is 2**-127 (not 0) and byte 255 is NaN in the GEMM's dequantise pass, which
    must equal aligndp.lowp.dequantize_mxfp8 bit for bit; the GEMM over such blocks, at shapes
    that are not tile multiples (TMA bounds), equals the float64 product of those values."""
    from aligndp.lowp import dequantize_mxfp8
    from aligndp.lowp.triton_kernels import (
        dequantize_operand,
        quantize_rows_and_columns,
        scaled_gemm,
    )

    g = torch.Generator(device=DEV).manual_seed(3)
    x = torch.randn(224, 160, generator=g, device=DEV, dtype=torch.bfloat16)
    x[:32, 3] = 2.0**-120  # a column block of amax 2**-120: scale byte 0
    x[32:64, 9] = 2.0**-115  # scale byte 4
    _, col = quantize_rows_and_columns(x)
    assert (col.scale_t == 0).any()
    ref_col = quantize_mxfp8(x, dim=0)
    deq = dequantize_operand(col)
    assert torch.equal(deq.float(), dequantize_mxfp8(ref_col, dim=0).T.float())
    y = torch.randn(224, 96, generator=g, device=DEV, dtype=torch.bfloat16)
    _, ycol = quantize_rows_and_columns(y)
    out = torch.zeros(160, 96, device=DEV)
    scaled_gemm(col, ycol, out, accumulate=True)
    exact = deq.double() @ dequantize_operand(ycol).double().T
    assert rel_err(out, exact) < order_tolerance(terms=224)  # fp32 over 224 tokens vs float64
    x[40, 11] = float("nan")
    _, col = quantize_rows_and_columns(x)
    assert dequantize_operand(col)[11].isnan().sum() == 32  # the NaN's whole block, nothing else
    assert not dequantize_operand(col)[12].isnan().any()


@pytest.mark.parametrize("impl", ["gluon", "triton"])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("accumulate", [True, False])
def test_fp8_block_gemm_kernels_match_float64(impl, out_dtype, accumulate):
    """Both 1x128 kernels against float64 on the dequantised operands, with scales spread over
    2**-10..2**10, odd and even numbers of K blocks (the Gluon loop is unrolled by two) and more
    tiles than SMs (so persistent CTAs loop); the bound is Hopper's fp8 MMA accumulation."""
    from aligndp.lowp.triton_kernels import QuantizedOperand, scaled_gemm

    g = torch.Generator(device=DEV).manual_seed(4)

    def operand(rows, K):
        data = torch.randn(rows, K, generator=g, device=DEV).to(torch.float8_e4m3fn)
        scale = torch.exp2(
            torch.randint(-10, 11, (K // 128, rows), generator=g, device=DEV).float()
        )
        deq = data.double() * scale.double().T.repeat_interleave(128, dim=1)
        return QuantizedOperand(data, scale), deq

    for M, N, K in ((384, 640, 1152), (256, 128, 1024), (2048, 1152, 256)):
        (a, da), (b, db) = operand(M, K), operand(N, K)
        start = torch.randn(M, N, generator=g, device=DEV).to(out_dtype)
        out = scaled_gemm(
            a,
            b,
            start.clone(),
            block=128,
            scale_format=ScaleFormat.FP32,
            accumulate=accumulate,
            impl=impl,
        )
        exact = da @ db.T + (start.double() if accumulate else 0)
        assert rel_err(out, exact) < (5e-4 if out_dtype == torch.float32 else 5e-3), (M, N, K)


def test_fp8_block_gemm_without_promotion_adds_the_unscaled_product():
    """The measurement aid behind benchmarks/fp8_power.py: ``promote=False`` runs the same
    pipeline but adds each K block's partial unscaled, so it must equal A @ B.T + C (and not the
    scaled product, which the scales below make far from it)."""
    from aligndp.lowp import gluon_kernels

    g = torch.Generator(device=DEV).manual_seed(5)
    M, N, K = 256, 384, 640
    a = torch.randn(M, K, generator=g, device=DEV).to(torch.float8_e4m3fn)
    b = torch.randn(N, K, generator=g, device=DEV).to(torch.float8_e4m3fn)
    sa = torch.full((K // 128, M), 4.0, device=DEV)
    sb = torch.full((K // 128, N), 0.5, device=DEV)
    start = torch.randn(M, N, generator=g, device=DEV)
    unscaled = start.double() + a.double() @ b.double().T
    out = gluon_kernels.fp8_block_gemm(a, sa, b, sb, start.clone(), accumulate=True, promote=False)
    assert rel_err(out, unscaled) < 5e-4
    scaled = gluon_kernels.fp8_block_gemm(a, sa, b, sb, start.clone(), accumulate=True)
    assert rel_err(scaled, start.double() + 2.0 * (a.double() @ b.double().T)) < 5e-4


def test_gluon_gemm_refuses_strided_operands_and_the_triton_one_reads_them():
    """[Note: descriptors on the device]: the Gluon kernel's descriptors take each operand's
    rows as packed, so an operand whose rows are further apart (a column slice) is refused with
    the fix rather than misread; the plain-Triton kernel, whose host descriptors carry the real
    strides, computes it."""
    from aligndp.lowp.triton_kernels import QuantizedOperand, scaled_gemm

    g = torch.Generator(device=DEV).manual_seed(6)
    M, N, K = 256, 128, 256
    wide = torch.randn(M, 2 * K, generator=g, device=DEV).to(torch.float8_e4m3fn)
    a = QuantizedOperand(wide[:, :K], torch.ones(K // 128, M, device=DEV))
    b = QuantizedOperand(
        torch.randn(N, K, generator=g, device=DEV).to(torch.float8_e4m3fn),
        torch.ones(K // 128, N, device=DEV),
    )
    out = torch.zeros(M, N, device=DEV)
    kw = dict(block=128, scale_format=ScaleFormat.FP32)
    with pytest.raises(ValueError, match="contiguous"):
        scaled_gemm(a, b, out, impl="gluon", **kw)
    scaled_gemm(a, b, out, impl="triton", **kw)
    exact = a.data.double() @ b.data.double().T
    assert rel_err(out, exact) < 5e-4


def test_gluon_gemm_scratch_comes_from_the_threads_allocator():
    """The device descriptors' scratch: a thread with no Triton allocator (autograd's backward
    thread) gets torch's on its first launch; one the user set is the one asked."""
    import threading

    import triton

    from aligndp.lowp import gluon_kernels

    M = N = K = 256
    a = torch.randn(M, K, device=DEV).to(torch.float8_e4m3fn)
    ones = torch.ones(K // 128, M, device=DEV)
    expected = a.double() @ a.double().T
    asked, results = [], {}

    def users(size, alignment, stream):
        asked.append(size)
        return torch.empty(size, dtype=torch.int8, device=DEV)

    def run(name, allocator):
        if allocator is not None:
            triton.set_allocator(allocator)
        out = torch.zeros(M, N, device=DEV)
        gluon_kernels.fp8_block_gemm(a, ones, a, ones, out, accumulate=False)
        results[name] = out

    for name, allocator in (("fresh thread", None), ("user's allocator", users)):
        thread = threading.Thread(target=run, args=(name, allocator))
        thread.start()
        thread.join()
        assert name in results, f"{name}: the launch raised"
        assert rel_err(results[name], expected) < 5e-4, name
    assert len(asked) == 1 and asked[0] > 0


@pytest.mark.parametrize("backend", ["triton", "fp8", "fp8-tensor"])
def test_cached_weight_on_gpu_equals_a_quantise_per_forward(backend):
    """[Note: weights once per step] on the GPU backends: micro-batches with the weight cached
    (one quantise, both layouts) give the outputs and gradients of a layer quantising it per
    forward, bit for bit, also after an optimizer step and an in-place write between
    micro-batches; the fp8-tensor backward's grad_out workspace is reused meanwhile."""
    import copy

    torch.manual_seed(3)
    lin = torch.nn.Linear(256, 384, device=DEV, dtype=torch.bfloat16)
    cached = MXLinear.from_linear(copy.deepcopy(lin), backend=backend)
    plain = MXLinear.from_linear(copy.deepcopy(lin), backend=backend, cache_weight=False)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (cached, plain)]
    for i in range(6):
        x = torch.randn(2, 128, 256, device=DEV, dtype=torch.bfloat16)
        outs = []
        for layer in (cached, plain):
            xi = x.clone().requires_grad_()
            y = layer(xi)
            y.float().sin().sum().backward()
            outs.append((y.detach(), xi.grad))
        assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1]), i
        assert torch.equal(cached.weight.grad, plain.weight.grad), i
        if i == 2:
            for opt in opts:
                opt.step()
        if i == 4:
            with torch.no_grad():
                cached.weight.mul_(-1)
                plain.weight.mul_(-1)
