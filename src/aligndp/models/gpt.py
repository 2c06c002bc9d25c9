"""A small, clean GPT. It knows nothing about parallelism or aligndp."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from aligndp.models.presets import PRESETS, GPTConfig

__all__ = ["GPTConfig", "GPT", "PRESETS"]


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.ln1 = nn.LayerNorm(cfg.dim)
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=cfg.bias)
        self.proj = nn.Linear(cfg.dim, cfg.dim, bias=cfg.bias)
        self.ln2 = nn.LayerNorm(cfg.dim)
        self.fc = nn.Linear(cfg.dim, cfg.mlp_width, bias=cfg.bias)
        self.out = nn.Linear(cfg.mlp_width, cfg.dim, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        # (B, T, 3D) -> 3 x (B, heads, T, head_dim)
        q, k, v = (
            self.qkv(self.ln1(x))
            .view(B, T, 3, self.num_heads, D // self.num_heads)
            .permute(2, 0, 3, 1, 4)
        )
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, heads, T, head_dim)
        x = x + self.proj(a.transpose(1, 2).reshape(B, T, D))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Token + learned position embeddings, pre-norm blocks, final norm, linear head."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos = nn.Embedding(cfg.seq_len, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.ln = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tied:
            self.head.weight = self.tok.weight
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (B, T, vocab), or the mean cross-entropy when ``targets`` is given."""
        T = idx.shape[1]
        if T > self.cfg.seq_len:
            raise ValueError(f"sequence of {T} tokens is longer than seq_len={self.cfg.seq_len}")
        x = self.tok(idx) + self.pos(torch.arange(T, device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))
