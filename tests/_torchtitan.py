"""torchtitan's own Llama-3 model, at a tiny size, for the tests that train it.

torchtitan 0.3.0 imports ``triton`` when its model package loads, for the MoE expert-parallel
kernels of ``torchtitan.distributed.minimal_async_ep``; CPU torch wheels have no triton. The
Llama-3 model never calls those kernels, so that one package is stood in for while torchtitan
loads (and removed after): everything the model runs is torchtitan's own code."""

from __future__ import annotations

import importlib.util
import sys
from unittest import mock

import pytest
import torch

_EP = "torchtitan.distributed.minimal_async_ep"


def import_llama3():
    """``(torchtitan.models.llama3, torchtitan.models.common)``; skips where torchtitan is
    not installed."""
    pytest.importorskip("torchtitan")
    stand_in = importlib.util.find_spec("triton") is None and _EP not in sys.modules
    if stand_in:
        sys.modules[_EP] = mock.MagicMock()
    try:
        import torchtitan.models.common as common
        import torchtitan.models.llama3 as llama3
    finally:
        if stand_in:
            del sys.modules[_EP]
    return llama3, common


def tiny_llama3(*, dim=64, n_heads=4, n_layers=2, vocab=256, seed=0) -> torch.nn.Module:
    """A Llama-3 model built from torchtitan's own config classes (its ``debugmodel``
    recipe at a smaller width), its params initialised by torchtitan's ``init_states``.

    Attention is torchtitan's ``ScaledDotProductAttention`` (causal) instead of its default
    FlexAttention, which has no backward on CPU; with one document per sequence the two
    compute the same block-causal attention."""
    llama3, common = import_llama3()
    from torchtitan.models.common.attention import ScaledDotProductAttention

    norm = {"weight": torch.nn.init.ones_}
    std = {"weight": lambda w: torch.nn.init.trunc_normal_(w, std=0.02)}
    config = llama3.Llama3Model.Config(
        dim=dim,
        vocab_size=vocab,
        tok_embeddings=common.Embedding.Config(
            num_embeddings=vocab, embedding_dim=dim, param_init=std
        ),
        norm=common.RMSNorm.Config(normalized_shape=dim, param_init=norm),
        lm_head=common.Linear.Config(in_features=dim, out_features=vocab, param_init=std),
        layers=llama3._build_llama3_layers(
            n_layers=n_layers,
            dim=dim,
            n_heads=n_heads,
            hidden_dim=common.compute_ffn_hidden_dim(dim, multiple_of=32),
            rope=common.ComplexRoPE.Config(
                dim=dim // n_heads, max_seq_len=256, theta=500000, scaling="llama"
            ),
            attn_backend="flex",
        ),
    )
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    torch.manual_seed(seed)
    model = config.build()
    model.init_states()
    return model


def llama3_loss(model, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of ``model`` on ``tokens`` (batch, seq + 1)."""
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    positions = torch.arange(inputs.shape[1]).expand_as(inputs)
    logits = model(inputs, positions)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
