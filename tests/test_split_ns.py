"""Split Newton–Schulz's maths in one process (aligndp/optim/split_ns.py) against torch's Muon.

The parts of a split matrix run here one after another, their Gram sums and ``B`` rows joined by
hand where the ranks would all-reduce and all-gather; the gloo runs are in tests/test_muon.py.
With one part and torch's bf16 the step is torch.optim.Muon's bit for bit (same operations in the
same order); with k parts the Gram is summed in another order, so the fp32 comparison (both sides
patched, tests/models.py) allows fp32 rounding through 5 iterations of 3 steps, and the bf16 step
must be as close to the fp32 one as torch's bf16 step is (within twice its distance). Steps are
compared (params after minus before), not params, so the bounds are relative to the update.
"""

from __future__ import annotations

import pytest
import torch

from aligndp.optim import split_ns
from aligndp.optim.muon import MUON_SPLIT
from aligndp.plan.split import split_bounds
from tests.models import fp32_newton_schulz, rel_error

STEPS = 3


def split_muon_step(param, grad, state, options, k):
    """One Muon step of ``param`` with its Newton–Schulz cut into ``k`` parts."""
    update = split_ns.momentum_update(grad, state, options["momentum"], options["nesterov"])
    x = split_ns.normalised(update, options["eps"])
    cols, rows = split_bounds(param.shape, k, MUON_SPLIT)
    parts = [x[:, lo:hi] for lo, hi in zip(cols, cols[1:])]
    a, b, c = options["ns_coefficients"]
    for _ in range(options["ns_steps"]):
        gram = sum(split_ns.gram_part(p) for p in parts).to(x.dtype)  # the all-reduce
        full_b = torch.cat([split_ns.b_rows(gram, lo, hi, b, c) for lo, hi in zip(rows, rows[1:])])
        parts = [split_ns.apply_b(p, full_b, a) for p in parts]
    ortho = torch.cat(parts, dim=1)
    split_ns.apply_update(param, ortho.T if param.shape[0] > param.shape[1] else ortho, options)


def run_both(shape, k, seed=0, device="cpu", **kwargs):
    gen = torch.Generator().manual_seed(seed)
    start = torch.randn(shape, generator=gen).to(device)
    grads = [torch.randn(shape, generator=gen).to(device) for _ in range(STEPS)]
    theirs = torch.nn.Parameter(start.clone())
    muon = torch.optim.Muon([theirs], lr=0.02, **kwargs)
    ours, state = start.clone(), {}
    for g in grads:
        theirs.grad = g.clone()
        muon.step()
        split_muon_step(ours, g.clone(), state, muon.param_groups[0], k)
    assert torch.equal(state["momentum_buffer"], muon.state[theirs]["momentum_buffer"])
    return ours - start, theirs.detach() - start  # the steps taken, compared without the params


OPTIONS = [
    {},
    {"nesterov": False, "momentum": 0.9, "weight_decay": 0.0},
    {"adjust_lr_fn": "match_rms_adamw", "ns_steps": 3},
    {"adjust_lr_fn": "original", "ns_coefficients": (2.0, -1.5, 0.5), "eps": 1e-3},
]


@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize("shape", [(24, 200), (200, 24), (37, 37)])
def test_one_part_is_torch_muon_bit_for_bit(shape, options):
    ours, theirs = run_both(shape, 1, **options)
    assert torch.equal(ours, theirs), rel_error(ours, theirs)


@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize("shape,k", [((24, 200), 3), ((200, 24), 4), ((37, 131), 5)])
def test_parts_match_torch_muon(shape, k, options):
    assert_parts_match(shape, k, "cpu", **options)


def assert_parts_match(shape, k, device, **options):
    with fp32_newton_schulz():
        ours, exact = run_both(shape, k, device=device, **options)
    # fp32: the Gram's k partial sums reorder n additions (relative 2^-24 each); Newton–Schulz
    # iterations and 3 steps keep it within 1e-5 of the update's size, as tests/test_muon.py
    assert rel_error(ours, exact) <= 1e-5
    ours, theirs = run_both(shape, k, device=device, **options)  # torch's bf16
    # torch's bf16 step is itself ~1e-2 from the fp32 one (2^-8 per rounding, through the
    # iterations); ours rounds each Gram part to bf16 once more before the fp32 sum, a second
    # rounding of the same size at most: it stays within twice torch's own distance
    assert rel_error(ours, exact) <= 2 * rel_error(theirs, exact)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("shape,k", [((768, 3072), 2), ((2304, 768), 4), ((2048, 8192), 3)])
def test_parts_match_torch_muon_on_gpu(shape, k):
    """cuBLAS: the parts' GEMMs against torch's Muon on the GPU at preset shapes, bounds as on
    the CPU."""
    assert_parts_match(shape, k, "cuda")
