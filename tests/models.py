"""The models, data and comparisons the test modules share (one definition of each).

- Nets: :class:`Net` (odd sizes, one matrix used twice per forward) and its variants;
  :class:`ShapedNet` (the Muon tests' net, shaped by a :class:`Shape`); :class:`WholeMatrixNet`
  (the whole-matrix seam's net). Each ``make_*`` builds one from seed 0, so every rank and every
  reference starts from the same values.
- Data: :func:`batch` (a rank's rows of the same global batch at every world size) and
  :func:`loss_of`.
- Comparisons: :func:`rel_error` (normwise), :func:`assert_close`, :func:`assert_params_match`,
  :func:`assert_replicas_identical`; the tolerances come from :func:`order_tolerance`.
- :func:`ckpt`: a directory shared by the ranks of this test session.

[Tolerances] Two runs that compute the same thing in another order (torch DDP's all-reduce
against aligndp's buckets, one process against a sum over ranks, a vectorised kernel that
splits a dot product differently on another CPU) differ by rounding alone. A reordered sum of
``n`` terms moves by at most ``(n - 1) u`` of ``sum |x_i|`` (Higham, *Accuracy and Stability
of Numerical Algorithms*, eq. 4.4; ``u`` is half the dtype's eps). :func:`order_tolerance`
turns that into a normwise relative bound for a result after ``steps`` optimizer steps: each
step adds at most one such difference (the optimizers here are Lipschitz over a few steps) and
``gain`` covers what the test's arithmetic amplifies (a cancelling sum, AdamW's division by
``sqrt(v) + eps``, Newton–Schulz). The bound never depends on the CPU it was first run on;
each call site says why its ``terms`` and ``gain``. Checked by re-running the comparing tests
with 1 and 2 threads, ``ATEN_CPU_CAPABILITY=default|avx2|avx512`` and ``MKL_CBWR``/
``ONEDNN_MAX_CPU_ISA`` set to older instruction sets (tests/README: "Tolerances").
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

GLOBAL_BATCH = 12  # divisible by 1, 2, 3, 4
VOCAB = 29
TOKENS = 5  # per row


# ---- tolerances ----
def order_tolerance(
    dtype: torch.dtype = torch.float32, *, terms: int, steps: int = 1, gain: float = 1.0
) -> float:
    """Normwise relative bound on the difference of two results that differ only in the order
    of their floating-point sums (see [Tolerances] above).

    ``terms``: the longest sum behind one result element (a matmul's inner dim, the rows of a
    weight gradient, the ranks of an all-reduce). ``steps``: optimizer steps the difference
    accumulates over. ``gain``: how much the test's arithmetic amplifies a relative
    difference (1 for a plain sum or SGD; see the call site otherwise).
    """
    unit_roundoff = torch.finfo(dtype).eps / 2
    return gain * steps * max(terms - 1, 1) * unit_roundoff


# ---- nets ----
class Net(nn.Module):
    """Odd sizes everywhere (no dim a multiple of 64); ``mix`` is used twice per forward."""

    def __init__(self, frozen: bool = False):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 11)
        self.fc1 = nn.Linear(11, 37)
        self.fc2 = nn.Linear(37, 11)
        self.mix = nn.Linear(11, 11)
        self.head = nn.Linear(11, VOCAB, bias=False)
        if frozen:
            self.fc1.requires_grad_(False)

    def forward(self, idx: torch.Tensor, skip_mix: bool = False) -> torch.Tensor:
        x = self.emb(idx)
        x = x + self.fc2(torch.tanh(self.fc1(x)))
        if not skip_mix:
            x = self.mix(torch.tanh(self.mix(x)))  # the same weight twice
        return self.head(x)


class NetWithBuffers(Net):
    """:class:`Net` with a persistent and a non-persistent buffer."""

    def __init__(self):
        super().__init__()
        self.register_buffer("running", torch.randn(7))
        self.register_buffer("scratch", torch.randn(3), persistent=False)


class HeadReadNet(Net):
    """Net whose forward reads the head's weight with ``F.linear`` instead of calling ``self.head``
    (fused-loss kernels and tied heads do the same)."""

    def forward(self, idx: torch.Tensor, skip_mix: bool = False) -> torch.Tensor:
        x = self.emb(idx)
        x = x + self.fc2(torch.tanh(self.fc1(x)))
        x = self.mix(torch.tanh(self.mix(x)))
        return F.linear(x, self.head.weight)


class OtherNet(Net):
    """:class:`Net` with other shapes and one more param: not the model a checkpoint of a
    :class:`Net` was saved from."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(11, 36)
        self.fc2 = nn.Linear(36, 11)
        self.extra = nn.Linear(2, 2)


