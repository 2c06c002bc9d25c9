"""convert_to_mxfp8 on subclasses of nn.Linear ([Note: Linear subclasses]): a subclass that
adds only state or methods converts and keeps them; one whose behaviour MXLinear would replace
is kept and named; torchtitan's own Llama-3 model (whose every Linear is a subclass) converts."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn as nn
from torch.nn.utils import parametrize

from aligndp.lowp import MXLinear, convert_to_mxfp8
from aligndp.lowp.linear import conversion_plan
from aligndp.plan.fused import fused_wgrad_modules


class Tagged(nn.Linear):
    """Adds an attribute, a buffer and a method; nn.Linear's forward."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.tag = "kept"
        self.register_buffer("calls", torch.zeros(()))

    def double_weight_norm(self) -> torch.Tensor:
        return 2 * self.weight.norm()


class OwnForward(nn.Linear):
    def forward(self, x):
        return super().forward(x) * 2


class OwnRepr(nn.Linear):
    def extra_repr(self) -> str:
        return "mine"


class HasBackendAttr(nn.Linear):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.backend = "cuBLAS"


def test_subclass_converts_keeping_its_class_state_and_methods():
    torch.manual_seed(0)
    layer = Tagged(64, 96)
    plain = nn.Linear(64, 96)
    plain.load_state_dict(layer.state_dict(), strict=False)
    params, keys = list(layer.parameters()), layer.state_dict().keys()
    hooked = []
    layer.register_forward_hook(lambda *a: hooked.append(1))
    model = nn.Sequential(layer, nn.Linear(96, 32))
    convert_to_mxfp8(model, layers="all")
    new = model[0]
    assert isinstance(new, MXLinear) and isinstance(new, Tagged)
    assert type(new).__name__ == "MXTagged" and type(model[1]) is nn.Linear  # head kept
    assert new.tag == "kept" and new.calls is layer.calls
    assert all(a is b for a, b in zip(new.parameters(), params))
    assert new.state_dict().keys() == keys
    torch.testing.assert_close(new.double_weight_norm(), 2 * layer.weight.norm())
    x = torch.randn(32, 64)
    # the same quantised GEMMs as an exact nn.Linear converted
    torch.testing.assert_close(new(x), MXLinear.from_linear(plain)(x), rtol=0, atol=0)
    assert not torch.equal(new(x), layer(x))  # ... and not the float GEMM
    assert hooked  # the layer's hooks came along
    # the original keeps its own dicts: converting did not change it
    assert type(layer) is Tagged and "backend" not in vars(layer)
    # one class per subclass; copies and pickles keep it
    other = convert_to_mxfp8(nn.Sequential(Tagged(64, 96), nn.Linear(96, 8)), layers="all")
    assert type(other[0]) is type(new)
    for copied in (copy.deepcopy(other[0]), pickle.loads(pickle.dumps(other[0]))):
        assert type(copied) is type(new) and copied.tag == "kept"
        assert copied.weight is not other[0].weight
        torch.testing.assert_close(copied(x), other[0](x), rtol=0, atol=0)


@pytest.mark.parametrize(
    ("cls", "named"),
    [(OwnForward, "defines forward"), (OwnRepr, "defines extra_repr"), (HasBackendAttr, "backend")],
)
def test_subclass_that_would_lose_behaviour_is_kept_and_named(cls, named):
    model = nn.Sequential(cls(64, 64), nn.Linear(64, 8))
    plan = dict(conversion_plan(model, "mxfp8", layers="all"))
    assert named in plan["0"] and "MXLinear would replace" in plan["0"]
    convert_to_mxfp8(model, layers="all")
    assert type(model[0]) is cls
    with pytest.raises(ValueError, match=f"cannot convert this {cls.__name__}: .*{named}"):
        convert_to_mxfp8(model, filter=lambda name, m: name == "0")


def test_multihead_attention_projection_and_parametrized_weights_are_kept():
    mha = nn.Sequential(nn.MultiheadAttention(64, 4), nn.Linear(64, 8))
    plan = dict(conversion_plan(mha, "mxfp8", layers="all"))
    assert "NonDynamicallyQuantizableLinear" in plan["0.out_proj"]
    convert_to_mxfp8(mha, layers="all")
    assert not isinstance(mha[0].out_proj, MXLinear)

    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8))
    parametrize.register_parametrization(model[0], "weight", nn.Identity())
    assert "parametrized" in dict(conversion_plan(model, "mxfp8", layers="all"))["0"]
    convert_to_mxfp8(model, layers="all")
    assert not isinstance(model[0], MXLinear)


def test_torchtitan_llama3_converts():
    from tests._torchtitan import import_llama3, llama3_loss, tiny_llama3

    _, common = import_llama3()
    model = tiny_llama3()
    reference = copy.deepcopy(model)
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    assert {type(model.get_submodule(n)) for n in linears} == {common.Linear}  # no nn.Linear
    convert_to_mxfp8(model, layers="all")
    converted = [n for n, _ in fused_wgrad_modules(model)]
    assert converted == [n for n in linears if n != "lm_head"]  # the head stays high precision
    layer = model.get_submodule(converted[0])
    assert isinstance(layer, common.Linear) and isinstance(layer, MXLinear)
    layer.init_states()  # torchtitan's own param init still works on a converted layer
    model.load_state_dict(reference.state_dict())
    tokens = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(0))
    loss, ref = llama3_loss(model, tokens), llama3_loss(reference, tokens)
    loss.backward()
    assert 0 < abs(loss.item() - ref.item()) < 0.05 * ref.item()  # quantised, and close
    assert all(p.grad is not None for p in model.parameters())
