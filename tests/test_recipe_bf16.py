"""The ``bf16`` wgrad recipe ([Note: fused bf16 wgrad] in aligndp/lowp/recipe_bf16.py).

References: torch's own autocast ``nn.Linear`` (forward and dgrad are the same bf16 ops, so
they match bit for bit; the wgrad differs only by the bf16 rounding torch applies to it and
this recipe does not), the same layers unwrapped (plain autograd: the same GEMMs, float32
order only), and float64 products of the exact bf16 operands for the GEMM into the view.
Multi-rank parity is in tests/test_fused_wgrad_ddp.py, the compiled path in
tests/test_mx_compile.py (every CPU and GPU backend).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import aligndp
from aligndp.lowp import MXLinear, convert_to_mxfp8
from aligndp.lowp.linear import conversion_plan
from aligndp.lowp.recipe_bf16 import gemm_into
from aligndp.models.gpt import GPT, PRESETS, GPTConfig
from aligndp.runtime.buffer import aligned_empty
from tests.models import order_tolerance

BF16_EPS = torch.finfo(torch.bfloat16).eps
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(scope="module", autouse=True)
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class Net(nn.Module):
    """Odd widths (no dim a multiple of 16), a bias-free layer, a layer used twice."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(24, 40)
        self.down = nn.Linear(40, 24, bias=False)
        self.head = nn.Linear(24, 7)

    def forward(self, x):
        h = x + self.down(torch.nn.functional.gelu(self.up(x)))
        h = h + self.down(torch.nn.functional.gelu(self.up(h)))
        return self.head(h).float().square().mean()


def run(model, xs, device, autocast: bool) -> None:
    for x in xs:  # micro-batches: the second writes onto the first
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
            model(x).backward()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("autocast", [True, False], ids=["bf16-autocast", "fp32"])
def test_wrapped_grads_match_torch_linear_and_the_unwrapped_layers(device, autocast):
    """Two micro-batches through parallelize(wgrad="bf16"): every grad in main_grad equals the
    unwrapped converted net's to float32 order, and torch's nn.Linear's to the bf16 rounding
    of each micro-batch's wgrad (exactly, without autocast)."""
    torch.manual_seed(0)
    plain = Net().to(device)
    unwrapped = convert_to_mxfp8(copy.deepcopy(plain), backend="bf16", layers="all")
    net = convert_to_mxfp8(copy.deepcopy(plain), backend="bf16", layers="all")
    assert all(isinstance(m, MXLinear) for m in (net.up, net.down, net.head))
    model, _ = aligndp.parallelize(net, optimizer="adamw", lr=1e-3, wgrad="bf16")
    xs = torch.randn(2, 33, 24, device=device).unbind()
    for m in (plain, unwrapped, model):
        run(m, xs, device, autocast)
    for name, p in net.named_parameters():
        got = p.main_grad
        # .grad is the buffer's view, as torch DDP's gradient_as_bucket_view gives it
        assert p.grad is None or p.grad.data_ptr() == got.data_ptr(), name
        same_gemms = dict(unwrapped.named_parameters())[name].grad
        torch_grad = dict(plain.named_parameters())[name].grad
        scale = torch_grad.abs().max().item()
        assert (got - same_gemms).abs().max().item() <= order_tolerance(terms=66) * scale, name
        # torch rounds each micro-batch's wgrad (and bias grad) to bf16 before widening it
        rel = 2 * BF16_EPS if autocast else order_tolerance(terms=66)
        assert (got - torch_grad).abs().max().item() <= rel * scale, name
    model.remove_hooks()


def test_converts_every_layer_but_shared_weights_head_included():
    """It lowers no precision, so it spares no head and no odd width; a tied embedding's
    Linear stays (its gradient has a second, autograd, contributor)."""
    tied = GPTConfig(vocab_size=97, seq_len=16, dim=40, num_layers=1, head_dim=10, tied=True)
    untied = GPTConfig(vocab_size=97, seq_len=16, dim=40, num_layers=1, head_dim=10)
    plan = dict(conversion_plan(GPT(untied), "bf16", layers="all"))
    assert plan and all(why == "" for why in plan.values()), plan
    plan = dict(conversion_plan(GPT(tied), "bf16", layers="all"))
    head = [n for n in plan if plan[n]]
    assert len(head) == 1 and "shared" in plan[head[0]], plan
    fp8 = dict(conversion_plan(GPT(untied), "fp8-tensor", layers="all"))
    assert fp8[head[0]] == "the model's last Linear (output head)"  # FP8 spares it