class BatchNormNet(nn.Module):
    """Embedding -> Linear -> BatchNorm1d -> Linear: running statistics differ per rank's data."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 11)
        self.fc1 = nn.Linear(11, 37, bias=False)  # a bias before BatchNorm gets only rounding noise
        self.norm = nn.BatchNorm1d(37)
        self.head = nn.Linear(37, VOCAB)

    def forward(self, idx: torch.Tensor, skip_mix: bool = False) -> torch.Tensor:
        x = self.fc1(self.emb(idx))  # (batch, tokens, 37)
        x = self.norm(x.reshape(-1, 37)).reshape(x.shape)
        return self.head(torch.tanh(x))


@dataclasses.dataclass(frozen=True)
class Shape:
    """Which :class:`ShapedNet` to build: odd sizes everywhere (no dim a multiple of 64)."""

    hidden: tuple[int, ...] = (37,)
    """Widths of the MLP matrices between the 11-wide residual stream."""
    tied: bool = False
    """The head is the embedding's weight."""
    mix: bool = True
    """An 11x11 matrix used twice per forward."""


BASE = Shape()
TIED = Shape(tied=True)
ONE_MATRIX = Shape(hidden=(), mix=True)  # fewer matrices than ranks
HUGE = Shape(hidden=(515, 9))  # one matrix far above every other


class ShapedNet(nn.Module):
    """Embedding, an MLP of ``shape.hidden`` widths, an optional mix matrix, LayerNorm, head."""

    def __init__(self, shape: Shape):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 11)
        dims = (11,) + shape.hidden + (11,) if shape.hidden else ()
        self.mlp = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims, dims[1:]))
        self.mix = nn.Linear(11, 11, bias=False) if shape.mix else None
        self.norm = nn.LayerNorm(11)
        self.head = nn.Linear(11, VOCAB, bias=False)
        if shape.tied:
            self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        h = x
        for i, layer in enumerate(self.mlp):
            h = layer(h) if i == len(self.mlp) - 1 else torch.tanh(layer(h))
        x = x + h if self.mlp else x
        if self.mix is not None:
            x = self.mix(torch.tanh(self.mix(x)))
        return self.head(self.norm(x))


class WholeMatrixNet(nn.Module):
    """Odd shapes; ``mix`` is 8×8, so an 8×8 preconditioner of it has the param's numel."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 8)
        self.up = nn.Linear(8, 37)
        self.down = nn.Linear(37, 8)
        self.mix = nn.Linear(8, 8, bias=False)
        self.side = nn.Linear(8, 13, bias=False)
        self.back = nn.Linear(13, 8, bias=False)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, VOCAB, bias=False)

    def forward(self, idx):
        x = self.emb(idx)
        x = x + self.down(torch.tanh(self.up(x)))
        x = x + self.back(torch.tanh(self.side(self.mix(x))))
        return self.head(self.norm(x))


class MLP(nn.Module):
    """fc1 -> gelu -> fc2 -> head on float features (MX shapes when ``dim``/``hidden`` are)."""

    def __init__(self, dim: int, hidden: int, classes: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x):
        return self.head(self.fc2(F.gelu(self.fc1(x))))


class MixMLP(nn.Module):
    """A residual MLP, then ``mix`` used twice per forward (two fused wgrads, two mark_ready)."""

    def __init__(self, dim: int, hidden: int, classes: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim, bias=False)  # bias-free: alone in its bucket
        self.mix = nn.Linear(dim, dim, bias=False)
        self.head = nn.Linear(dim, classes)

    def forward(self, x):
        h = x + self.fc2(F.gelu(self.fc1(x)))
        return self.head(self.mix(torch.tanh(self.mix(h))))


WHOLE_MATRICES = ("up.weight", "down.weight", "mix.weight", "side.weight", "back.weight")
"""The params of :class:`WholeMatrixNet` that routing gives a whole-matrix optimizer."""


def seeded(factory, *args, **kwargs) -> nn.Module:
    """``factory(*args, **kwargs)`` built from seed 0: the same values on every rank."""
    torch.manual_seed(0)
    return factory(*args, **kwargs)


def make_net(frozen: bool = False) -> Net:
    return seeded(Net, frozen)


def make_shaped_net(shape: Shape = BASE) -> ShapedNet:
    return seeded(ShapedNet, shape)


def make_whole_matrix_net() -> WholeMatrixNet:
    return seeded(WholeMatrixNet)


# ---- data ----
def batch(
    step: int,
    rank: int = 0,
    world_size: int = 1,
    *,
    rows: int = GLOBAL_BATCH,
    seed: int = 1000,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank's slice of the global batch of ``step`` (the same global batch at every world size):
    ``rows`` rows of :data:`TOKENS` token ids and targets."""
    g = torch.Generator().manual_seed(seed + step)
    idx = torch.randint(0, VOCAB, (rows, TOKENS), generator=g)
    tgt = torch.randint(0, VOCAB, (rows, TOKENS), generator=g)
    n = rows // world_size
    return idx[rank * n : (rank + 1) * n], tgt[rank * n : (rank + 1) * n]


