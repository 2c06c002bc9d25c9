"""route_params: which params Muon steps (block matrices) and which AdamW steps (the rest)."""

from __future__ import annotations

import dataclasses

import pytest
import torch.nn as nn

from aligndp.models.gpt import GPT, PRESETS
from aligndp.plan.routing import Routing, route_params

BLOCK_MATRICES = ("qkv.weight", "proj.weight", "fc.weight", "out.weight")


def gpt(preset: str, **changes) -> GPT:
    return GPT(dataclasses.replace(PRESETS[preset], **changes))


def block_matrices(num_layers: int) -> tuple[str, ...]:
    return tuple(f"blocks.{i}.{m}" for i in range(num_layers) for m in BLOCK_MATRICES)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("preset", ["demo", "tiny-odd"])
def test_gpt_routes_exactly_the_block_matrices_to_muon(preset, tied):
    model = gpt(preset, tied=tied)
    routing = route_params(model)
    assert routing.whole == block_matrices(model.cfg.num_layers)
    names = [n for n, _ in model.named_parameters()]
    assert sorted(routing.whole + routing.adamw) == sorted(names), "every param routed exactly once"
    why = dict(routing.reasons)
    assert why["tok.weight"] == "embedding" and why["pos.weight"] == "embedding"
    if tied:
        assert "head.weight" not in names  # the head IS tok.weight, routed once as the embedding
    else:
        assert why["head.weight"] == "output head"
    assert all(
        why[n] == "1-D"
        for n in routing.adamw
        if n.endswith("bias") or ".ln" in n or n.startswith("ln.")
    )


def test_gpt_1b_on_meta_has_64_muon_matrices():
    import torch

    with torch.device("meta"):
        model = GPT(PRESETS["1b"])
    assert len(route_params(model).whole) == 64


def test_tied_head_detected_by_identity_under_any_name():
    """A tied head named like a hidden layer is still the embedding tensor: AdamW."""

    class TiedUnderOtherNames(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(10, 4)
            self.hidden = nn.Linear(4, 4)
            self.decoder = nn.Linear(4, 10, bias=False)
            self.decoder.weight = self.embed.weight

    routing = route_params(TiedUnderOtherNames())
    assert routing.whole == ("hidden.weight",)
    assert routing.optimizer_of("embed.weight") == "adamw"


def test_override_by_predicate_and_by_pattern():
    model = gpt("demo")
    only_mlp = route_params(
        model,
        muon_filter=lambda name, p, module: (
            isinstance(module, nn.Linear)
            and p.ndim == 2
            and name.endswith(("fc.weight", "out.weight"))
        ),
    )
    assert only_mlp.whole == tuple(
        n for n in block_matrices(2) if n.endswith(("fc.weight", "out.weight"))
    )
    by_pattern = route_params(model, muon_filter=["blocks.*.qkv.weight", "head.weight"])
    assert by_pattern.whole == ("blocks.0.qkv.weight", "blocks.1.qkv.weight", "head.weight")
    assert route_params(model, muon_filter="blocks.1.[qpfo]*.weight").whole == tuple(
        n for n in block_matrices(2) if n.startswith("blocks.1.")
    )


def test_frozen_params_are_not_routed():
    model = gpt("demo")
    model.blocks[0].requires_grad_(False)
    routing = route_params(model)
    assert routing.whole == block_matrices(2)[4:]
    with pytest.raises(KeyError, match="not routed"):
        routing.optimizer_of("blocks.0.qkv.weight")


def test_user_errors_are_clear():
    model = gpt("demo")
    with pytest.raises(ValueError, match=r"'ln\.weight' of shape \(64,\).*2-D"):
        route_params(model, muon_filter="ln.*")
    with pytest.raises(TypeError, match="muon_filter"):
        route_params(model, muon_filter=3)
    with pytest.raises(TypeError, match="nn.Module"):
        route_params("model")
    with pytest.raises(ValueError, match="both"):
        Routing(whole=("a",), adamw=("a",))


def test_printable():
    text = str(route_params(gpt("demo", tied=True)))
    assert (
        text.startswith("muon (8 matrices):")
        and "tok.weight  [embedding]" in text
        and "head" not in text
    )


def test_names_the_whole_matrix_optimizer_it_routes_for():
    routing = route_params(gpt("demo", tied=True), optimizer="soap")
    assert str(routing).startswith("soap (8 matrices):")
    assert routing.optimizer_of("blocks.0.qkv.weight") == "soap"
    assert routing.optimizer_of("tok.weight") == "adamw"
