"""Fused MXFP8 wgrad inside DataParallel (gloo): equal to the unfused path in every buffer mode.

[Note: fused wgrad] in aligndp/fused.py: an MXLinear bound to the DataParallel sink
accumulates its weight gradient straight into ``main_grad`` and only marks the param ready.
The unfused reference is the same MX model with the sink unbound, so autograd produces the
weight gradient and the DDP hook copies it into the buffer: both must reduce to the same
gradients, micro-batches (``no_sync``) included.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from aligndp.ddp import DataParallel, DDPConfig
from aligndp.fused import fused_wgrad_modules
from aligndp.layout import Mode
from aligndp.mx import MXLinear, convert_to_mxfp8
from tests._dist import case, make_tests

TOKENS, DIM, HIDDEN, CLASSES = 64, 64, 96, 10


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(DIM, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, DIM)
        self.head = nn.Linear(DIM, CLASSES)  # 10 outputs: not an MX shape, stays nn.Linear

    def forward(self, x):
        return self.head(x + self.fc2(F.gelu(self.fc1(x))))


def make_mx_model() -> nn.Module:
    torch.manual_seed(0)
    model = convert_to_mxfp8(MLP(), filter=lambda name, m: name in ("fc1", "fc2"))
    assert isinstance(model.fc1, MXLinear) and isinstance(model.fc2, MXLinear)
    assert not isinstance(model.head, MXLinear)
    return model


def micro_batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(TOKENS, DIM, generator=g), torch.randint(0, CLASSES, (TOKENS,), generator=g))
            for _ in range(3)]


def reduced_grads(model: DataParallel, rank: int) -> list[torch.Tensor]:
    """The part of every gradient buffer this rank holds reduced values for."""
    out = []
    for buf in model.flat_buffers:
        for b in range(len(buf.layout.buckets)):
            lo, hi = buf.layout.shard_range(b, rank)
            out.append(buf.grad_data[lo:hi])
    return out


def run_step(model: DataParallel, rank: int, *, fused: bool) -> None:
    weights = [m.weight for _, m in fused_wgrad_modules(model.module)]
    batches = micro_batches(rank)
    for i, (x, y) in enumerate(batches):
        loss = F.cross_entropy(model(x), y) / len(batches)
        if i < len(batches) - 1:
            with model.no_sync():
                loss.backward()
        else:
            loss.backward()
        if fused:
            assert all(w.grad is None for w in weights), "a fused wgrad must not allocate param.grad"
    model.finish_grad_sync()


def check_mode(mode: Mode) -> None:
    rank = dist.get_rank()
    config = DDPConfig(bucket_numel=4000)
    fused_model = make_mx_model()
    modes = {n: mode for n, _ in fused_model.named_parameters()}
    fused = DataParallel(fused_model, config=config, modes=modes)
    plain = DataParallel(make_mx_model(), config=config, modes=modes)
    for _, m in fused_wgrad_modules(plain.module):
        m.bind_grad_sink(None)  # the unfused reference: autograd grads, copied by the DDP hook
    for buf in fused.flat_buffers:
        for view in buf.main_grads:
            assert view.data_ptr() % (64 * view.element_size()) == 0, "MXFP8 wgrad needs 64-element starts"
    for step in range(2):  # step 0 learns readiness, step 1 overlaps (fused mark_ready must count)
        fused.zero_grad_buffer()
        plain.zero_grad_buffer()
        run_step(fused, rank, fused=True)
        run_step(plain, rank, fused=False)
        launched = len(fused._works)
        assert launched == len(fused._refs)
        for a, b in zip(reduced_grads(fused, rank), reduced_grads(plain, rank)):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=lambda m: f"{mode.value} step {step}: {m}")
        assert any(g.abs().sum() > 0 for g in reduced_grads(fused, rank))


@case(2, 3)
def case_fused_equals_unfused_replicated(rank, ws):
    check_mode(Mode.REPLICATED)


@case(2, 3)
def case_fused_equals_unfused_sharded(rank, ws):
    check_mode(Mode.SHARDED)


@case(2, 3)
def case_fused_equals_unfused_layerwise(rank, ws):
    check_mode(Mode.LAYERWISE)


@case(2)
def case_fused_wgrad_overlaps_after_the_first_step(rank, ws):
    """mark_ready from the fused kernel counts toward readiness: from step 1 on, every bucket
    launches during backward, none waits for finish_grad_sync."""
    model = DataParallel(make_mx_model(), config=DDPConfig(bucket_numel=2000))
    assert len(model._refs) > 1
    for step in range(2):
        model.zero_grad_buffer()
        x, y = micro_batches(rank)[0]
        F.cross_entropy(model(x), y).backward()
        launched_in_backward = len(model._works)
        model.finish_grad_sync()
        if step == 1:
            assert launched_in_backward == len(model._refs)


make_tests(globals())
