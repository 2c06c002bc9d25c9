"""Which layers a recipe converts by default ([Note: layers that pay] in lowp/layer_rule.py).

Reference: torchao 0.18's own auto filters (the figures the rule cites) where torchao is
importable, and the GPT presets' shapes worked by hand.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

from aligndp.lowp import MXLinear, convert_to_mxfp8, layer_rule
from aligndp.lowp.linear import conversion_plan
from aligndp.models.gpt import GPT, PRESETS

HOPPER, BLACKWELL, ADA, AMPERE = (9, 0), (10, 0), (8, 9), (8, 0)

try:
    from torchao.float8.float8_linear_utils import (
        _auto_filter_for_rowwise,
        _auto_filter_for_tensorwise,
    )
except ImportError:
    _auto_filter_for_rowwise = _auto_filter_for_tensorwise = None


def meta_gpt(preset: str) -> nn.Module:
    with torch.device("meta"):
        return GPT(PRESETS[preset])


def converted(preset: str, recipe: str, capability, layers="pays") -> set[str]:
    plan = conversion_plan(meta_gpt(preset), recipe, capability=capability, layers=layers)
    return {name.split(".")[-1] for name, why in plan if not why}


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(layer_rule, "_WARNED", set())


def test_gpt_presets_by_hand():
    """gpt2-small (dim 768): qkv 768->2304, proj 768->768, fc 768->3072, out 3072->768.
    Tensorwise skips in <= 4096 and out <= 1024: proj and out stay. Rowwise skips in <= 1024:
    every layer stays. 1b (dim 2048): qkv 2048->6144, proj 2048->2048, fc 2048->8192,
    out 8192->2048: tensorwise converts all four; rowwise skips out <= 2048 (proj, out)."""
    assert converted("gpt2-small", "fp8-tensor", HOPPER) == {"qkv", "fc"}
    assert converted("gpt2-small", "fp8", HOPPER) == set()
    assert converted("1b", "fp8-tensor", HOPPER) == {"qkv", "proj", "fc", "out"}
    assert converted("1b", "fp8", HOPPER) == {"qkv", "fc"}
    assert converted("1b", "fp8-tensor", ADA) == {"qkv", "proj", "fc", "out"}
    with pytest.warns(UserWarning, match="no fast path on sm_80"):  # no FP8 tensor cores
        assert converted("1b", "fp8-tensor", AMPERE) == set()
    assert converted("1b", "mxfp8", BLACKWELL) == {"qkv", "fc"}
    assert converted("1b", "mxfp8", HOPPER, layers="all") == {"qkv", "proj", "fc", "out"}
    head = dict(conversion_plan(meta_gpt("1b"), "fp8-tensor", capability=HOPPER))["head"]
    assert "last Linear" in head


@pytest.mark.skipif(_auto_filter_for_tensorwise is None, reason="torchao is not importable")
@pytest.mark.parametrize("recipe", ["fp8-tensor", "fp8", "mxfp8"])
def test_rule_agrees_with_torchaos_filters(recipe):
    """Every Linear of every preset but the head: converted exactly where torchao's filter for
    the cited recipe would convert it (tensorwise for per-tensor, rowwise for the blockwise)."""
    torchao_filter = (
        _auto_filter_for_tensorwise if recipe == "fp8-tensor" else _auto_filter_for_rowwise
    )
    for preset in ("gpt2-small", "gpt2-medium", "1b"):
        model = meta_gpt(preset)
        plan = dict(conversion_plan(model, recipe, capability=BLACKWELL))
        for name, module in model.named_modules():
            if type(module) is nn.Linear and name != "head":
                assert (not plan[name]) == torchao_filter(module, name, []), (preset, name)


def test_no_fast_path_converts_nothing_and_warns_once():
    """MXFP8 on Hopper is emulated and no CPU has a fast path: the default converts nothing
    and warns once per recipe and device; layers='all' converts as before, silently."""
    with pytest.warns(UserWarning, match=r"'mxfp8' has no fast path on sm_90 .*layers='all'"):
        assert converted("1b", "mxfp8", HOPPER) == set()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert converted("1b", "mxfp8", HOPPER) == set()  # second time: no warning
        assert converted("1b", "mxfp8", HOPPER, layers="all")
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 32))
    with pytest.warns(UserWarning, match="'fp8-tensor' has no fast path on a CPU"):
        convert_to_mxfp8(model, backend="fp8-tensor")
    assert type(model[0]) is nn.Linear
    assert isinstance(convert_to_mxfp8(model, backend="fp8-tensor", layers="all")[0], MXLinear)


def test_filter_overrides_and_bad_layers_value():
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 32))
    convert_to_mxfp8(model, filter=lambda name, m: name == "1")  # even the head, by request
    assert type(model[0]) is nn.Linear and isinstance(model[1], MXLinear)
    with pytest.raises(ValueError, match="layers must be 'pays' or 'all', got 'some'"):
        convert_to_mxfp8(nn.Sequential(nn.Linear(64, 64)), layers="some")
