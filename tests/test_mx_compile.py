"""MX layers under torch.compile ([Note: compiled MX layers] in aligndp/lowp/ops.py).

Every recipe's converted model compiles with no graph break, with a grad sink bound, and the
compiled step gives what the eager step gives: the same ATen ops run (``aot_eager``), so the
outputs, input grads and the ``main_grad`` views are equal bit for bit, and the sink sees the
same write-then-accumulate sequence and the same ``mark_ready`` calls. The eager path is the
one checked against torchao and nn.Linear (tests/test_mx_linear.py, test_recipe_fp8_tensor.py).
The fake impls of the Triton ops are checked against the reference quantiser's shapes here and
against the real kernels on a GPU (``torch.library.opcheck``).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn as nn

from aligndp.lowp import convert_to_mxfp8
from aligndp.lowp.mx_format import quantize_mxfp8
from aligndp.plan.fused import GradTarget, fused_wgrad_modules
from aligndp.runtime.buffer import aligned_empty
from tests.models import rel_error

CUDA = torch.cuda.is_available()
NEEDS_CUDA = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (Hopper)")
CPU_BACKENDS = ("reference", "fp8-tensor", "bf16")  # every recipe's CPU backend
GPU_BACKENDS = ("triton", "fp8", "fp8-tensor", "bf16")  # every recipe's CUDA backend


class Sink:
    """A grad sink as DataParallel's behaves: a view holds nothing until its first
    ``mark_ready`` (so the kernel must overwrite it), then accumulates; records the calls."""

    def __init__(self, views: dict):
        self.views, self.ready = views, []

    def grad_target(self, param):
        written = any(p is param for p in self.ready)
        return GradTarget(self.views[param], accumulate=written)

    def mark_ready(self, param):
        self.ready.append(param)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(64, 128)
        self.down = nn.Linear(128, 64, bias=False)
        self.head = nn.Linear(64, 32)  # the last Linear: never converted here

    def forward(self, x):
        h = x + self.down(torch.nn.functional.gelu(self.up(x)))
        h = h + self.down(torch.nn.functional.gelu(self.up(h)))  # each layer used twice
        return self.head(h).float().square().mean()


def converted(backend: str, device: str):
    """The net converted for ``backend`` with a fresh-view sink bound (views 256-byte aligned,
    as DataParallel's are), and the sink."""
    torch.manual_seed(0)
    # the head stays: bf16 would convert it (it spares no head), the others never do
    model = convert_to_mxfp8(Net().to(device), backend=backend, filter=lambda n, m: n != "head")
    layers = fused_wgrad_modules(model)
    assert [n for n, _ in layers] == ["up", "down"]
    views = {}
    for _, layer in layers:
        flat = aligned_empty(
            layer.weight.numel(), dtype=torch.float32, device=device, align_bytes=256
        )
        views[layer.weight] = flat.view_as(layer.weight).fill_(float("nan"))  # stale: garbage
    sink = Sink(views)
    for _, layer in layers:
        layer.bind_grad_sink(sink)
    return model, sink


def forward(model, x):
    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        return model(x)


def run_twice(model, sink, x, fn):
    """Two backwards (the second accumulates); what the sink and the grads hold after."""
    losses = []
    for scale in (1.0, 0.5):
        loss = fn(model, x * scale)
        loss.backward()
        losses.append(loss.detach())
    names = {id(p): n for n, p in model.named_parameters()}
    return (
        losses,
        [names[id(p)] for p in sink.ready],
        {names[id(p)]: v.clone() for p, v in sink.views.items()},
        {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
        x.grad.clone(),
    )


def same(a: torch.Tensor, b: torch.Tensor, rel: float) -> bool:
    """Equal bits (``rel`` 0), or a relative norm difference of at most ``rel``."""
    if rel == 0:
        return torch.equal(a, b)
    return ((a.double() - b.double()).norm() <= rel * b.double().norm()).item()


def check_compiled_like_eager(backend: str, device: str, compile_backend: str, rel: float = 0.0):
    x = torch.randn(64, 64, device=device, requires_grad=True)  # 64 tokens: two MX blocks
    eager_model, eager_sink = converted(backend, device)
    expected = run_twice(eager_model, eager_sink, x, forward)
    x.grad = None
    model, sink = converted(backend, device)
    explain = torch._dynamo.explain(forward)(model, x)  # traces forward and backward
    assert explain.graph_break_count == 0, [str(b.reason)[:200] for b in explain.break_reasons]
    assert not sink.ready  # explain ran no backward
    torch._dynamo.reset()
    got = run_twice(model, sink, x, torch.compile(forward, backend=compile_backend))
    torch._dynamo.reset()
    losses, ready, views, grads, x_grad = got
    assert (
        ready == expected[1] == ["down.weight", "up.weight"] * 4
    )  # two layers, two uses, two backwards
    assert set(grads) == {"up.bias", "head.weight", "head.bias"}  # no weight grad beside the sink
    assert same(torch.stack(losses), torch.stack(expected[0]), rel)
    for name, view in views.items():
        assert same(view, expected[2][name], rel), name
    for name, grad in grads.items():
        assert same(grad, expected[3][name], rel), name
    assert same(x_grad, expected[4], rel)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_compiled_step_has_no_graph_break_and_matches_eager(backend):
    """aot_eager runs the traced graph op by op: equal bits to eager. Fails with a graph break
    at the sink, or (without ``has_side_effect``) with main_grad left NaN: the fused-wgrad op
    returns nothing and would be dropped as dead code."""
    check_compiled_like_eager(backend, "cpu", "aot_eager")


@NEEDS_CUDA
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_compiled_step_on_gpu(backend):
    check_compiled_like_eager(backend, "cuda", "aot_eager")


@NEEDS_CUDA
def test_inductor_on_gpu():
    """The one Inductor case: the per-tensor quantise becomes Inductor's own fused kernels.
    Inductor keeps fused intermediates in float32 where eager rounds them to bf16, and its
    division is Triton's approximate one, so the operands reaching each quantise differ in
    their last bits and many elements land in the neighbouring E4M3 value: each result may
    differ from eager's by up to the quantisation error itself, 2**-4 relative (half an E4M3
    step; measured on H200: 2.1e-2 for the first layer's main_grad). A dropped, doubled or
    unscaled wgrad is off by 1 or more."""
    check_compiled_like_eager("fp8-tensor", "cuda", "inductor", rel=2**-4)


@pytest.mark.parametrize(
    "block, mx, rowwise, colwise",
    [(32, True, True, True), (128, False, True, True), (32, True, False, True)],
)
def test_quantize_fake_impl_has_the_reference_quantisers_shapes(block, mx, rowwise, colwise):
    """[Note: operand layout]: row-wise (data, scale_t) = (q(x, dim=-1).data, q(x, dim=-1).scale.T),
    column-wise = (q(x, dim=0).data.T, q(x, dim=0).scale); scales uint8 E8M0 for MXFP8, float32
    for 1x128. The fake impl must give exactly those shapes and dtypes without a GPU."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    x = torch.randn(256, 384)
    ref_row, ref_col = (
        quantize_mxfp8(x, dim=-1, block_size=block),
        quantize_mxfp8(x, dim=0, block_size=block),
    )
    scale_dtype = torch.uint8 if mx else torch.float32
    expected = []
    if rowwise:
        expected += [(ref_row.data.shape, ref_row.data.dtype), (ref_row.scale.T.shape, scale_dtype)]
    if colwise:
        expected += [(ref_col.data.T.shape, ref_col.data.dtype), (ref_col.scale.shape, scale_dtype)]
    with FakeTensorMode() as mode:
        out = torch.ops.aligndp.quantize_rc(mode.from_tensor(x), block, mx, rowwise, colwise)
    assert [(t.shape, t.dtype) for t in out] == expected


def test_gemm_fake_impl_has_the_gemms_shape():
    """``A (M, K) @ B (N, K).T`` is (M, N) in the asked dtype."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        a = torch.empty(96, 256, dtype=torch.float8_e4m3fn)
        b = torch.empty(160, 256, dtype=torch.float8_e4m3fn)
        sa, sb = torch.empty(2, 96), torch.empty(2, 160)
        out = torch.ops.aligndp.scaled_mm(a, sa, b, sb, 128, False, torch.bfloat16, None)
    assert (out.shape, out.dtype) == (torch.Size([96, 160]), torch.bfloat16)


@NEEDS_CUDA
@pytest.mark.parametrize("block, mx", [(32, True), (128, False)])
def test_triton_ops_pass_opcheck(block, mx):
    """torch's own check of a custom op: the fake impl against the real kernel, schema,
    autograd registration."""
    x = torch.randn(256, 384, device="cuda", dtype=torch.bfloat16)
    torch.library.opcheck(torch.ops.aligndp.quantize_rc, (x, block, mx, True, True))
    row = torch.ops.aligndp.quantize_rc(x, block, mx, True, False)
    w = torch.ops.aligndp.quantize_rc(x[:128], block, mx, True, False)
    args = (row[0], row[1], w[0], w[1], block, mx, torch.bfloat16, None)
    before = [t.view(torch.uint8).clone() for t in args[:4]]
    # test_schema's mutation check multiplies the inputs, which CUDA has no FP8 kernel for
    # ("mul_cuda" not implemented for Float8_e4m3fn): the inputs are compared bytewise instead
    utils = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")
    torch.library.opcheck(torch.ops.aligndp.scaled_mm, args, test_utils=utils)
    assert all(torch.equal(t.view(torch.uint8), b) for t, b in zip(args[:4], before))


@pytest.fixture(scope="module")
def one_rank():
    """A one-rank gloo group for this module only (other modules start their own)."""
    import torch.distributed as dist

    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_compiled_data_parallel_trains_like_eager(one_rank):
    """Through the real grad sink (aligndp.parallelize, one rank): three AdamW steps of the
    fp8-tensor net compiled (aot_eager) leave the params equal bit for bit to the eager run's,
    so every fused wgrad reached its bucket (written, then added) and was reduced in the
    compiled backward. A dropped or unmarked wgrad would leave its weight unstepped or
    stale-zero."""
    import aligndp

    x = torch.randn(3, 64, 64, generator=torch.Generator().manual_seed(5))
    finals = []
    for compiled in (False, True):
        torch.manual_seed(0)
        net = convert_to_mxfp8(Net(), backend="fp8-tensor", layers="all")
        model, opt = aligndp.parallelize(net, optimizer="adamw", lr=1e-2, wgrad="fp8-tensor")
        fwd = torch.compile(forward, backend="aot_eager") if compiled else forward
        for step in range(3):
            fwd(model, x[step]).backward()
            opt.step()
            opt.zero_grad()
        finals.append({n: p.detach().clone() for n, p in net.named_parameters()})
        torch._dynamo.reset()
    eager, compiled = finals
    torch.manual_seed(0)
    start = dict(Net().named_parameters())
    for name, value in compiled.items():
        assert torch.equal(value, eager[name]), name
        assert not torch.equal(value, start[name]), f"{name} was never stepped"


def test_identical_layers_compiled_one_by_one_share_one_graph():
    """Per-block compilation (``block.compile()``), as large models do to keep compile times
    short: four identical fp8-tensor layers on one sink compile once, no recompile (the
    fused-wgrad op finds its layer by the weight's address, not by a per-layer constant that
    Dynamo would guard on), and each layer's wgrad lands in its own view, as in eager."""
    from torch._dynamo.utils import counters

    def layers_and_sink():
        torch.manual_seed(0)
        net = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)], nn.Linear(64, 16))
        convert_to_mxfp8(net, backend="fp8-tensor", layers="all")
        views = {}
        for layer in list(net)[:4]:
            flat = aligned_empty(64 * 64, dtype=torch.float32, device="cpu", align_bytes=256)
            views[layer.weight] = flat.view(64, 64)
        sink = Sink(views)
        for layer in list(net)[:4]:
            layer.bind_grad_sink(sink)
        return net, sink

    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(3), requires_grad=True)
    eager, eager_sink = layers_and_sink()
    eager(x).square().sum().backward()
    net, sink = layers_and_sink()
    for layer in list(net)[:4]:
        layer.compile(backend="aot_eager")
    torch._dynamo.reset()
    counters.clear()
    with torch._dynamo.config.patch(error_on_recompile=True):
        net(x).square().sum().backward()
    torch._dynamo.reset()
    assert counters["stats"]["unique_graphs"] == 1
    assert [id(p) for p in sink.ready] == [id(layer.weight) for layer in list(net)[3::-1]]
    for layer, ref in zip(list(net)[:4], list(eager)[:4]):
        assert torch.equal(sink.views[layer.weight], eager_sink.views[ref.weight])


