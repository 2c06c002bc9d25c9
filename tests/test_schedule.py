"""The warm-up + cosine schedule is a torch LRScheduler stepping the optimizer parallelize()
returns, and any torch scheduler steps that optimizer as it steps torch's own.

Before: ``aligndp train`` set each group's lr by hand every step (``_set_lr``)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.optim.lr_scheduler import CosineAnnealingLR, LinearLR, OneCycleLR, SequentialLR

import aligndp
from aligndp.app.schedule import lr_factor, warmup_cosine
from aligndp.models import GPT, PRESETS


def lrs(scheduler, optimizer, steps: int) -> list[float]:
    seen = []
    for _ in range(steps):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return seen


@pytest.mark.parametrize("steps", [100, 400, 7])
def test_warmup_cosine_is_torchs_linear_then_cosine(steps):
    """The closed form (LambdaLR) against torch's own pieces: LinearLR over the warm-up, then
    CosineAnnealingLR down to a tenth of the peak at the last step."""
    peak, warmup = 0.01, min(20, steps // 10)
    ours_opt = torch.optim.SGD([torch.zeros(2, requires_grad=True)], lr=peak)
    ours = lrs(warmup_cosine(ours_opt, steps=steps, peak_lrs=[peak]), ours_opt, steps)
    ref_opt = torch.optim.SGD([torch.zeros(2, requires_grad=True)], lr=peak)
    cosine = CosineAnnealingLR(ref_opt, T_max=steps - 1 - warmup, eta_min=peak / 10)
    if warmup:
        linear = LinearLR(ref_opt, 1 / warmup, 1.0, total_iters=warmup - 1)
        ref = SequentialLR(ref_opt, [linear, cosine], milestones=[warmup])
    else:
        ref = cosine
    assert ours == pytest.approx(lrs(ref, ref_opt, steps), rel=1e-9)
    assert ours == pytest.approx([peak * lr_factor(s, steps) for s in range(steps)], rel=1e-12)


def test_a_resumed_schedule_starts_where_the_run_stopped():
    peak, steps = 0.003, 60
    opt = torch.optim.SGD([torch.zeros(2, requires_grad=True)], lr=peak)
    whole = lrs(warmup_cosine(opt, steps=steps, peak_lrs=[peak]), opt, steps)
    opt = torch.optim.SGD([torch.zeros(2, requires_grad=True)], lr=0.5)  # a loaded lr: not peak
    resumed = warmup_cosine(opt, steps=steps, peak_lrs=[peak], start_step=25)
    assert lrs(resumed, opt, steps - 25) == pytest.approx(whole[25:], rel=1e-12)


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("sharding", ["none", "zero1"])
def test_a_users_torch_scheduler_steps_the_aligndp_optimizer(one_rank, sharding):
    """OneCycleLR on the optimizer parallelize() returns moves the params as it moves those of
    torch.optim.AdamW on the same model and batches."""
    torch.manual_seed(0)
    module = GPT(PRESETS["tiny-odd"])
    reference = GPT(PRESETS["tiny-odd"])
    reference.load_state_dict(module.state_dict())
    model, optimizer = aligndp.parallelize(module, optimizer="adamw", sharding=sharding, lr=1e-3)
    torch_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    ours = OneCycleLR(optimizer, max_lr=1e-2, total_steps=6)
    theirs = OneCycleLR(torch_opt, max_lr=1e-2, total_steps=6)
    gen = torch.Generator().manual_seed(1)
    for _ in range(6):
        x = torch.randint(0, 97, (4, 32), generator=gen)
        y = torch.randint(0, 97, (4, 32), generator=gen)
        for net, opt, sched in ((model, optimizer, ours), (reference, torch_opt, theirs)):
            net(x, y).backward()
            opt.step()
            opt.zero_grad()
            sched.step()
        assert ours.get_last_lr() == pytest.approx(theirs.get_last_lr(), rel=1e-12)
    for (name, p), q in zip(module.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