def loss_of(model: nn.Module, idx: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(idx).reshape(-1, VOCAB), tgt.reshape(-1))


# ---- comparisons ----
def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Normwise relative error ``||actual - expected|| / ||expected||`` (the absolute norm when
    ``expected`` is zero): one number per tensor, on the tensor's own scale."""
    actual, expected = actual.detach().float(), expected.detach().float()
    scale = expected.norm()
    if scale == 0:
        return float(actual.norm())
    return float((actual - expected).norm() / scale)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str, rel: float) -> None:
    """Same shape, and :func:`rel_error` at most ``rel`` (0: equal bit for bit)."""
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    if rel == 0:
        assert torch.equal(actual.detach(), expected.detach()), f"{what}: not bit-identical"
        return
    err = rel_error(actual, expected)
    assert err <= rel, f"{what}: relative error {err:.2e} > {rel:.2e}"


def assert_params_match(ours: nn.Module, theirs: nn.Module, what: str, rel: float) -> None:
    """Every param of ``ours`` against the param of ``theirs`` in the same position."""
    mine, other = list(ours.named_parameters()), list(theirs.parameters())
    assert len(mine) == len(other), f"{what}: {len(mine)} params against {len(other)}"
    for (n, p), q in zip(mine, other):
        assert_close(p, q, f"{what} {n}", rel)


def assert_replicas_identical(module: nn.Module, what: str = "") -> None:
    """Every rank's params equal rank 0's bit for bit (checked on every rank)."""
    flat = torch.cat([p.detach().float().reshape(-1) for p in module.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    differ = [r for r, g in enumerate(gathered) if not torch.equal(g, gathered[0])]
    assert not differ, f"{what}: ranks {differ} hold other params than rank 0"


def snapshot(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters()}


# ---- Muon's reference in fp32 ----
def _newton_schulz_fp32(grad, ns_coefficients, ns_steps, eps):
    """Test reference: torch's quintic Newton–Schulz iteration, in fp32 instead of bf16."""
    a, b, c = ns_coefficients
    x = grad.float().T if grad.size(0) > grad.size(1) else grad.float()  # (short, long)
    x = x / x.norm().clamp(min=eps)
    for _ in range(ns_steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if grad.size(0) > grad.size(1) else x


def fp32_newton_schulz():
    """torch's Muon runs Newton–Schulz in fp32 meanwhile (patched; both sides of a comparison)."""
    return mock.patch("torch.optim._muon._zeropower_via_newtonschulz", _newton_schulz_fp32)


# ---- a directory the ranks share ----
if "ALIGNDP_TEST_CKPT_DIR" not in os.environ:  # the pytest process; ranks inherit the variable
    import atexit
    import shutil

    os.environ["ALIGNDP_TEST_CKPT_DIR"] = tempfile.mkdtemp(prefix="aligndp-ckpt-")
    atexit.register(shutil.rmtree, os.environ["ALIGNDP_TEST_CKPT_DIR"], True)


def ckpt(name: str) -> str:
    """A path in the directory every process of this test session shares (created by the
    pytest process, inherited by the spawned ranks through ``ALIGNDP_TEST_CKPT_DIR``)."""
    return os.path.join(os.environ["ALIGNDP_TEST_CKPT_DIR"], name)
