"""The ``fp8-tensor`` recipe (aligndp/lowp/recipe_fp8_tensor.py): one module, registered by one
line, reaches every consumer; its GEMMs equal a hand-worked per-tensor FP8 reference.

Reference numerics: each operand ``t`` becomes ``round_e4m3(t / s) * s`` with
``s = max|t| / 448`` over the whole tensor, and the GEMM is float32 on those values. In
DataParallel every rank quantises its own micro-batch, so the reference for the reduced
gradient is one process running each rank's micro-batch through the same layer and averaging.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import aligndp
from aligndp.app.layout_cli import add_arguments
from aligndp.lowp import MXLinear, convert_to_mxfp8, get_backend, recipe_names
from aligndp.lowp.recipe_fp8_tensor import AMAX_FLOOR, E4M3_MAX
from aligndp.plan.fused import GradTarget
from tests._dist import case, make_tests
from tests.models import MLP, CountOps, assert_close, order_tolerance


def by_hand(t: torch.Tensor) -> torch.Tensor:
    """Per-tensor E4M3 quantise-dequantise, written out."""
    t = t.float()
    scale = t.abs().max().clamp(min=AMAX_FLOOR) / E4M3_MAX
    return (t / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float() * scale


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tokens,n_in,n_out", [(48, 64, 32), (80, 112, 48), (16, 16, 16)])
def test_gemms_equal_the_hand_worked_reference(tokens, n_in, n_out, device):
    g = torch.Generator().manual_seed(tokens)
    x, w = torch.randn(tokens, n_in, generator=g), torch.randn(n_out, n_in, generator=g)
    dy = torch.randn(tokens, n_out, generator=g) * 1e-3  # gradients are small: scales are relative
    x, w, dy = x.to(device), w.to(device), dy.to(device)
    backend = get_backend("fp8-tensor")
    y, saved = backend.forward_for_backward(x, w)

    def close(got, ref, what, terms):
        if device == "cpu":  # the same products, summed over ``terms`` in fp32 in any order
            assert_close(got, ref, what, order_tolerance(terms=terms))
            return
        # Hopper's FP8 tensor cores accumulate with fewer mantissa bits than float32 (and the
        # forward uses cuBLAS's fast accumulation): on CUDA, within 1% of the largest entry
        atol = 1e-2 * ref.abs().max().item()
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=atol)

    close(y, by_hand(x) @ by_hand(w).T, "forward", n_in)
    dx, dw = backend.backward(saved, dy, w, need_dgrad=True, need_wgrad=True, target=None)
    close(dx, by_hand(dy) @ by_hand(w), "dgrad", n_out)
    close(dw, by_hand(dy).T @ by_hand(x), "wgrad", tokens)
    main_grad = torch.full((n_out, n_in), 0.5, device=device)
    live = GradTarget(main_grad, accumulate=True)
    backend.backward(saved, dy, w, need_dgrad=False, need_wgrad=True, target=live)
    torch.testing.assert_close(main_grad, 0.5 + dw, rtol=0, atol=0)
    # a view that holds nothing yet (stale garbage) is overwritten by the GEMM itself
    for dtype in (torch.float32, torch.bfloat16):
        stale = torch.full((n_out, n_in), float("nan"), device=device, dtype=dtype)
        fresh = GradTarget(stale, accumulate=False)
        backend.backward(saved, dy, w, need_dgrad=False, need_wgrad=True, target=fresh)
        if dtype == torch.float32:  # the same GEMM as dw's
            torch.testing.assert_close(stale, dw, rtol=0, atol=0)
        else:  # rounded once to bfloat16 (cuBLAS may pick another kernel for that output)
            torch.testing.assert_close(stale.float(), dw, rtol=2**-7, atol=1e-3 * dw.abs().max())
    # per-tensor FP8 is coarse but close: a few percent of the largest entry
    assert (dw - dy.T @ x).abs().max() < 0.1 * (dy.T @ x).abs().max()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton quantise runs on CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(8192, 2048), (80, 112), (1000, 48), (2304, 768), (64, 64)])
def test_cuda_quantise_equals_the_cpu_one_bit_for_bit(shape, dtype):
    from aligndp.lowp.recipe_fp8_tensor import quantize_tensor

    x = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    if shape == (64, 64):
        x.zero_()  # the amax floor: zeros, not 0 / 0
    cpu, gpu = quantize_tensor(x, transposed=True), quantize_tensor(x.cuda(), transposed=True)
    assert torch.equal(gpu.scale.cpu(), cpu.scale)
    assert torch.equal(gpu.data.cpu().view(torch.uint8), cpu.data.view(torch.uint8))
    assert torch.equal(
        gpu.data_t.cpu().view(torch.uint8), cpu.data.t().contiguous().view(torch.uint8)
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton quantise runs on CUDA")
def test_cuda_quantises_in_a_row_each_take_their_own_amax():
    """The amax workspace is reset by the last cast program, not by a launch of its own: a
    quantise after a larger tensor's must not see the larger amax (nor one after a grid of
    another size), and every FP8 view of the shared allocation is 256-byte aligned."""
    from aligndp.lowp.recipe_fp8_tensor import quantize_tensor

    gen = torch.Generator().manual_seed(2)
    for shape, magnitude in (((2048, 512), 1e3), ((80, 112), 1.0), ((4096, 48), 1e-2)):
        x = torch.randn(shape, generator=gen) * magnitude
        gpu, cpu = quantize_tensor(x.cuda(), transposed=True), quantize_tensor(x, transposed=True)
        assert torch.equal(gpu.scale.cpu(), cpu.scale), shape
        assert torch.equal(gpu.data_t.cpu().view(torch.uint8), cpu.data_t.view(torch.uint8))
        assert gpu.data.data_ptr() % 256 == gpu.data_t.data_ptr() % 256 == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("transposed", [False, True])
def test_cpu_quantise_ops_and_allocations_per_call(dtype, transposed):
    """[Note: quantise cost]: a quantise after the first on its device issues 6 aten ops (two
    more for the transpose, one more for a 16-bit input's float32 copy) and allocates its
    results (data, scale, the transpose) and one float32 intermediate; the result still
    equals the hand-worked quantise bit for bit."""
    from aligndp.lowp.recipe_fp8_tensor import quantize_tensor

    x = torch.randn(40, 48, generator=torch.Generator().manual_seed(3)).to(dtype)
    quantize_tensor(x)  # the first call on a device makes the E4M3_MAX divisor
    with CountOps() as count:
        q = quantize_tensor(x, transposed=transposed)
    assert len(count.ops) == 6 + 2 * transposed + (dtype != torch.float32), count.ops
    assert count.allocations == 3 + transposed, count.ops
    assert sum(op.startswith("aten.empty") or "new_" in op for op in count.ops) == 0
    assert torch.equal(q.data.float() * q.scale, by_hand(x))
    if transposed:
        assert torch.equal(q.data_t, q.data.t())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton quantise runs on CUDA")
def test_cuda_quantise_launches_twice_and_reuses_its_workspace():
    """[Note: quantise cost] on CUDA: two kernels per quantise (amax, cast); with a workspace
    (``grad_out`` in backward) a repeated size allocates nothing and returns the same
    storage; without one, one allocation per call."""
    from torch.profiler import ProfilerActivity, profile

    from aligndp.lowp.recipe_fp8_tensor import quantize_tensor

    x = torch.randn(1000, 48, device="cuda")
    workspace: dict = {}
    first = quantize_tensor(x, transposed=True, workspace=workspace)
    torch.cuda.synchronize()
    stats = torch.cuda.memory_stats()["allocation.all.allocated"]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        again = quantize_tensor(x * 2, transposed=True, workspace=workspace)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
    assert sum("amax_kernel" in k or "cast_kernel" in k for k in kernels) == 2, kernels
    # x * 2 allocates once; the quantise into the workspace does not
    assert torch.cuda.memory_stats()["allocation.all.allocated"] - stats == 1
    assert again.data.data_ptr() == first.data.data_ptr()
    assert torch.equal(again.scale.cpu(), quantize_tensor(x.cpu() * 2).scale)
    stats = torch.cuda.memory_stats()["allocation.all.allocated"]
    quantize_tensor(x, transposed=True)
    assert torch.cuda.memory_stats()["allocation.all.allocated"] - stats == 1


def test_all_zero_tensor_quantises_to_zeros():
    from aligndp.lowp.recipe_fp8_tensor import quantize_tensor

    q = quantize_tensor(torch.zeros(32, 16), transposed=True)
    assert q.scale > 0 and not q.data.float().any() and not q.data_t.float().any()


def test_one_outlier_sets_every_scale():
    """What the recipe gives up against blockwise scales: an outlier flushes small values."""
    x = torch.full((16, 16), 1e-3)
    x[0, 0] = 1e4
    q = get_backend("fp8-tensor").forward(x, torch.eye(16))
    # E4M3 rounds the outlier to a 3-bit mantissa: within 2**-4 of it
    assert q[1:].abs().max() == 0 and q[0, 0] == pytest.approx(1e4, rel=2**-4)


def test_registered_for_every_consumer():
    import argparse

    assert "fp8-tensor" in recipe_names()
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args(["--wgrad", "fp8-tensor"]).wgrad == "fp8-tensor"
    model = convert_to_mxfp8(
        nn.Sequential(nn.Linear(32, 48), nn.Linear(48, 10)), backend="fp8-tensor", layers="all"
    )
    assert isinstance(model[0], MXLinear) and not isinstance(model[1], MXLinear)  # head stays
    with pytest.raises(ValueError, match="in_features to be a multiple of 16"):
        MXLinear(24, 32, backend="fp8-tensor")


TOKENS, DIM, HIDDEN = 32, 48, 80


def make_net(cache_weight: bool = True) -> nn.Module:
    torch.manual_seed(0)
    return convert_to_mxfp8(
        MLP(DIM, HIDDEN, 5), backend="fp8-tensor", layers="all", cache_weight=cache_weight
    )


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(TOKENS, DIM, generator=g), torch.randint(0, 5, (TOKENS,), generator=g)


def check_fused_grads_match_per_rank_reference(sharding: str, rank: int, ws: int) -> None:
    model, opt = aligndp.parallelize(
        make_net(), sharding=sharding, wgrad="fp8-tensor", start_alignment=1, lr=0.0
    )
    for buf in model.flat_buffers:  # 16-byte starts come from the recipe alone (asked for 1)
        for view in buf.main_grads:
            assert view.data_ptr() % 16 == 0
    for step in range(2):
        F.cross_entropy(model(batch(rank, step)[0]), batch(rank, step)[1]).backward()
        ref = make_net()
        for r in range(ws):  # one process, each rank's micro-batch quantised on its own
            F.cross_entropy(ref(batch(r, step)[0]), batch(r, step)[1]).backward()
        expected = {n: p.grad / ws for n, p in ref.named_parameters()}
        for buf in model.flat_buffers:
            for b in range(len(buf.layout.buckets)):
                lo, hi = buf.layout.shard_range(b, rank)
                want = torch.zeros_like(buf.grad_data)
                for slot in buf.slots:
                    want[slot.start : slot.end] = expected[slot.name].flatten()
                # each rank's micro-batch quantised alike on both sides; fp32 adds the ws
                # per-rank GEMMs of TOKENS rows in another order
                assert_close(
                    buf.grad_data[lo:hi],
                    want[lo:hi],
                    f"step {step} bucket {b}",
                    order_tolerance(terms=ws * TOKENS),
                )
        opt.zero_grad()


@case(2, 3)
def case_fused_replicated(rank, ws):
    check_fused_grads_match_per_rank_reference("none", rank, ws)


@case(2)
def case_fused_zero1(rank, ws):
    check_fused_grads_match_per_rank_reference("zero1", rank, ws)


def check_cached_weights_equal_uncached(
    sharding: str, rank: int, overlap: bool, **optimizer
) -> None:
    """[Note: weights once per step] under DataParallel: 2 steps of 2 micro-batches (the first
    under ``no_sync``) give the outputs and params of the same run with ``cache_weight=False``,
    bit for bit. The updated weights reach the layers through the all-gather (ZeRO-1; layer-wise
    Muon on the ranks that do not own a matrix), which bumps no version counter; a
    ``param.data =`` write between micro-batches goes through the wrapped param's copy."""
    runs = []
    for cache in (True, False):
        net = make_net(cache_weight=cache)
        model, opt = aligndp.parallelize(
            net,
            sharding=sharding,
            wgrad="fp8-tensor",
            overlap_param_gather=overlap,
            **({"lr": 0.05} | optimizer),
        )
        outputs = []
        for step in range(2):
            for micro in range(2):
                x, y = batch(rank, 10 * step + micro)
                if step == 1 and micro == 1:
                    first = next(m for m in net.modules() if isinstance(m, MXLinear))
                    first.weight.data = first.weight.detach() * 0.5
                sync = model.no_sync() if micro == 0 else contextlib.nullcontext()
                with sync:
                    out = model(x)
                    F.cross_entropy(out, y).backward()
                outputs.append(out.detach())
            opt.step()
            opt.zero_grad()
        model.wait_for_params()
        runs.append((outputs, [p.detach().clone() for p in net.parameters()]))
    (out_c, params_c), (out_p, params_p) = runs
    for i, (a, b) in enumerate(zip(out_c, out_p)):
        assert torch.equal(a, b), f"{sharding}: forward {i} differs with the weight cache"
    for i, (a, b) in enumerate(zip(params_c, params_p)):
        assert torch.equal(a, b), f"{sharding}: param {i} differs with the weight cache"


def check_cached_weights_follow_a_load(rank: int) -> None:
    """A model-space state load outside any step (what ``aligndp.load`` does) writes the
    params through the all-gather (no version bump, no optimizer step): a layer that cached
    the weights it had before the load quantises the loaded ones, as one without cache does."""
    trained, opt = aligndp.parallelize(make_net(), sharding="zero1", wgrad="fp8-tensor", lr=0.05)
    x, y = batch(rank, 0)
    F.cross_entropy(trained(x), y).backward()
    opt.step()
    opt.zero_grad()
    state = opt.model_space_state_dict()  # owned params and optimizer state, by name
    outputs = []
    for cache in (True, False):
        net = make_net(cache_weight=cache)
        model, opt = aligndp.parallelize(net, sharding="zero1", wgrad="fp8-tensor", lr=0.05)
        x, _ = batch(rank, 1)
        with torch.no_grad():
            before = model(x)  # quantises (and caches) the weights as built
            opt.load_model_space_state_dict(state)
            outputs.append(model(x))
    assert not torch.equal(before, outputs[1]), "the load changed no weight: the test is moot"
    assert torch.equal(outputs[0], outputs[1]), "a cached layer kept its weights across a load"


@case(2)
def case_cached_weights_zero1(rank, ws):
    check_cached_weights_follow_a_load(rank)
    check_cached_weights_equal_uncached("zero1", rank, overlap=False)
    check_cached_weights_equal_uncached("zero1", rank, overlap=True)
    check_cached_weights_equal_uncached("zero1", rank, overlap=False, optimizer="muon")


@case(2)
def case_cached_weights_replicated(rank, ws):
    check_cached_weights_equal_uncached("none", rank, overlap=False)


make_tests(globals())
