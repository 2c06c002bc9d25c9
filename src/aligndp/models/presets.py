"""The GPT's shape (:class:`GPTConfig`) and the named presets, without torch: the CLI lists them
(with their sizes) in ``--help`` before any heavy import."""

from __future__ import annotations

import dataclasses

__all__ = ["GPTConfig", "PRESETS", "describe_presets"]


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

    @property
    def num_params(self) -> int:
        """Trainable elements of ``GPT(self)`` (a tied head counted once), from the shapes."""
        d, hidden, bias = self.dim, self.mlp_width, int(self.bias)
        block = (
            2 * 2 * d  # two LayerNorms
            + d * 3 * d
            + bias * 3 * d  # qkv
            + d * d
            + bias * d  # proj
            + d * hidden
            + bias * hidden  # fc
            + hidden * d
            + bias * d  # out
        )
        embeddings = (self.vocab_size + self.seq_len) * d
        head = 0 if self.tied else d * self.vocab_size
        return embeddings + self.num_layers * block + 2 * d + head


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


def _size(numel: int) -> str:
    if numel >= 1e9:
        return f"{numel / 1e9:.2f} B"
    return f"{numel / 1e6:.1f} M" if numel >= 1e6 else f"{numel / 1e3:.0f} k"


def describe_presets() -> str:
    """``demo (107 k params), tiny-odd (...), ...``: the presets for a help text."""
    return ", ".join(f"{name} ({_size(cfg.num_params)} params)" for name, cfg in PRESETS.items())