# ---- micro-batches under no_sync through the real grad sink ----
MICRO_BATCHES, MICRO_TOKENS = 4, 256  # two 128-token blocks per wgrad


class Net128(nn.Module):
    """Dims that are multiples of 128, so the 1x128 fp8 backend's wgrad runs its in-place GEMM
    into ``main_grad`` (writing, then accumulating), not the ragged fallback. ``hidden`` x
    ``dim`` of 2048 x 1152 is 144 output tiles of 128 x 128, more than an H200's 132 SMs, so the
    persistent GEMM's CTAs loop over tiles."""

    def __init__(self, dim: int = 128, hidden: int = 256):
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)
        self.head = nn.Linear(dim, 32)  # the last Linear: never converted

    def forward(self, x):
        return (
            self.head(x + self.down(torch.nn.functional.gelu(self.up(x)))).float().square().mean()
        )


def check_micro_batches(
    backend, recipe: str, device: str, compile_backend, rel: float, dims=(128, 256)
) -> None:
    """Two rounds (a ``zero_grad`` between) of 4 micro-batches, the first 3 under ``no_sync``,
    through ``aligndp.parallelize`` (one rank): after each round every param's ``main_grad``
    equals (``rel`` 0: bit for bit; else within ``rel`` normwise) the summed gradients of the
    same converted net without a sink (plain autograd, uncompiled) — so the first micro-batch's
    wgrad is written into the stale view, the next three added, none lost or doubled, and no
    NaN reaches a view. Checked after every micro-batch: the views stay finite."""
    import aligndp

    def net():
        torch.manual_seed(0)
        return convert_to_mxfp8(Net128(*dims).to(device), backend=backend, layers="all")

    gen = torch.Generator().manual_seed(7)
    data = torch.randn(2, MICRO_BATCHES, MICRO_TOKENS, dims[0], generator=gen).to(device)
    ref = net()
    model, _ = aligndp.parallelize(net(), optimizer="adamw", lr=1e-2, wgrad=recipe)
    # as benchmarks/fp8_step.py: torch.compile of the wrapped model, its no_sync through it
    fwd = torch.compile(model, backend=compile_backend) if compile_backend else model
    views = {n: model.index.slots[p].view for n, p in model.module.named_parameters()}
    for round_ in data:
        ref.zero_grad()
        model.zero_grad()
        for i, x in enumerate(round_):
            forward(ref, x).backward()
            with fwd.no_sync() if i < MICRO_BATCHES - 1 else contextlib.nullcontext():
                forward(fwd, x).backward()
            bad = [n for n, v in views.items() if not v.isfinite().all()]  # (no touch)
            assert not bad, f"micro-batch {i}: non-finite main_grad in {bad}"
        for name, p in ref.named_parameters():
            assert same(views[name], p.grad, rel), name
    torch._dynamo.reset()


