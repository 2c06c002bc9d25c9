"""Token data for ``aligndp train``: an embedded synthetic language, text files, token
``.bin`` files.

[Note: batches are functions of (seed, step)]
Every global batch is drawn from ``(seed, split, step)`` alone: the row offsets come from a
generator seeded with those three values, nothing carries over between steps. A rank reads
only its own rows of the global batch (rank r gets rows ``[r*B/dp, (r+1)*B/dp)``, and its
micro-batch m the m-th equal part of those), so

- the global batch is the same for any ``dp_size`` (1 rank and 2 ranks train on the same data),
- a resumed run sees exactly the batches the uninterrupted run would have seen.

Tokens are held as a NumPy array (a memory map for ``.bin`` files) and only the rows a rank
needs are gathered and turned into ``int64`` tensors.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import random
from typing import Literal, NamedTuple

import numpy as np
import torch

__all__ = ["BatchSpec", "Batch", "TokenData", "arithmetic_text"]

Split = Literal["train", "eval"]

VOCAB_SCAN_TOKENS = 1 << 26
"""check() compares the first this many tokens (128 MiB of a .bin file) with the model's vocab."""

SYNTHETIC_NAME = "synthetic arithmetic"
SYNTHETIC_BYTES = 1 << 20
"""Size of the embedded corpus: 1 MiB of equations (about 110,000 of them)."""


def arithmetic_text(num_bytes: int, *, seed: int = 0, max_operand: int = 99) -> bytes:
    """A deterministic synthetic language: sums such as ``"12+7=19;"``, exactly ``num_bytes`` long.

    Why this language: the operands are random (about 4.6 nats per operand), but everything
    else is determined: the ``+``, ``=`` and ``;`` and every digit of the sum. A byte-level
    model first learns the alphabet (14 of 256 bytes), then the grammar, then the sums, so the
    loss falls from ln(256) = 5.55 nats well below 2 within a few hundred small steps; the
    floor is about 1 nat per byte.
    """
    if num_bytes < 1:
        raise ValueError(f"num_bytes must be >= 1, got {num_bytes}")
    rng = random.Random(seed)
    parts: list[str] = []
    size = 0
    while size < num_bytes:
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        eq = f"{a}+{b}={a + b};"
        parts.append(eq)
        size += len(eq)
    return "".join(parts).encode("ascii")[:num_bytes]


@dataclasses.dataclass(frozen=True)
class BatchSpec:
    """How one global batch is cut into per-rank micro-batches."""

    batch_size: int
    """Sequences in one global batch (all ranks, all micro-batches of one optimizer step)."""
    seq_len: int
    """Tokens per sequence (inputs; targets are the same tokens shifted by one)."""
    dp_size: int = 1
    """Data-parallel ranks sharing the global batch."""
    micro_batches: int = 1
    """Micro-batches per rank per step (gradient accumulation)."""

    def __post_init__(self) -> None:
        for field in ("batch_size", "seq_len", "dp_size", "micro_batches"):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{field} must be an integer >= 1, got {value!r}")
        parts = self.dp_size * self.micro_batches
        if self.batch_size % parts:
            lower, upper = self.batch_size // parts * parts, -(-self.batch_size // parts) * parts
            raise ValueError(
                f"batch size {self.batch_size} does not split into {self.dp_size} rank(s) x "
                f"{self.micro_batches} micro-batch(es) = {parts} equal parts; use a batch size "
                f"that is a multiple of {parts} (e.g. {upper}" + (f" or {lower})" if lower else ")")
            )

    @property
    def rows_per_rank(self) -> int:
        return self.batch_size // self.dp_size

    @property
    def rows_per_micro_batch(self) -> int:
        return self.rows_per_rank // self.micro_batches

    def rows(self, rank: int, micro_batch: int = 0) -> range:
        """Rows of the global batch that ``rank`` reads for micro-batch ``micro_batch``."""
        if not 0 <= rank < self.dp_size:
            raise ValueError(f"rank {rank} is outside [0, {self.dp_size})")
        if not 0 <= micro_batch < self.micro_batches:
            raise ValueError(f"micro_batch {micro_batch} is outside [0, {self.micro_batches})")
        start = rank * self.rows_per_rank + micro_batch * self.rows_per_micro_batch
        return range(start, start + self.rows_per_micro_batch)


class Batch(NamedTuple):
    inputs: torch.Tensor
    """(rows, seq_len) int64 token ids."""
    targets: torch.Tensor
    """(rows, seq_len) int64: ``inputs`` shifted left by one token."""


