"""[Note: compiled overlap]: under ``torch.compile`` of the whole wrapper (Inductor), bucket
collectives launch while the backward still runs, and training matches torch DDP + compile.

One process group of 2 gloo ranks runs every case; the net is four 512-wide Linears (each
weight 1 MiB, DDPOptimizer's smallest first bucket) with one bucket per layer, so the graph
must be split for any collective to start before the first layer's gradient exists.
"""

from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import aligndp
from aligndp.plan.routing import route_params
from aligndp.runtime.compiled_overlap import FIRST_BUCKET_BYTES, CompiledOverlap, split_bytes
from tests._dist import case, make_tests
from tests.models import ADAMW_GAIN, MUON_GAIN, assert_close, fp32_newton_schulz, order_tolerance

WIDTH = 512
LAYERS = 4
ROWS = 8
"""Rows of the global batch; each of the 2 ranks takes half."""
STEPS = 3
"""Step 0 learns each bucket's readiness ([Note: bucket readiness]); steps 1 and 2 overlap."""
BUCKET_NUMEL = WIDTH * WIDTH
"""A bucket closes once it holds a layer's bias and weight: one bucket per layer."""
LR, MUON_LR = 1e-3, 0.02
MUON_FILTER = ["2.weight", "4.weight", "6.weight"]
"""Muon steps the later matrices; the first layer's weight goes to AdamW, as a GPT's embedding
does: the AdamW buffer then comes first and its bucket is ready last, see
[Note: launch order across buffers] in aligndp/runtime/step_state.py."""


def make_net() -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for i in range(LAYERS):
        layers += [nn.Linear(WIDTH, WIDTH)] + ([nn.Tanh()] if i < LAYERS - 1 else [])
    return nn.Sequential(*layers)


