"""Which layers a recipe converts by default ([Note: layers that pay] in lowp/layer_rule.py).

Reference: the rule as written in the note (the H200 sweep's figures), worked by hand on the
GPT presets' shapes and at its boundaries; torchao 0.18's rowwise filter for MXFP8, which
keeps torchao's figures, where torchao is importable.
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
    from torchao.float8.float8_linear_utils import _auto_filter_for_rowwise
except ImportError:
    _auto_filter_for_rowwise = None


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
    1b (dim 2048): qkv 2048->6144, proj 2048->2048, fc 2048->8192, out 8192->2048.
    Per-tensor and 1x128 convert in >= 2048 and out >= 2048: all four of 1b's. MXFP8
    (torchao rowwise, on Blackwell) skips out <= 2048 and in <= 2048 with out <= 4096: 1b's
    qkv and fc."""
    assert converted("gpt2-small", "fp8-tensor", HOPPER) == set()
    assert converted("gpt2-small", "fp8", HOPPER) == set()
    assert converted("1b", "fp8-tensor", HOPPER) == {"qkv", "proj", "fc", "out"}
    assert converted("1b", "fp8", HOPPER) == {"qkv", "proj", "fc", "out"}
    assert converted("1b", "fp8-tensor", ADA) == {"qkv", "proj", "fc", "out"}
    with pytest.warns(UserWarning, match="no fast path on sm_80"):  # no FP8 tensor cores
        assert converted("1b", "fp8-tensor", AMPERE) == set()
    assert converted("1b", "mxfp8", BLACKWELL) == {"qkv", "fc"}
    assert converted("1b", "mxfp8", HOPPER, layers="all") == {"qkv", "proj", "fc", "out"}
    head = dict(conversion_plan(meta_gpt("1b"), "fp8-tensor", capability=HOPPER))["head"]
    assert "last Linear" in head


@pytest.mark.parametrize(
    "recipe, in_features, out_features, converts",
    [
        ("fp8-tensor", 2048, 2048, True),  # 1b's proj, the smallest shape measured to pay
        ("fp8-tensor", 2032, 8192, False),  # in below 2048
        ("fp8-tensor", 8192, 2032, False),  # out below 2048
        ("fp8", 2048, 2048, True),  # the same box: 1b's proj
        ("fp8", 2016, 8192, False),  # in below 2048 (2016: a multiple of 32)
        ("fp8", 8224, 2016, False),  # out below 2048
        ("fp8", 8224, 2048, True),  # torchao's rowwise rule would skip out <= 2048
    ],
)
def test_rule_boundaries_by_hand(recipe, in_features, out_features, converts):
    """Each side of the written boundaries, one dim multiple (16 per-tensor, 32 for 1x128) away."""
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(in_features, out_features), nn.Linear(out_features, 16))
    plan = dict(conversion_plan(model, recipe, capability=HOPPER))
    assert (not plan["0"]) == converts, plan["0"]


@pytest.mark.skipif(_auto_filter_for_rowwise is None, reason="torchao is not importable")
def test_mxfp8_rule_agrees_with_torchaos_rowwise_filter():
    """Every Linear of every preset but the head: MXFP8 (unmeasured here: no fast path on
    Hopper) converts exactly where torchao's rowwise filter would."""
    for preset in ("gpt2-small", "gpt2-medium", "1b"):
        model = meta_gpt(preset)
        plan = dict(conversion_plan(model, "mxfp8", capability=BLACKWELL))
        for name, module in model.named_modules():
            if type(module) is nn.Linear and name != "head":
                assert (not plan[name]) == _auto_filter_for_rowwise(module, name, []), name


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


def test_the_plan_line_names_each_group_of_kept_layers_with_its_own_reason():
    """Issue 42, planted bug: the train/layout plan line gives each group of kept layers the
    reason the rule gave it, grouped by reason in first-seen order (hand-made plan)."""
    plan = [
        ("blocks.0.qkv", ""),
        ("blocks.0.proj", "too small"),
        ("blocks.1.qkv", ""),
        ("blocks.1.proj", "too small"),
        ("head", "the last Linear"),
        ("tied", "shares its weight"),
    ]
    line = layer_rule.describe_plan("fp8", plan)
    assert line == (
        "wgrad fp8: converts 2 of 6 Linear layers (blocks.*.qkv); keeps blocks.*.proj: too "
        "small; head: the last Linear; tied: shares its weight"
    ), line