def stand_in_backend(monkeypatch, recipe: str):
    """The Hopper backend of ``recipe`` (``fp8`` or ``mxfp8``) on CPU: its kernels replaced by
    the torch stand-ins of tests/_cpu_kernels.py, the custom ops and everything around real."""
    import sys

    from aligndp.lowp.recipes import get_recipe
    from tests import _cpu_kernels

    monkeypatch.setitem(sys.modules, "aligndp.lowp.triton_kernels", _cpu_kernels.module())
    monkeypatch.delitem(sys.modules, "aligndp.lowp.triton_backend", raising=False)
    from aligndp.lowp.triton_backend import TritonBackend

    monkeypatch.setitem(
        sys.modules, "aligndp.lowp.triton_backend", sys.modules[TritonBackend.__module__]
    )
    return TritonBackend(get_recipe(recipe), name="fp8" if recipe == "fp8" else "triton")


@pytest.mark.skipif(CUDA, reason="the GPU runs the real kernels: test_micro_batches_on_gpu")
@pytest.mark.parametrize("compile_backend", [None, "aot_eager"])
def test_blockwise_fp8_micro_batches_on_cpu_stand_in_kernels(
    one_rank, monkeypatch, compile_backend
):
    """The 1x128 fp8 backend's Python on CPU (:func:`stand_in_backend`). The unfused reference
    and the fused run go through the same stand-ins (compiled, through the custom ops, whose
    stand-in quantise is :func:`aligndp.lowp.fp8_blocks.quantize_blocks`), so the sums agree
    bit for bit (float32 addition commutes: ``view + product`` is ``product + view``)."""
    backend = stand_in_backend(monkeypatch, "fp8")
    check_micro_batches(backend, "fp8", "cpu", compile_backend, rel=0.0)