def data(step: int, rank: int, ws: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(ROWS, WIDTH, generator=g), torch.randn(ROWS, WIDTH, generator=g)
    rows = slice(rank * ROWS // ws, (rank + 1) * ROWS // ws)
    return x[rows], y[rows]


def torch_reference(optimizer: str, sharding: str):
    """torch DDP + compile with torch's optimizers: AdamW, or Muon on the hidden matrices and
    AdamW on the rest (aligndp routes the same params, aligndp/plan/routing.py)."""
    net = make_net()
    ddp = nn.parallel.DistributedDataParallel(net, bucket_cap_mb=1)
    named = dict(net.named_parameters())
    if optimizer == "muon":
        routing = route_params(net, muon_filter=MUON_FILTER)
        opts = [
            torch.optim.Muon(
                [named[n] for n in routing.whole], lr=MUON_LR, adjust_lr_fn="match_rms_adamw"
            ),
            torch.optim.AdamW([named[n] for n in routing.adamw], lr=LR),
        ]
    else:
        opts = [torch.optim.AdamW(net.parameters(), lr=LR)]
    return torch.compile(ddp), net, opts


def compiled_overlap_matches_torch_ddp(rank: int, ws: int, *, optimizer: str, sharding: str):
    ns = fp32_newton_schulz() if optimizer == "muon" else contextlib.nullcontext()
    with ns:
        kwargs = {"lr": LR}
        if optimizer == "muon":
            kwargs = {"muon_lr": MUON_LR, "adamw_lr": LR, "muon_filter": MUON_FILTER}
        model, opt = aligndp.parallelize(
            make_net(), optimizer=optimizer, sharding=sharding, bucket_numel=BUCKET_NUMEL, **kwargs
        )
        assert len(model.bucket_refs) >= 3, model.layouts
        events: list[str] = []
        coll = model.collectives
        for name in ("all_reduce_mean", "reduce_scatter_mean"):
            launch = getattr(coll, name)
            setattr(coll, name, lambda b, launch=launch: events.append("launch") or launch(b))
        first = model.module[0].weight
        first.register_hook(lambda g: events.append("first layer grad"))
        ours = torch.compile(model)  # the whole wrapper, Inductor
        theirs, ref, ref_opts = torch_reference(optimizer, sharding)
        for step in range(STEPS):
            x, y = data(step, rank, ws)
            events.clear()
            loss = F.mse_loss(ours(x), y)
            loss.backward()
            assert nn.parallel.DistributedDataParallel._active_ddp_module is None
            opt.step()
            opt.zero_grad()
            ref_loss = F.mse_loss(theirs(x), y)
            ref_loss.backward()
            for o in ref_opts:
                o.step()
                o.zero_grad()
            if step > 0:
                grad_at = events.index("first layer grad")
                assert "launch" in events[:grad_at], (
                    f"step {step}: no bucket collective launched before the first layer's "
                    f"gradient was produced: {events}"
                )
            # the two compiled graphs split (hence fuse) at other places: sums over the 512-wide
            # inner dims and the 8 rows in other orders, through AdamW's or Muon's gain
            gain = MUON_GAIN if optimizer == "muon" else ADAMW_GAIN
            rel = order_tolerance(terms=WIDTH, steps=step + 1, gain=gain)
            assert_close(loss.detach(), ref_loss.detach(), f"step {step} loss", rel)
        if sharding != "none":
            model.wait_for_params()
        for (n, p), q in zip(model.module.named_parameters(), ref.parameters()):
            assert_close(p.detach(), q.detach(), n, rel)
    model.remove_hooks()
    torch._dynamo.reset()


@case(2)
def case_compiled_overlap_replicated_adamw(rank, ws):
    compiled_overlap_matches_torch_ddp(rank, ws, optimizer="adamw", sharding="none")


@case(2)
def case_compiled_overlap_zero1_adamw(rank, ws):
    compiled_overlap_matches_torch_ddp(rank, ws, optimizer="adamw", sharding="zero1")


@case(2)
def case_compiled_overlap_layerwise_muon(rank, ws):
    compiled_overlap_matches_torch_ddp(rank, ws, optimizer="muon", sharding="zero1")


@case(2)
def case_split_cap_counts_storage_bytes_per_bucket(rank, ws):
    """A ZeRO-1 param's storage is its whole flat buffer: the cap divides what DDPOptimizer
    counts by the buckets, so the split makes about one subgraph per bucket, not one per
    param; and it never goes below DDPOptimizer's first bucket. One rank presents nothing."""
    model, _ = aligndp.parallelize(make_net(), sharding="zero1", bucket_numel=BUCKET_NUMEL)
    buffer_bytes = model.flat_buffers[0].param_data.untyped_storage().nbytes()
    params = model.params
    assert all(p.untyped_storage().nbytes() == buffer_bytes for p in params)
    cap = model.compiled_overlap.face.bucket_bytes_cap
    assert cap == len(params) * buffer_bytes // len(model.bucket_refs)
    small = [nn.Parameter(torch.zeros(8))]
    assert split_bytes(small, num_buckets=1) == FIRST_BUCKET_BYTES
    one_rank = [dist.new_group([r]) for r in range(ws)][rank]  # every rank makes every group
    alone, _ = aligndp.parallelize(make_net(), process_group=one_rank, bucket_numel=BUCKET_NUMEL)
    assert alone.compiled_overlap.face is None
    model.remove_hooks()
    alone.remove_hooks()


def test_presents_its_buckets_during_forward_and_restores_the_previous_module():
    """enter() sets what Dynamo reads, leave() puts back what was there (an enclosing torch DDP's
    forward); nothing is presented with grad disabled, and a leave() without enter() is a no-op."""
    ddp = nn.parallel.DistributedDataParallel
    overlap = CompiledOverlap(
        [nn.Parameter(torch.zeros(4))], num_buckets=2, world_size=2, overlap=True
    )
    outer = object()
    ddp._active_ddp_module = outer
    try:
        overlap.enter()
        assert ddp._active_ddp_module is overlap.face
        assert overlap.face.bucket_bytes_cap == FIRST_BUCKET_BYTES
        overlap.leave()
        assert ddp._active_ddp_module is outer
        overlap.leave()
        assert ddp._active_ddp_module is outer
        with torch.no_grad():
            overlap.enter()
        assert ddp._active_ddp_module is outer
        overlap.leave()
    finally:
        ddp._active_ddp_module = None
    for world_size, num_buckets, on in ((1, 2, True), (2, 1, True), (2, 2, False)):
        quiet = CompiledOverlap([], num_buckets=num_buckets, world_size=world_size, overlap=on)
        assert quiet.face is None, (world_size, num_buckets, on)


def test_a_torch_without_the_seam_warns_and_presents_nothing():
    with (
        mock.patch("aligndp.runtime.compiled_overlap._torch_has_the_split", return_value=False),
        pytest.warns(UserWarning, match="compile block by block"),
    ):
        overlap = CompiledOverlap([], num_buckets=2, world_size=2, overlap=True)
    assert overlap.face is None
    overlap.enter()
    assert nn.parallel.DistributedDataParallel._active_ddp_module is None
    overlap.leave()


make_tests(globals())