def _step_seed(seed: int, split: str, step: int) -> int:
    """A 63-bit generator seed for one (seed, split, step); unrelated for neighbouring steps."""
    digest = hashlib.sha256(f"aligndp-data:{seed}:{split}:{step}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


class TokenData:
    """A 1-D token stream split into train (first part) and held-out eval (last part)."""

    def __init__(
        self, tokens: np.ndarray, *, vocab_size: int, name: str, eval_fraction: float = 0.1
    ):
        if tokens.ndim != 1:
            raise ValueError(f"{name}: tokens must be 1-D, got shape {tokens.shape}")
        if not 0.0 < eval_fraction < 1.0:
            raise ValueError(f"eval_fraction must lie in (0, 1), got {eval_fraction}")
        self.tokens = tokens
        self.vocab_size = vocab_size
        self.name = name
        self.model_vocab_size: int | None = None
        """Set by :meth:`check`; then every batch checks that its token ids fit."""
        num_eval = max(1, int(len(tokens) * eval_fraction))
        self.splits: dict[str, np.ndarray] = {
            "train": tokens[: len(tokens) - num_eval],
            "eval": tokens[len(tokens) - num_eval :],
        }

    def __len__(self) -> int:
        return len(self.tokens)

    @classmethod
    def synthetic(cls, num_bytes: int = SYNTHETIC_BYTES) -> TokenData:
        """The embedded default: :func:`arithmetic_text`, byte-level (vocab 256); no download."""
        text = arithmetic_text(num_bytes)
        return cls(np.frombuffer(text, dtype=np.uint8), vocab_size=256, name=SYNTHETIC_NAME)

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> TokenData:
        """A nanoGPT-style ``.bin`` file (uint16 token ids, memory-mapped) or any other file as
        bytes.

        Text files are byte-level (vocab 256); ``.bin`` files report vocab 65536 until
        :meth:`check_vocab` compares their largest token id with the model's vocabulary.
        """
        path = os.fspath(path)
        if os.path.isdir(path):
            raise ValueError(
                f"--data {path} is a directory; give one file: text (read as bytes) or a "
                "nanoGPT-style .bin of uint16 tokens"
            )
        if not os.path.isfile(path):
            raise ValueError(f"--data {path}: no such file (relative paths start at {os.getcwd()})")
        size = os.path.getsize(path)
        if size == 0:
            raise ValueError(f"--data {path}: the file is empty")
        if path.endswith(".bin"):
            if size % 2:
                raise ValueError(
                    f"--data {path}: {size} bytes is not a whole number of uint16 tokens; "
                    "a .bin file must hold little-endian uint16 token ids (nanoGPT's format)"
                )
            tokens = np.memmap(path, dtype=np.dtype("<u2"), mode="r")
            return cls(tokens, vocab_size=1 << 16, name=path)
        with open(path, "rb") as f:
            data = f.read()
        return cls(np.frombuffer(data, dtype=np.uint8), vocab_size=256, name=path)

    def check(self, *, seq_len: int, vocab_size: int) -> None:
        """Raise a ValueError unless every split holds one sequence and the token ids fit
        ``vocab_size`` (the first :data:`VOCAB_SCAN_TOKENS` now, every batch's rows as they are
        read)."""
        for split, tokens in self.splits.items():
            if len(tokens) < seq_len + 1:
                need = 10 * (seq_len + 1)  # the eval split is the last 10%
                raise ValueError(
                    f"{self.name}: the {split} split has {len(tokens)} tokens but one sequence "
                    f"needs seq_len + 1 = {seq_len + 1}; the file holds {len(self)} tokens, use "
                    f"one of at least {need} tokens (the eval split is the last 10%)"
                )
        # a whole scan of a multi-GB .bin file would take minutes on every rank: scan the head,
        # and let every batch check its own rows (see batch())
        head = self.tokens[:VOCAB_SCAN_TOKENS]
        self._check_ids(int(head.max()), vocab_size)
        self.model_vocab_size = vocab_size

    def _check_ids(self, largest: int, vocab_size: int) -> None:
        if largest >= vocab_size:
            raise ValueError(
                f"{self.name}: token id {largest} does not fit the model's "
                f"vocab_size={vocab_size}; pick a preset whose vocabulary covers the data "
                "(e.g. --preset gpt2-small for GPT-2 tokens)"
            )

    def offsets(
        self, step: int, *, batch_size: int, seq_len: int, seed: int, split: Split = "train"
    ) -> torch.Tensor:
        """Start offsets of the ``batch_size`` rows of global batch ``step``.

        See [Note: batches are functions of (seed, step)].
        """
        tokens = self.splits[split]
        high = len(tokens) - seq_len  # a row reads seq_len + 1 tokens
        if high < 1:
            raise ValueError(
                f"{self.name}: the {split} split has {len(tokens)} tokens, fewer than "
                f"seq_len + 1 = {seq_len + 1}"
            )
        gen = torch.Generator().manual_seed(_step_seed(seed, split, step))
        return torch.randint(0, high, (batch_size,), generator=gen)

    def batch(
        self,
        step: int,
        spec: BatchSpec,
        *,
        seed: int,
        rank: int = 0,
        micro_batch: int = 0,
        split: Split = "train",
    ) -> Batch:
        """The rows of global batch ``step`` that ``rank`` reads for ``micro_batch``."""
        offsets = self.offsets(
            step, batch_size=spec.batch_size, seq_len=spec.seq_len, seed=seed, split=split
        )
        tokens = self.splits[split]
        rows = spec.rows(rank, micro_batch)
        starts = offsets[rows.start : rows.stop].tolist()
        block = np.stack([tokens[o : o + spec.seq_len + 1] for o in starts])  # (rows, seq_len + 1)
        if self.model_vocab_size is not None:
            self._check_ids(int(block.max()), self.model_vocab_size)
        block = torch.from_numpy(block.astype(np.int64))
        return Batch(block[:, :-1], block[:, 1:])