@pytest.mark.parametrize("fused", [False, True], ids=["one_pass_op", "fused_into_graph"])
@pytest.mark.parametrize("recipe", ["fp8", "mxfp8"])
def test_compiled_hopper_step_on_stand_in_kernels(monkeypatch, recipe, fused):
    """:func:`check_compiled_like_eager` for the Hopper backends' Python on CPU
    (:func:`stand_in_backend`): bit for bit under aot_eager, with every quantise through the
    one-pass op and with the graph's operands quantised in torch ops (the path without the
    read-back barrier). The 64-wide net pads K to one 128 block, so a compiled 1x128 operand's
    scales are a single row, whose strides must still be row-major: the TMA contract the
    stand-in GEMM checks (``contiguous()`` alone leaves a one-row transpose with strides
    (1, 1))."""
    backend = stand_in_backend(monkeypatch, recipe)
    monkeypatch.setattr(backend, "_fuse_into_graph", fused)
    check_compiled_like_eager(backend, "cpu", "aot_eager")


@pytest.mark.parametrize("barrier", [True, False], ids=["barrier", "no_barrier"])
@pytest.mark.parametrize("recipe", ["fp8", "mxfp8"])
def test_compiled_graph_quantises_through_the_one_pass_op(one_rank, monkeypatch, recipe, barrier):
    """Compiled, the block quantise (1x128 fp8 or MXFP8) goes through the one-pass
    ``aligndp::quantize_rc`` op for every operand: both weights, ``x`` of both layers in
    forward, ``grad_out`` of both in backward; no amax is left in the graph. Without the
    read-back barrier in Inductor ([Note: read-back barrier]) the graph's own operands are
    torch ops (amax, scale, clamp, cast) that Inductor fuses into their producer, and only the
    two weights, graph inputs, take the op. The GEMMs and the sink stay ops either way: the
    forward and backward graphs AOT autograd hands its compilers are read."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    import aligndp

    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    torch.manual_seed(0)
    backend = stand_in_backend(monkeypatch, recipe)
    assert backend._fuse_into_graph is False  # the barrier installs wherever torch runs
    monkeypatch.setattr(backend, "_fuse_into_graph", not barrier)
    net = convert_to_mxfp8(Net128(), backend=backend, layers="all")
    model, _ = aligndp.parallelize(net, optimizer="adamw", lr=1e-2, wgrad=recipe)
    compiled = torch.compile(model, backend=aot_autograd(fw_compiler=record, bw_compiler=record))
    forward(compiled, torch.randn(MICRO_TOKENS, 128)).backward()
    torch._dynamo.reset()
    called = [n.target for gm in graphs for n in gm.graph.nodes if n.op == "call_function"]
    # the sink's op mutates its token, so the graph holds it inside an auto_functionalized node
    called += [n.args[0] for gm in graphs for n in gm.graph.nodes if "auto_func" in str(n.target)]
    ops = torch.ops.aligndp
    assert len(graphs) == 2 and called.count(ops.fused_wgrad.default) == 2  # up and down
    assert called.count(ops.scaled_mm.default) == 3  # 2 forward GEMMs, down's dgrad (up's
    # input needs no grad), the wgrads inside fused_wgrad
    # with the barrier: 2 weights, 2 x, 2 grad_out (up's: columns only), one op each;
    # without: the weights alone, and an amax per layout of each x and grad_out
    assert called.count(ops.quantize_rc.default) == (6 if barrier else 2)
    assert called.count(torch.ops.aten.amax.default) == (0 if barrier else 7)


@NEEDS_CUDA
@pytest.mark.parametrize("compile_backend", [None, "inductor"])
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_micro_batches_on_gpu(one_rank, backend, compile_backend):
    """Every recipe's CUDA backend, 4 micro-batches under ``no_sync`` through the real sink, eager
    and under Inductor, against the unfused uncompiled sum (the benchmark's ``--grad-accum 4``
    case that printed NaN for ``fp8:all+compile``). Eager runs the same kernels on the same
    operands on both sides, fused or not; only the order of the float32 additions may differ
    (a cuBLASLt GEMM writing the view may pick another algorithm than one writing a fresh
    tensor): the bound of a 4 x 128-term sum. Inductor changes the operands' last bits, so
    elements land in neighbouring E4M3 values: up to the quantisation error, 2**-4 relative
    (as test_inductor_on_gpu). A lost or doubled micro-batch is off by 1/4 or more, a NaN by
    everything."""
    from aligndp.lowp import get_backend
    from tests.models import order_tolerance

    recipe = get_backend(backend).recipe.name
    rel = 2**-4 if compile_backend else order_tolerance(terms=MICRO_BATCHES * MICRO_TOKENS)
    check_micro_batches(backend, recipe, "cuda", compile_backend, rel, dims=(1152, 2048))


def gpt_logits_compiled_and_eager(
    backend: str, recipe: str, *, blocks: int = 4, tokens: int = 2048
):
    """Logits of a GPT with ``blocks`` blocks of the 1b preset's width, every block Linear on
    ``backend`` (``recipe``'s), wrapped by aligndp (one rank): eager, then under Inductor, on
    the same ``tokens`` tokens (micro-batches of 1024)."""
    import dataclasses

    import aligndp
    from aligndp.models.gpt import GPT, PRESETS

    cfg = dataclasses.replace(PRESETS["1b"], num_layers=blocks)
    torch.manual_seed(0)
    with torch.device("cuda"):
        net = GPT(cfg)
    convert_to_mxfp8(net, backend=backend, layers="all")
    model, _ = aligndp.parallelize(net, optimizer="adamw", lr=1e-4, wgrad=recipe)
    x = torch.randint(cfg.vocab_size, (tokens // cfg.seq_len, cfg.seq_len), device="cuda")
    try:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            eager = model(x).detach().float()
            compiled = torch.compile(model)(x).detach().float()
    finally:
        torch._dynamo.reset()
    return eager, compiled


@NEEDS_CUDA
@pytest.mark.parametrize("backend, recipe", [("fp8", "fp8"), ("triton", "mxfp8")])
def test_compiled_gpt_logits_on_gpu_match_eager(one_rank, backend, recipe):
    """1x128 fp8 and MXFP8 (``triton``), four 1b-width blocks, 2 x 1024 tokens, compiled
    against eager. Every quantise goes through the opaque op, so Inductor's third-block
    LayerNorm kernel stores its float32 normalised rows and reads them back. Triton's coalesce
    pass gives the two different thread layouts (triton-lang/triton#10924): without the
    read-back barrier ([Note: read-back barrier]) the kernel read stale bytes — FP8 bytes the
    caching allocator had handed out before — and the logits were NaN. The two sides quantise
    operands differing in their last bits (Inductor's fused LayerNorm rounds differently), so
    an element may take the neighbouring E4M3 value, 2**-3 apart: a relative error of the
    logits well under 0.25 after four blocks; the race gave NaN or values near bf16's
    maximum."""
    eager, compiled = gpt_logits_compiled_and_eager(backend, recipe)
    assert eager.isfinite().all() and compiled.isfinite().all()
    error = rel_error(compiled, eager)
    print(f"relative error of compiled logits ({backend}): {error:.4f}")
    assert error < 0.25
