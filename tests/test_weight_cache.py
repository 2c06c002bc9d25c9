"""MXLinear's quantised-weight cache ([Note: weights once per step] in aligndp/lowp/linear.py).

The reference is the same layer built with ``cache_weight=False``, which quantises its weight
in every forward: with the same inputs and weights both run the same ops on the same values,
so they agree bit for bit, and any stale cached byte shows as a difference. How often a
weight is quantised is counted at the quantisers the backends call (``quantize_tensor`` of
the fp8-tensor recipe, ``quantize_mxfp8`` of the reference backend), on calls whose input is
the weight itself.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import aligndp.lowp.backends as ref_backend
import aligndp.lowp.recipe_fp8_tensor as fp8_tensor
from aligndp.lowp import MXLinear, convert_to_mxfp8

BACKENDS = ["reference", "fp8-tensor"]
LAYOUTS = {"reference": 2, "fp8-tensor": 1}
"""Quantiser calls one weight quantise makes: the reference quantises along each GEMM's
contraction dim (in-features for forward, out-features for dgrad); fp8-tensor once, writing
both layouts."""
MICRO = 4


@pytest.fixture
def weight_quantises(monkeypatch):
    """``count(weight)``: quantiser calls on ``weight``'s values since the fixture started."""
    calls: list[tuple[int, int, tuple]] = []

    def counting(module, name):
        inner = getattr(module, name)

        def wrapper(t, *args, **kwargs):
            calls.append((t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape)))
            return inner(t, *args, **kwargs)

        monkeypatch.setattr(module, name, wrapper)

    counting(fp8_tensor, "quantize_tensor")
    counting(ref_backend, "quantize_mxfp8")

    def count(weight: torch.Tensor) -> int:
        key = (weight.untyped_storage().data_ptr(), weight.storage_offset(), tuple(weight.shape))
        return sum(c == key for c in calls)

    return count


def pair(backend: str, n_in: int = 64, n_out: int = 32) -> tuple[MXLinear, MXLinear]:
    """The same layer twice: cached, and quantising its weight per forward."""
    torch.manual_seed(0)
    lin = nn.Linear(n_in, n_out)
    cached = MXLinear.from_linear(copy.deepcopy(lin), backend=backend)
    plain = MXLinear.from_linear(copy.deepcopy(lin), backend=backend, cache_weight=False)
    return cached, plain


def micro_batch(i: int, n_in: int = 64) -> torch.Tensor:
    return torch.randn(16, n_in, generator=torch.Generator().manual_seed(i))


def run(layer: nn.Module, i: int) -> torch.Tensor:
    """One micro-batch forward and backward; the output, detached."""
    y = layer(micro_batch(i))
    y.square().sum().backward()
    return y.detach()


def assert_same(cached: nn.Module, plain: nn.Module, y_cached, y_plain, what: str) -> None:
    assert torch.equal(y_cached, y_plain), f"{what}: outputs differ"
    for (name, a), b in zip(cached.named_parameters(), plain.parameters()):
        assert torch.equal(a.grad, b.grad), f"{what}: {name}.grad differs"


@pytest.mark.parametrize("backend", BACKENDS)
def test_micro_batches_quantise_each_weight_once_per_step(backend, weight_quantises):
    """4 micro-batches of plain gradient accumulation quantise each weight once per step; the
    layer without cache quantises it in each forward (and, on the reference path, each
    dgrad); both agree bit for bit; the optimizer's step makes the next forward quantise
    again."""
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 32), nn.Linear(32, 8))
    plain = convert_to_mxfp8(
        copy.deepcopy(module), backend=backend, layers="all", cache_weight=False
    )
    net = convert_to_mxfp8(module, backend=backend, layers="all")
    layers = [m for m in net.modules() if isinstance(m, MXLinear)]
    plain_layers = [m for m in plain.modules() if isinstance(m, MXLinear)]
    assert len(layers) == 2  # the head stays nn.Linear
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (net, plain)]
    for step in range(2):
        before = [weight_quantises(m.weight) for m in layers + plain_layers]
        for i in range(MICRO):
            x = micro_batch(10 * step + i).requires_grad_()  # every layer runs its dgrad
            y, y_plain = net(x), plain(x)
            assert torch.equal(y, y_plain)
            y.square().sum().backward()
            y_plain.square().sum().backward()
        after = [weight_quantises(m.weight) for m in layers + plain_layers]
        done = [a - b for a, b in zip(after, before)]
        per_step = LAYOUTS[backend]
        assert done[:2] == [per_step] * 2, f"step {step}: cached layers quantised {done[:2]}"
        assert done[2:] == [per_step * MICRO] * 2, f"step {step}: plain layers {done[2:]}"
        for a, b in zip(net.parameters(), plain.parameters()):
            assert torch.equal(a.grad, b.grad)
        for opt in opts:
            opt.step()
            opt.zero_grad()


def _optimizer_step(layer: MXLinear) -> None:
    torch.optim.SGD(layer.parameters(), lr=0.5).step()


