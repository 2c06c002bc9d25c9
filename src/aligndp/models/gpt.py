"""A small, clean GPT. It knows nothing about parallelism or aligndp."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["GPTConfig", "GPT", "PRESETS"]


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Shape of a decoder-only transformer."""

    vocab_size: int = 256
    """Tokens in the vocabulary (256 for byte-level text)."""
    seq_len: int = 64
    """Longest context; the learned position table has this many rows."""
    dim: int = 64
    """Model width."""
    num_layers: int = 2
    """Transformer blocks."""
    head_dim: int = 16
    """Width of one attention head; ``dim`` must be a multiple of it."""
    mlp_ratio: int = 4
    """Hidden width of the MLP as a multiple of ``dim`` (unless ``mlp_hidden`` is given)."""
    mlp_hidden: int | None = None
    """Hidden width of the MLP in elements (Llama-3-8B: 14336); None: ``mlp_ratio * dim``."""
    tied: bool = False
    """Share the token embedding with the output head."""
    bias: bool = True
    """Linear layers carry biases."""

    def __post_init__(self) -> None:
        for field in ("vocab_size", "seq_len", "dim", "num_layers", "head_dim", "mlp_ratio"):
            if getattr(self, field) < 1:
                raise ValueError(f"GPTConfig.{field} must be >= 1, got {getattr(self, field)}")
        if self.mlp_hidden is not None and self.mlp_hidden < 1:
            raise ValueError(f"GPTConfig.mlp_hidden must be >= 1 or None, got {self.mlp_hidden}")
        if self.dim % self.head_dim:
            raise ValueError(
                f"GPTConfig.dim={self.dim} must be a multiple of head_dim={self.head_dim}"
            )

    @property
    def mlp_width(self) -> int:
        """Hidden width of the MLP."""
        return self.mlp_hidden if self.mlp_hidden is not None else self.mlp_ratio * self.dim

    @property
    def num_heads(self) -> int:
        return self.dim // self.head_dim


PRESETS: dict[str, GPTConfig] = {
    # CPU demo: ~0.2 M params, trains in seconds on 2 cores.
    "demo": GPTConfig(vocab_size=256, seq_len=64, dim=64, num_layers=2, head_dim=16),
    # Odd sizes on purpose (no dim a multiple of 64) to exercise padding.
    "tiny-odd": GPTConfig(vocab_size=97, seq_len=32, dim=40, num_layers=2, head_dim=10),
    "gpt2-small": GPTConfig(
        vocab_size=50257, seq_len=1024, dim=768, num_layers=12, head_dim=64, tied=True
    ),
    "gpt2-medium": GPTConfig(
        vocab_size=50257, seq_len=1024, dim=1024, num_layers=24, head_dim=64, tied=True
    ),
    # ~0.94 B params: the GPU benchmark model (same shapes as shared/anchors/peer_bench.py).
    "1b": GPTConfig(vocab_size=32768, seq_len=1024, dim=2048, num_layers=16, head_dim=128),
    # Llama-3-8B's shape (width 4096, 32 blocks, MLP 14336, vocabulary 128,256) in this GPT
    # block: 6.97 B params (Llama's 8.03 B has SwiGLU's third MLP matrix and 8 KV heads).
    "8b": GPTConfig(
        vocab_size=128256, seq_len=4096, dim=4096, num_layers=32, head_dim=128, mlp_hidden=14336
    ),
}


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
