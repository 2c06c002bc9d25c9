"""Several ranks on one GPU (issue 42, item 1): every multi-rank mode at 2, 4 and 8 ranks that
share one GPU over gloo, with CUDA tensors, against one process.

NCCL refuses two ranks on one GPU, but gloo carries CUDA tensors, so one GPU runs the
multi-rank code paths on real kernels: none, zero1, zero1 with overlapped param gathers,
layer-wise Muon (either sharding; its split Newton–Schulz groups at 4+ ranks), the FP8 param
gather (fp8-tensor), 1x128 FP8 wgrad with Muon under ``torch.compile`` (Hopper), and the 2-D
replicate x shard mesh at 4 and 8 ranks. Each mode trains 3 steps of a global batch of 24 rows
split over the ranks and must match one process training the same (converted) net on the whole
batch with the same torch optimizers, with every replica identical.

Skipped without CUDA. ``ALIGNDP_ONE_GPU_DEVICE=cpu`` runs the same cases on CPU (a check of the
tests themselves; the fp8 modes then skip). The lead's run on one H200:
``ALIGNDP_TEST_THREADS=1 python -m pytest -q tests/test_one_gpu_ranks.py -p no:cacheprovider``.
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import aligndp
from aligndp.plan.routing import route_params
from tests._dist import case, make_tests
from tests.models import (
    VOCAB,
    Net,
    assert_close,
    assert_replicas_identical,
    batch,
    fp32_newton_schulz,
    seeded,
)

DEVICE = os.environ.get("ALIGNDP_ONE_GPU_DEVICE", "cuda")
if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("several ranks on one GPU: no CUDA device", allow_module_level=True)

ROWS, STEPS, LR = 24, 3, 1e-2
FP8_ROWS = 128
"""Rows of the FP8 modes' global batch: every rank's tokens (rows / ws x sequence length) a
multiple of 16 at 2, 4 and 8 ranks, as the FP8 GEMMs need."""
REL_FP32 = 1e-4
"""fp32 against one process: the reduction order (gloo's sum of 2-8 pre-divided parts, the
cuBLAS split of each rank's smaller GEMMs) moves the last bits, AdamW's gain (~3) and Muon's
(fp32 Newton–Schulz) carry them through 3 steps; 1e-4 leaves two orders of margin."""
REL_FP8 = 2e-2
"""FP8 wgrad modes against one process running the same recipe on the same rows per forward
(see :func:`_reference`): what is left is the fp32 order of the gradient sum carried through
3 steps, and the E4M3 rounding of a gathered weight, which that may flip for an element (one
E4M3 step, 2^-4 of it). 2e-3 passed on one H200 (2026-12-03); 2e-2 leaves an order of margin."""


def _hopper() -> bool:
    return DEVICE == "cuda" and torch.cuda.get_device_capability() >= (9, 0)


class Fp8Net(nn.Module):
    """:class:`Net`'s shape with widths the FP8 recipes take (multiples of 128): the embedding
    and head stay in their dtype, the two hidden Linears convert."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 128)
        self.fc1 = nn.Linear(128, 256)
        self.fc2 = nn.Linear(256, 128)
        self.head = nn.Linear(128, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        return self.head(x + self.fc2(torch.tanh(self.fc1(x))))


def _net(wgrad: str | None) -> nn.Module:
    net = seeded(Net if wgrad is None else Fp8Net).to(DEVICE)
    if wgrad is not None:
        from aligndp.lowp import convert_to_mxfp8

        convert_to_mxfp8(net, backend=wgrad, layers="all")
    return net


def _rows(step: int, rank: int, ws: int, fp8: bool) -> tuple[torch.Tensor, torch.Tensor]:
    idx, tgt = batch(step, rank, ws, rows=FP8_ROWS if fp8 else ROWS)
    return idx.to(DEVICE), tgt.to(DEVICE)


def _loss(model, idx, tgt) -> torch.Tensor:
    return F.cross_entropy(model(idx).reshape(-1, VOCAB), tgt.reshape(-1))


def _torch_optimizers(net: nn.Module, muon: bool) -> list[torch.optim.Optimizer]:
    """torch's own optimizers for a reference: AdamW, or Muon on the matrices aligndp routes
    to it and AdamW on the rest."""
    if not muon:
        return [torch.optim.AdamW(net.parameters(), lr=LR)]
    named = dict(net.named_parameters())
    routing = route_params(net)
    return [
        torch.optim.Muon([named[n] for n in routing.whole], lr=LR, adjust_lr_fn="match_rms_adamw"),
        torch.optim.AdamW([named[n] for n in routing.adamw], lr=LR),
    ]


def _reference(wgrad: str | None, muon: bool, ws: int) -> nn.Module:
    """One process: the same net on the whole global batch, torch's own optimizers. Under the
    ``fp8-tensor`` recipe it runs each rank's rows as a forward and backward of its own (the
    loss divided by ``ws``, so the gradient is the batch mean): a per-tensor scale is the amax
    of the tensor a forward sees, so one forward over all rows quantises the activations with
    another scale than each rank's, and the weights end some percent apart after 3 AdamW steps
    (what this tier measured on one H200 on 2026-12-03 before the reference did this). 1x128
    blocks do not span ranks' rows, so the other recipes take the whole batch at once."""
    net = _net(wgrad)
    opts = _torch_optimizers(net, muon)
    per_rank = wgrad == "fp8-tensor"
    for step in range(STEPS):
        if per_rank:
            for r in range(ws):
                (_loss(net, *_rows(step, r, ws, True)) / ws).backward()
        else:
            _loss(net, *_rows(step, 0, 1, wgrad is not None)).backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
    return net


def _e4m3(t: torch.Tensor) -> torch.Tensor:
    """``t`` round-tripped through E4M3 with one per-tensor scale (amax to 448): what an FP8
    param gather leaves in a gathered weight, up to 2^-4 of each element."""
    scale = torch.finfo(torch.float8_e4m3fn).max / t.abs().max().clamp(min=1e-12)
    return (t * scale).to(torch.float8_e4m3fn).float() / scale


MODES = {
    "none": {"sharding": "none"},
    "zero1": {"sharding": "zero1"},
    "zero1 overlapped gather": {"sharding": "zero1", "overlap_param_gather": True},
    "muon none": {"optimizer": "muon", "sharding": "none"},
    "muon zero1": {"optimizer": "muon", "sharding": "zero1"},
    "fp8 param gather": {"sharding": "zero1", "wgrad": "fp8-tensor", "fp8_param_gather": True},
    "1x128 fp8 muon compiled": {"optimizer": "muon", "sharding": "zero1", "wgrad": "fp8"},
}


def _train(mode: str, rank: int, ws: int, mesh=None) -> None:
    kwargs = dict(MODES[mode])
    wgrad = kwargs.get("wgrad")
    if wgrad is not None and not _hopper():
        return  # the FP8 kernels run on Hopper; the recipes' CPU paths have their own tests
    muon = kwargs.get("optimizer") == "muon"
    compiled = mode.endswith("compiled")
    model, opt = aligndp.parallelize(_net(wgrad), lr=LR, mesh=mesh, bucket_numel=150, **kwargs)
    forward = torch.compile(model) if compiled else model
    context = fp32_newton_schulz() if muon else contextlib.nullcontext()
    with context:
        for step in range(STEPS):
            _loss(forward, *_rows(step, rank, ws, wgrad is not None)).backward()
            opt.step()
            opt.zero_grad()
        if hasattr(model, "wait_for_params"):
            model.wait_for_params()
        ref = _reference(wgrad, muon, ws)
    rel = REL_FP32 if wgrad is None else REL_FP8
    what = f"{mode} at {ws} ranks on one {DEVICE}" + (" (2-D mesh)" if mesh is not None else "")
    gathered_fp8 = {"fc1.weight", "fc2.weight"} if kwargs.get("fp8_param_gather") else set()
    for (name, p), q in zip(model.module.named_parameters(), ref.parameters()):
        q = _e4m3(q.detach().float()) if name in gathered_fp8 else q.detach().float()
        assert_close(p.detach().float(), q, f"{what}: {name}", rel)
    assert_replicas_identical(model.module, what)


def _pin_device() -> None:
    if DEVICE == "cuda":
        torch.cuda.set_device(0)  # every rank on the one GPU


@case(2, 4, 8)
def case_every_mode_on_one_device_matches_one_process(rank, ws):
    _pin_device()
    for mode in MODES:
        if mode != "fp8 param gather":
            _train(mode, rank, ws)


@case(2, 4, 8)
def case_fp8_param_gather_on_one_device_matches_one_process(rank, ws):
    _pin_device()
    _train("fp8 param gather", rank, ws)
    if ws >= 4:
        _train("fp8 param gather", rank, ws, mesh=aligndp.replica_mesh(2, DEVICE))


@case(4, 8)
def case_a_2d_mesh_on_one_device_matches_one_process(rank, ws):
    """Two replicas of ws / 2 shards each: AdamW ZeRO-1 and layer-wise Muon."""
    _pin_device()
    mesh = aligndp.replica_mesh(2, DEVICE)
    for mode in ("zero1", "muon zero1"):
        _train(mode, rank, ws, mesh=mesh)
    dist.barrier()


def _uneven_reference(muon: bool, ws: int) -> nn.Module:
    """One process over the batches of :func:`case_uneven_inputs_under_join_on_one_device`: at
    each step the ranks still active give their rows' loss / ws (torch's
    ``divide_by_initial_world_size=True``)."""
    net = _net(None)
    opts = _torch_optimizers(net, muon)
    for step in range(STEPS):
        for r in range(ws):
            if step < STEPS - r % 2:
                (_loss(net, *_rows(step, r, ws, False)) / ws).backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
    return net


@case(2, 4)
def case_uneven_inputs_under_join_on_one_device(rank, ws):
    """Odd ranks get one batch fewer and train on under ``model.join()`` (tests/test_join.py
    on CPU): CUDA tensors, against one process stepping the active ranks' rows."""
    _pin_device()
    for mode in ("none", "zero1", "muon zero1"):
        muon = mode.startswith("muon")
        model, opt = aligndp.parallelize(_net(None), lr=LR, bucket_numel=150, **MODES[mode])
        with fp32_newton_schulz() if muon else contextlib.nullcontext():
            with model.join():
                for step in range(STEPS - rank % 2):
                    _loss(model, *_rows(step, rank, ws, False)).backward()
                    opt.step()
                    opt.zero_grad()
            ref = _uneven_reference(muon, ws)
        what = f"{mode} under join at {ws} ranks on one {DEVICE}"
        for (name, p), q in zip(model.module.named_parameters(), ref.parameters()):
            assert_close(p.detach().float(), q.detach().float(), f"{what}: {name}", REL_FP32)
        assert_replicas_identical(model.module, what)


make_tests(globals())