def _fused_adamw_step(layer: MXLinear) -> None:
    # torch's fused optimizers write the params without bumping their version counters
    torch.optim.AdamW(layer.parameters(), lr=0.5, fused=True).step()


def _foreach_adamw_step(layer: MXLinear) -> None:
    torch.optim.AdamW(layer.parameters(), lr=0.5, foreach=True).step()


def _add_in_place(layer: MXLinear) -> None:
    with torch.no_grad():
        layer.weight.add_(0.25)


def _load_state_dict(layer: MXLinear) -> None:
    sd = {k: v * 3 for k, v in layer.state_dict().items()}
    layer.load_state_dict(sd)


def _assign_data(layer: MXLinear) -> None:
    layer.weight.data = layer.weight.data * -2


def _new_parameter(layer: MXLinear) -> None:
    layer.weight = nn.Parameter(layer.weight.detach() + 1)


def _to_bf16(layer: MXLinear) -> None:
    layer.to(torch.bfloat16)


def _data_write_then_drop(layer: MXLinear) -> None:
    # invisible to the version counter (as to autograd): the documented way is to drop
    layer.weight.data.mul_(0.5)
    layer.drop_quantised_weight()


CHANGES = [
    _optimizer_step,
    _fused_adamw_step,
    _foreach_adamw_step,
    _add_in_place,
    _load_state_dict,
    _assign_data,
    _new_parameter,
    _to_bf16,
    _data_write_then_drop,
]


@pytest.mark.parametrize("change", CHANGES, ids=lambda f: f.__name__.strip("_"))
@pytest.mark.parametrize("backend", BACKENDS)
def test_weight_changed_between_micro_batches_is_quantised_again(backend, change):
    """A weight changed between micro-batches (optimizer, in-place add, load_state_dict,
    ``.data =``, a new Parameter, a dtype change, a ``.data`` write and a drop) gives the
    result of a layer without cache, bit for bit."""
    cached, plain = pair(backend)
    assert_same(cached, plain, run(cached, 0), run(plain, 0), "first micro-batch")
    for layer in (cached, plain):
        change(layer)
    dtype = cached.weight.dtype

    def run_in(layer, i):
        y = layer(micro_batch(i).to(dtype))
        y.float().square().sum().backward()
        return y.detach()

    for i in (1, 2):  # the second hits the cache made by the first
        assert_same(cached, plain, run_in(cached, i), run_in(plain, i), f"{change.__name__} {i}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_set_quantised_weight_is_used_until_the_weight_changes(backend):
    """Bytes handed in by ``set_quantised_weight`` (as an FP8 all-gather would) are what the
    forward reads while the weight is unchanged; a change to the weight quantises afresh."""
    cached, plain = pair(backend)
    x = micro_batch(0)
    other = copy.deepcopy(plain)
    with torch.no_grad():
        other.weight.mul_(2)
    cached.set_quantised_weight(cached.backend.quantize_weight(other.weight))
    assert torch.equal(cached(x), other(x))  # the handed-in bytes, not the weight's own
    _add_in_place(cached)
    _add_in_place(plain)
    assert torch.equal(cached(x), plain(x))


def test_cache_stays_out_of_the_compiled_graph():
    """Under torch.compile the layer reads no cache (the quantise is in the graph): a weight
    changed between calls through ``.data`` (invisible to the version counter) still gives
    the new result, and the eager cache is left as it was."""
    cached, plain = pair("fp8-tensor")
    x = micro_batch(0)
    compiled = torch.compile(cached, backend="eager", fullgraph=True)
    assert torch.equal(compiled(x), plain(x))
    assert cached._cached is None
    cached.weight.data.mul_(0.5)
    plain.weight.data.mul_(0.5)
    assert torch.equal(compiled(x), plain(x))


def test_grad_accumulation_matches_under_no_grad_eval_and_autocast():
    """The cached weight is quantised without autograd and without autocast: a first call under
    autocast or in eval leaves no graph on the cache and no bf16 weight in it."""
    cached, plain = pair("fp8-tensor")
    x = micro_batch(0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(cached(x), plain(x))
    quantised = cached.quantised_weight()
    assert quantised.data.grad_fn is None and quantised.scale.dtype == torch.float32
    with torch.no_grad():
        assert torch.equal(cached(x), plain(x))
    y, y_plain = cached(x), plain(x)
    F.mse_loss(y, torch.zeros_like(y)).backward()
    F.mse_loss(y_plain, torch.zeros_like(y_plain)).backward()
    assert torch.equal(cached.weight.grad, plain.weight.grad)


def test_pickled_and_copied_without_the_cache():
    """A layer that has run pickles (weak references would not) and deep-copies without its
    cache; the copy computes what the original does."""
    import pickle

    cached, plain = pair("fp8-tensor")
    x = micro_batch(0)
    cached(x)
    for twin in (pickle.loads(pickle.dumps(cached)), copy.deepcopy(cached)):
        assert twin._cached is None
        assert torch.equal(twin(x), plain(x))
    assert cached._cached is not None