def test_by_default_only_where_it_paid_on_h200():
    """[Note: layers that pay]: on sm_90, the 1b preset's Linears (every one in, out >= 2048,
    the head too) and none of gpt2-small's 768-wide ones; on a CPU none, with the reason."""
    with torch.device("meta"):
        big, small = GPT(PRESETS["1b"]), GPT(PRESETS["gpt2-small"])
    plan = conversion_plan(big, "bf16", capability=(9, 0))
    assert len(plan) == 4 * 16 + 1 and all(why == "" for _, why in plan), plan
    plan = dict(conversion_plan(small, "bf16", capability=(9, 0)))
    assert plan.pop("head").startswith("its weight is shared"), plan  # tied to the embedding
    assert len(plan) == 4 * 12 and all(w.startswith("too small") for w in plan.values()), plan
    with pytest.warns(UserWarning, match="no fast path on a CPU"):
        plan = conversion_plan(big, "bf16", capability=None)
    assert {why for _, why in plan} == {"no fast path on this device"}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "operands, view",
    [
        (torch.bfloat16, torch.float32),  # autocast into fp32 buffers: one GEMM on CUDA
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.bfloat16),  # fp32 training into bf16 buffers
    ],
)
@pytest.mark.parametrize("accumulate", [False, True])
def test_gemm_into_the_view_writes_or_adds_the_exact_product(device, operands, view, accumulate):
    """The transposed (strided) operands of a wgrad into a NaN-filled view: written over
    when the view holds nothing (never NaN + x), added when it does; the float64 product of
    the same operand values, rounded once to the view's dtype (twice when adding into bf16)."""
    g = torch.Generator().manual_seed(1)
    grad_out = torch.randn(70, 30, generator=g).to(device, operands)
    x = torch.randn(70, 22, generator=g).to(device, operands)
    before = torch.randn(30, 22, generator=g).to(device, view)
    out = torch.full((30, 22), float("nan"), device=device, dtype=view)
    if accumulate:
        out.copy_(before)
    gemm_into(out, grad_out.t(), x, accumulate=accumulate)
    want = grad_out.double().t() @ x.double() + (before.double() if accumulate else 0)
    rounding = order_tolerance(terms=70) + (0 if view == torch.float32 else 2 * BF16_EPS)
    err = (out.double() - want).abs().max().item()
    assert err <= rounding * want.abs().max().item(), (err, want.abs().max().item())


def test_refuses_a_misaligned_view_naming_the_rule():
    """The alignment contract: a view that does not start on the recipe's 16 bytes is refused
    before the GEMM writes, as every recipe's is."""
    from aligndp.lowp.recipes import get_backend
    from aligndp.plan.fused import GradTarget

    backend = get_backend("bf16")
    flat = aligned_empty(40 * 24 + 1, dtype=torch.float32, device="cpu", align_bytes=16)
    view = flat[1:].view(40, 24)  # 4 bytes past a 16-byte boundary
    parts = (torch.randn(5, 40), torch.randn(5, 24))
    with pytest.raises(ValueError, match="fused bf16 wgrad"):
        backend.wgrad_from_parts(parts, GradTarget(view, False), (40, 24))


@pytest.mark.parametrize("recipe", ["bf16", "fp8-tensor"])
def test_a_fused_weight_arrives_once_so_zero_grad_zeroes_nothing(recipe):
    """[Note: gradient as bucket view] in ddp.py: a fused layer's weight is never armed, so the
    post-accumulate hook torch runs for it (with no gradient) does not count it a second time.
    Every param then arrives once per step, every bucket defers its copy, and from the second
    step on ``zero_grad`` writes no byte of the buffer ([Note: deferring buckets are not
    zeroed]); the gradients still equal the unwrapped net's."""
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 48), nn.GELU(), nn.Linear(48, 32), nn.Linear(32, 16))
    unwrapped = convert_to_mxfp8(copy.deepcopy(net), backend=recipe, layers="all")
    convert_to_mxfp8(net, backend=recipe, layers="all")
    model, opt = aligndp.parallelize(net, optimizer="sgd", lr=0.0, wgrad=recipe)
    x = torch.randn(3, 16, 32)
    for step in range(3):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            opt.zero_grad()
        zeroed = [e.name for e in prof.events() if e.name in ("aten::zero_", "aten::fill_")]
        assert step == 0 or not zeroed, f"step {step}: zero_grad ran {zeroed}"
        model(x[step]).square().mean().backward()
        unwrapped.zero_grad()
        unwrapped(x[step]).square().mean().backward()
        for (name, p), q in zip(net.named_parameters(), unwrapped.parameters()):
            assert (p.main_grad - q.grad).abs().max() <= 1e-6 * q.grad.abs().max(), name
    assert all(g.defer for g in model.reducer.buckets)
    model.remove_hooks()
