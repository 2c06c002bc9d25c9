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
- :class:`CountOps`: the aten ops (and allocations) that run while it is active.

[Tolerances] Two runs that compute the same thing with their sums in another order (torch
DDP's all-reduce against aligndp's buckets, one process against a sum over ranks, a GEMM or a
vectorised kernel that splits its sums differently on another CPU or for another alignment)
differ by rounding alone. :func:`order_tolerance` bounds that difference from the arithmetic:

- a sum of ``n`` terms in another order moves by at most ``lambda sqrt(n) u`` of
  ``sum |x_i|`` (Higham & Mary, "A new approach to probabilistic rounding error analysis",
  SIAM J. Sci. Comput. 41, 2019: with ``lambda = 7`` the bound fails with probability below
  about ``2 n exp(-lambda^2 / 2)``, 5e-6 for the ``n <= 10^5`` here; the deterministic
  ``(n - 1) u`` of Higham's eq. 4.4 is far looser); ``u`` is the dtype's unit roundoff;
- ``sum |x_i|`` over ``|sum x_i|`` (the cancellation) is about ``sqrt(n)`` for mixed signs,
  normwise over a tensor, and 1 for terms of one sign (a norm's squares);
- each optimizer step adds one such difference (``steps``), amplified by ``gain``: 1 for SGD
  and for the sums themselves, :data:`ADAMW_GAIN` for AdamW, whose bias-corrected early update
  ``m / (sqrt(v) + eps)`` moves by up to ``(1 - beta1) / sqrt(1 - beta2)`` times a relative
  change of one step's gradient (Kingma & Ba, sec. 2.1), more where the test says why.

The bound never depends on the CPU it was first run on; each call site names its ``terms``
(the longest sum behind a compared element), ``steps`` and ``gain``. Where exactness is the
claim (a load at the same dp size, dp 2 where an all-reduce and a reduce-scatter add the same
two numbers, a backend that only moves storage) tests compare bit for bit (``torch.equal``,
``assert_close(..., rel=0)``): there the two sides add the same numbers in the same order.

How the bounds were checked (an AMD EPYC with AVX-512, no AMX): test_hf_habits, test_zero1,
test_ddp and test_muon were re-run with ``ATEN_CPU_CAPABILITY=avx2`` plus
``MKL_ENABLE_INSTRUCTIONS=AVX2`` (other vector widths, hence other splits between a kernel's
vector body and its scalar tail and other FMA contractions; another GEMM blocking), with
``ATEN_CPU_CAPABILITY=default`` (no vectors), and with ``ALIGNDP_TEST_THREADS=2`` (two threads
per rank, tests/_worlds.py); test_torch_habits, test_checkpoint and test_whole_matrix with the
first of these too; every file touched here passed at the defaults. Measured on GPT-2
with ZeRO-1 (the case that failed at 1.49e-6 on AVX-512 + AMX against a 1e-6 bound): 1.1e-7
(AVX-512), 9.4e-8 (AVX2), 0 (no vectors), 9.0e-8 (two threads) normwise, against a bound of
6e-4; with ``sharding="none"`` every HF model matched torch DDP bit for bit in all four.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import tempfile
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

GLOBAL_BATCH = 12  # divisible by 1, 2, 3, 4
VOCAB = 29
TOKENS = 5  # per row


# ---- tolerances ----
LAMBDA = 7.0
"""Probabilistic rounding bound's multiplier (see [Tolerances])."""
ADAMW_GAIN = (1 - 0.9) / (1 - 0.999) ** 0.5
"""3.16: AdamW's (default betas) largest early update per unit relative gradient change."""
MUON_GAIN = 5.0
"""Muon (fp32 Newton–Schulz) on :class:`ShapedNet`: the update's orthogonal factor moves by up
to ``2 ||G|| / (sigma_n + sigma_(n-1))`` times a relative change of the momentum ``G`` (Li,
"New perturbation bounds for the unitary polar factor", SIAM J. Matrix Anal. Appl. 1995),
at most ~200 for these nets' gradient matrices (their singular values, not the CPU, set it);
with ``adjust_lr_fn="match_rms_adamw"`` the update has rms ``0.2 lr``, 0.004 at lr 0.02, which
is <= 0.025 of params of rms >= 0.16 (nn.Linear's init for fan-in <= 37): 200 x 0.025 = 5,
above AdamW's 3.16 for the rest of the params."""


def order_tolerance(
    dtype: torch.dtype = torch.float32,
    *,
    terms: int,
    steps: int = 1,
    gain: float = 1.0,
    cancelling: bool = True,
) -> float:
    """Normwise relative bound on the difference of two results that differ only in the order
    of their floating-point sums: ``gain * steps * LAMBDA * sqrt(terms) * u``, times
    ``sqrt(terms)`` more for ``cancelling`` sums (see [Tolerances] above).

    ``terms``: the longest sum behind one compared element (a matmul's inner dim, the token
    rows of a weight gradient, the elements of a norm). ``steps``: optimizer steps the
    difference accumulates over. ``gain``: what the optimizer (or the test's other arithmetic)
    amplifies a relative difference by: 1 for a plain sum or SGD, :data:`ADAMW_GAIN` for AdamW.
    ``cancelling=False``: terms of one sign (a norm's squares), or a result that weighs each
    element by its size (a loss moves little with the elements whose sums cancel).
    """
    unit_roundoff = torch.finfo(dtype).eps / 2
    spread = terms**0.5 * (terms**0.5 if cancelling else 1.0)
    return gain * steps * LAMBDA * spread * unit_roundoff


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


@contextlib.contextmanager
def fp32_newton_schulz():
    """torch's Muon, and aligndp's split Newton–Schulz (aligndp/optim/split_ns.py), run
    Newton–Schulz in fp32 meanwhile (patched; both sides of a comparison)."""
    with (
        mock.patch("torch.optim._muon._zeropower_via_newtonschulz", _newton_schulz_fp32),
        mock.patch("aligndp.optim.split_ns.NS_DTYPE", torch.float32),
    ):
        yield


# ---- a directory the ranks share ----
if "ALIGNDP_TEST_CKPT_DIR" not in os.environ:  # the pytest process; ranks inherit the variable
    import atexit

    os.environ["ALIGNDP_TEST_CKPT_DIR"] = tempfile.mkdtemp(prefix="aligndp-ckpt-")
    atexit.register(shutil.rmtree, os.environ["ALIGNDP_TEST_CKPT_DIR"], True)


class CountOps(TorchDispatchMode):
    """Counts aten ops, and the ones whose result lives in a storage no input had (an
    allocation; views and in-place ops return an input's storage)."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []
        self.allocations = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        seen = {
            a.untyped_storage().data_ptr()
            for a in pytree.tree_leaves((args, kwargs))
            if isinstance(a, torch.Tensor)
        }
        self.ops.append(str(func))
        self.allocations += sum(
            o.untyped_storage().data_ptr() not in seen
            for o in pytree.tree_leaves(out)
            if isinstance(o, torch.Tensor)
        )
        return out


def ckpt(name: str) -> str:
    """A path in the directory every process of this test session shares (created by the
    pytest process, inherited by the spawned ranks through ``ALIGNDP_TEST_CKPT_DIR``)."""
    return os.path.join(os.environ["ALIGNDP_TEST_CKPT_DIR"], name)


# ---- damage to a checkpoint file ----
def zero_middle(path) -> None:
    """4 KiB of zeros in the middle of a file, its size unchanged."""
    size = os.path.getsize(path)
    start = max(0, size // 2 - 2048)
    with open(path, "r+b") as f:
        f.seek(start)
        f.write(bytes(min(4096, size - start)))


# ---- an `aligndp train` run cut short ----
def interrupted_copy(run, out, *, checkpoint_step, last_logged_step):
    """``out`` as a run of ``run`` killed after logging ``last_logged_step`` would leave it:
    only the checkpoint at ``checkpoint_step`` and the metrics up to ``last_logged_step``."""
    (out / "checkpoints").mkdir(parents=True)
    shutil.copy(run / "run.json", out / "run.json")
    shutil.copy(run / "checkpoints" / "run.json", out / "checkpoints" / "run.json")
    name = f"step-{checkpoint_step:06d}"
    shutil.copytree(run / "checkpoints" / name, out / "checkpoints" / name)
    lines = (run / "metrics.jsonl").read_text().splitlines(keepends=True)
    (out / "metrics.jsonl").write_text("".join(lines[: last_logged_step + 1]))
