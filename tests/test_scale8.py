"""The data-parallel paths at D = 8 on gloo (8 CPU processes, tiny models), against one process.

The 8-GPU scaling run (issue "Scaling run on 8 GPUs of one host") needs a machine that is not
lent yet; these cases run the same code paths at the same world size so that only the hardware
is new when it is: plain DDP with several buckets, ZeRO-1 with param groups (params straddle
the 8 slices), and layer-wise Muon (owners balanced over 8 ranks, fewer matrices than ranks
in one net), each compared step by step with torch's optimizer on one process with the
global batch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import aligndp
from aligndp.plan.routing import route_params
from aligndp.plan.spec import Mode
from tests import models
from tests._dist import case, make_tests
from tests.models import (
    ADAMW_GAIN,
    BASE,
    MUON_GAIN,
    ONE_MATRIX,
    assert_params_match,
    assert_replicas_identical,
    fp32_newton_schulz,
    loss_of,
    order_tolerance,
)
from tests.models import make_shaped_net as make_net

GLOBAL_BATCH = 16  # divisible by 8
STEPS = 3
TERMS = GLOBAL_BATCH * models.TOKENS  # one process sums the 80 token rows; 8 ranks sum 10 each


def batch(step: int, rank: int = 0, ws: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank's rows of the global batch of ``step``: 16 rows, divisible by 8."""
    return models.batch(step, rank, ws, rows=GLOBAL_BATCH, seed=500)


def compare_with_one_process(model, opt, ref, ref_opts, *, rel: float, what: str) -> None:
    rank, ws = dist.get_rank(), dist.get_world_size()
    for step in range(STEPS):
        loss_of(model, *batch(step, rank, ws)).backward()
        opt.step()
        opt.zero_grad()
        loss_of(ref, *batch(step)).backward()
        for ref_opt in ref_opts:
            ref_opt.step()
            ref_opt.zero_grad()
        assert_replicas_identical(model.module, f"{what} step {step}")
        assert_params_match(model.module, ref, f"{what} step {step}", rel)


@case(8)
def case_ddp_several_buckets_sgd(rank, ws):
    """Plain DDP, 4+ buckets, SGD with momentum (a gradient-scale error would show)."""
    model, opt = aligndp.parallelize(
        make_net(BASE), optimizer="sgd", lr=0.1, momentum=0.9, bucket_numel=150
    )
    assert len(model.bucket_refs) >= 4
    ref = make_net(BASE)
    compare_with_one_process(
        model,
        opt,
        ref,
        [torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)],
        rel=order_tolerance(terms=TERMS, steps=STEPS),  # SGD: gain 1 (momentum averages steps)
        what="ddp",
    )


@case(8)
def case_zero1_param_groups(rank, ws):
    """ZeRO-1 AdamW with two param groups: every param is cut by some of the 8 slices."""

    def groups(name, p):
        return {"weight_decay": 0.0 if p.ndim < 2 else 0.1}

    model, opt = aligndp.parallelize(
        make_net(BASE), sharding="zero1", lr=1e-2, bucket_numel=300, param_groups=groups
    )
    assert {layout.mode for layout in model.layouts} == {Mode.SHARDED}
    owned = sum(p.segment.numel for p in opt.pieces)
    total = [torch.tensor([owned])]
    dist.all_reduce(total[0])
    assert int(total[0]) == sum(p.numel() for p in model.module.parameters())
    ref = make_net(BASE)
    ref_groups = [
        {"params": [p for p in ref.parameters() if p.ndim >= 2], "weight_decay": 0.1},
        {"params": [p for p in ref.parameters() if p.ndim < 2], "weight_decay": 0.0},
    ]
    compare_with_one_process(
        model,
        opt,
        ref,
        [torch.optim.AdamW(ref_groups, lr=1e-2)],
        rel=order_tolerance(terms=TERMS, steps=STEPS, gain=ADAMW_GAIN),
        what="zero1",
    )


@case(8)
def case_layerwise_muon(rank, ws):
    """Layer-wise Muon at dp 8: every matrix has exactly one owner, the rest is ZeRO-1 AdamW."""
    for shape in (BASE, ONE_MATRIX):
        with fp32_newton_schulz():
            model, opt = aligndp.parallelize(
                make_net(shape),
                optimizer="muon",
                sharding="zero1",
                lr=0.02,
                adamw_lr=0.01,
                bucket_numel=150,
            )
            ref = make_net(shape)
            routing = route_params(ref)
            named = dict(ref.named_parameters())
            ref_opts = [
                torch.optim.Muon(
                    [named[n] for n in routing.whole], lr=0.02, adjust_lr_fn="match_rms_adamw"
                ),
                torch.optim.AdamW([named[n] for n in routing.adamw], lr=0.01),
            ]
            muon_rel = order_tolerance(terms=TERMS, steps=STEPS, gain=MUON_GAIN)
            compare_with_one_process(model, opt, ref, ref_opts, rel=muon_rel, what=f"muon {shape}")
        muon = opt.parts[0]
        mine = [muon.names[i] for i in muon.owned]
        every: list[list[str]] = [None] * ws  # type: ignore[list-item]
        dist.all_gather_object(every, mine)
        assert sorted(n for names in every for n in names) == sorted(routing.whole), every


make_tests(globals())
