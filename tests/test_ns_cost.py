"""Newton–Schulz device cost ([Note: Newton–Schulz device cost] in optim/ns_cost.py): the fit,
the planner with a fixed cost per part, the rehearsal's measured balance, and the fake
backend's timed steps moving nothing. CPU, one process, fast."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

import aligndp.app.rehearse_cost as rehearse_cost
from aligndp.app.rehearse import RehearsalOptions, plan_layouts, rehearse
from aligndp.app.rehearse_cost import rank_ns_parts
from aligndp.models.gpt import GPTConfig
from aligndp.optim.muon import MUON_SPLIT, newton_schulz_cost, newton_schulz_part_cost
from aligndp.optim.ns_cost import (
    CPU_NS_COST,
    FLOPS_NS_COST,
    FLOPS_SPLIT,
    H200_NS_COST,
    PART_OVER_FIXED,
    NewtonSchulzCost,
    fit_ns_cost,
    ns_cost_for,
    part_madds,
)
from aligndp.plan.layout import plan_layout
from aligndp.plan.spec import Mode, ParamSpec, max_over_mean
from aligndp.plan.split import plan_splits
from aligndp.runtime.fake_world import init_fake_world, moving_nothing

F = 2.0**23
"""A fixed cost in multiply-add units: 128²·512, so hand-worked loads come out in halves."""
DEVICE = NewtonSchulzCost(F, 1.0, "test: a fixed cost of 2^23 multiply-adds per part")


def test_fit_recovers_known_parameters():
    truth = NewtonSchulzCost(25e-6, 1 / 300e12, "truth")
    shapes = [(m, c, r) for m in (768, 2048) for c in (128, 512, 2048, 8192) for r in (0, m)]
    exact = [(part_madds(*s), truth.seconds(*s)) for s in shapes]
    got = fit_ns_cost(exact, source="synthetic")
    assert got.fixed_s == pytest.approx(truth.fixed_s, rel=1e-9)
    assert got.s_per_madd == pytest.approx(truth.s_per_madd, rel=1e-9)
    assert got.source == "synthetic"
    rng = random.Random(0)  # 3 % noise on every timing: both figures within 5 %
    noisy = [(x, y * (1 + rng.uniform(-0.03, 0.03))) for x, y in exact]
    got = fit_ns_cost(noisy, source="noisy")
    assert got.fixed_s == pytest.approx(truth.fixed_s, rel=0.05)
    assert got.s_per_madd == pytest.approx(truth.s_per_madd, rel=0.05)


def test_fit_without_a_fixed_cost_goes_through_zero_and_refuses_one_size():
    # time proportional to the flops, a little less for small parts: no fixed cost to find
    samples = [(x, x * 1e-12 * (0.9 if x < 1e9 else 1.0)) for x in (1e8, 5e8, 2e9, 8e9)]
    got = fit_ns_cost(samples, source="s")
    assert got.fixed_s == 0.0 and got.s_per_madd > 0
    with pytest.raises(ValueError, match="at least 2 part sizes"):
        fit_ns_cost([(1e9, 1.0), (1e9, 1.1)], source="s")


def test_costs_refuse_nonsense_and_name_the_devices():
    with pytest.raises(ValueError, match="fixed_s >= 0 and s_per_madd > 0"):
        NewtonSchulzCost(-1.0, 1e-12, "bad")
    with pytest.raises(ValueError, match="s_per_madd > 0"):
        NewtonSchulzCost(0.0, 0.0, "bad")
    assert ns_cost_for("cpu") is CPU_NS_COST and ns_cost_for("cuda") is H200_NS_COST
    with pytest.raises(ValueError, match="choose one of cpu, cuda, flops"):
        ns_cost_for("tpu")


def test_flops_cost_is_the_flops_model():
    """FLOPS_NS_COST keeps the hand-worked plans' meaning: Muon's multiply-add counts, the
    parts adding up to the whole, and 2^24 multiply-adds for the smallest part."""
    for shape in [(768, 3072), (3072, 768), (64, 64)]:
        assert FLOPS_NS_COST.whole_cost(shape) == newton_schulz_cost(shape)
    assert FLOPS_NS_COST.part_cost((3072, 768), 1536, 384) == newton_schulz_part_cost(
        (3072, 768), 1536, 384
    )
    assert FLOPS_NS_COST.whole_cost((3, 4, 5)) == newton_schulz_cost((3, 4, 5)) == 60
    assert FLOPS_SPLIT.min_part_cost == 2.0**24 and FLOPS_SPLIT.cost is None
    # a device's smallest part follows from its fixed cost
    assert DEVICE.policy().min_part_cost == PART_OVER_FIXED * F
    assert MUON_SPLIT.min_part_cost == PART_OVER_FIXED * H200_NS_COST.fixed_s
    # one part costs iterations · (fixed + madds · s)
    assert DEVICE.seconds(128, 384, 128, iterations=5) == 5 * (F + 128**2 * (768 + 128))


def _device_loads(shapes, owners, splits, dp):
    loads = [0.0] * dp
    for shape, owner, split in zip(shapes, owners, splits):
        if split is None:
            loads[owner] += DEVICE.whole_cost(shape)
            continue
        for rank, cols, rows in zip(
            split.ranks, zip(split.cols, split.cols[1:]), zip(split.rows, split.rows[1:])
        ):
            loads[rank] += DEVICE.part_cost(shape, cols[1] - cols[0], rows[1] - rows[0])
    return loads


def test_fixed_cost_splits_less_and_balances_the_device_better_by_hand():
    """Two ranks: A = 128 x 128 on rank 0 (128²·384 = 0.75 F), B = 128 x 384 on rank 1
    (128²·896 = 1.75 F). Only the fixed cost differs between the policies (no smallest part).

    Flops alone: 0.75 / 1.75 is 1.4 over the mean, so B is cut in two, 256 columns on its
    owner (128²·512 = 1.0 F, no rows of B) and 128 columns with every row on rank 0
    (128²·384 = 0.75 F): 1.5 F / 1.0 F by the flops. On the device every part pays F:
    rank 0 holds A (0.75 F + F) and B's part (0.75 F + F) = 3.5 F, against 2.75 F for B whole
    on rank 1 — the cut made the slowest rank slower. With the fixed cost in the model the
    planner sees it and leaves both whole: max 2.75 F."""
    shapes, owners = [(128, 128), (128, 384)], [0, 1]
    flops = dataclasses.replace(FLOPS_SPLIT, min_part_cost=0)
    device = DEVICE.policy(min_part_cost=0)
    by_flops = plan_splits(shapes, owners, dp_size=2, cost=newton_schulz_cost, policy=flops)
    assert by_flops[0] is None
    assert by_flops[1].ranks == (1, 0) and by_flops[1].cols == (0, 256, 384)
    assert by_flops[1].rows == (0, 0, 128) and by_flops[1].costs == (F, 0.75 * F)
    by_device = plan_splits(shapes, owners, dp_size=2, cost=newton_schulz_cost, policy=device)
    assert by_device == [None, None]
    assert _device_loads(shapes, owners, by_flops, 2) == [3.5 * F, 2.0 * F]
    assert _device_loads(shapes, owners, by_device, 2) == [1.75 * F, 2.75 * F]


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 300), st.integers(1, 300)), min_size=1, max_size=10),
    st.integers(1, 8),
    st.floats(0.0, 2.0**22),
    st.data(),
)
def test_fixed_cost_splits_never_slow_the_slowest_rank(mats, dp, fixed, data):
    """Any plan by a device cost: each part pays the fixed cost once (a matrix cut in k parts
    costs its whole cost plus (k - 1) fixed costs), and no rank ends above the slowest rank
    of the unsplit plan, whatever the fixed cost."""
    cost = NewtonSchulzCost(fixed, 1.0, "property")
    policy = cost.policy(min_cols=1, col_multiple=1, min_part_cost=0)
    owners = [data.draw(st.integers(0, dp - 1)) for _ in mats]
    splits = plan_splits(mats, owners, dp_size=dp, cost=newton_schulz_cost, policy=policy)
    before, after = [0.0] * dp, [0.0] * dp
    for shape, owner, split in zip(mats, owners, splits):
        before[owner] += cost.whole_cost(shape)
        if split is None:
            after[owner] += cost.whole_cost(shape)
            continue
        k = len(split.ranks)
        assert sum(split.costs) == pytest.approx(cost.whole_cost(shape) + (k - 1) * fixed)
        for rank, c in zip(split.ranks, split.costs):
            after[rank] += c
    assert max(after) <= max(before) * (1 + 1e-12)


def test_smallest_part_is_two_fixed_costs_by_hand():
    """128 x 1024 has 128²·2176 = 4.25 F multiply-adds; a part must cost 2 F, fixed cost
    included: 4 parts of F + 1.06 F are allowed, 5 of F + 0.85 F are not (a budget of one
    unit cuts as far as allowed). Counting the whole (5.25 F) against 2 F would allow 2."""
    policy = DEVICE.policy(budget=1.0)
    (split,) = plan_splits([(128, 1024)], [0], dp_size=8, cost=newton_schulz_cost, policy=policy)
    assert len(split.ranks) == 4 and split.cols == (0, 256, 512, 768, 1024)
    assert split.rows == (0, 32, 64, 96, 128)
    assert split.costs == (F + 128**2 * 544,) * 4 and min(split.costs) >= 2 * F


def test_policy_cost_balances_owners_in_its_units():
    """plan_layout with a policy that has a whole-param cost records that cost in every slot,
    so rank_costs() adds parts and whole params in one unit."""
    specs = [ParamSpec(f"w{i}", (64, 64 * (i + 1))) for i in range(6)]
    layout = plan_layout(
        specs, dp_size=4, mode="layerwise", owner_cost=newton_schulz_cost, split=DEVICE.policy()
    )
    for p in layout.params:
        assert p.cost == DEVICE.whole_cost(p.shape)
    modelled = [sum(DEVICE.seconds(*part) for part in mine) for mine in rank_ns_parts(layout)]
    assert layout.rank_costs() == pytest.approx(modelled, rel=1e-12)


def test_cuda_plans_split_less_than_flops_on_gpt2_small():
    """gpt2-small at D = 64 under the shipped H200 cost: fewer of its 768-row matrices are
    worth cutting than by the flops alone (39; none by the 2026-12-07 guess of 30 us per
    part), and the slowest rank is no slower by that cost."""
    options = RehearsalOptions(
        preset="gpt2-small", dp_size=64, sharding="zero1", optimizer="muon", ranks=None
    )
    by_flops = plan_layouts(dataclasses.replace(options, ns_cost=FLOPS_NS_COST))
    by_h200 = plan_layouts(dataclasses.replace(options, ns_cost=H200_NS_COST))
    (flops,) = [lo for lo in by_flops if lo.mode is Mode.LAYERWISE]
    (h200,) = [lo for lo in by_h200 if lo.mode is Mode.LAYERWISE]
    assert len(h200.splits) < len(flops.splits)

    def modelled(lo):
        return max(sum(H200_NS_COST.seconds(*p) for p in mine) for mine in rank_ns_parts(lo))

    assert modelled(h200) <= modelled(flops)


CONFIG = GPTConfig(vocab_size=64, seq_len=8, dim=128, num_layers=2, head_dim=32)


def test_rehearsal_balance_uses_measured_part_times(monkeypatch):
    """With every rank (--rank all), the rehearsal's Newton–Schulz max / mean is over the
    *measured* seconds of each rank's parts: a device on which every part takes 1 s, whatever
    its flops, gives the max / mean of the ranks' part counts."""
    timed = []

    def one_second(m, cols, rows, *, device, ns_steps=5, repeats=3):
        timed.append((m, cols, rows))
        return 1.0

    monkeypatch.setattr(rehearse_cost, "ns_part_seconds", one_second)
    options = RehearsalOptions(
        config=CONFIG, dp_size=4, ranks=None, sample=0, sharding="zero1", optimizer="muon",
        ns_cost=FLOPS_NS_COST,
    )  # fmt: skip
    result = rehearse(options)
    (layout,) = [lo for lo in plan_layouts(options) if lo.mode is Mode.LAYERWISE]
    counts = [len(mine) for mine in rank_ns_parts(layout)]
    assert [r.ns_seconds for r in result.ranks] == [float(c) for c in counts]
    assert result.ns_max_over_mean == pytest.approx(max_over_mean(counts))
    assert len(timed) == len(set(timed))  # each distinct part shape timed once


def test_timed_fake_collectives_never_reach_the_backend():
    """torch's fake backend copies an all-gather's input into every rank's slot and splits
    every all-gather and reduce-scatter into one chunk per rank (work that grows with D,
    counted as the rehearsed step's time); inside moving_nothing() those collectives return
    a completed Work without reaching the backend (no c10d op is dispatched) and leave their
    outputs alone, an all-reduce still runs, and leaving restores the backend's methods."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Dispatched(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if str(func).startswith("c10d."):
                self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    with pytest.raises(ValueError, match="rehearsal"):
        with moving_nothing():
            pass
    init_fake_world(0, 4)
    try:
        x, out, y = torch.ones(8), torch.zeros(32), torch.zeros(8)

        def collectives() -> None:
            dist.all_gather_into_tensor(out, x, async_op=True).wait()
            dist.all_gather([torch.zeros(8) for _ in range(4)], x)
            dist.gather(x, [torch.zeros(8) for _ in range(4)], dst=0)
            dist.reduce_scatter_tensor(y, out, async_op=True).wait()
            dist.reduce_scatter(y, [torch.zeros(8) for _ in range(4)])

        with Dispatched() as plain:
            collectives()
        assert out.sum() == 32 and len(plain.ops) == 5, plain.ops  # the fake backend's copies
        for _ in range(2):  # entered again after leaving: the methods are restored intact
            out.zero_()
            with moving_nothing(), Dispatched() as quiet:
                collectives()
                dist.all_reduce(x)
            assert out.sum() == 0, "an all-gather inside moving_nothing() copied"
            assert quiet.ops == ["c10d.allreduce_.default"], quiet.ops
        dist.all_gather_into_tensor(out, x)
        assert out.sum() == 32
    finally:
        dist.destroy_process_group()


def test_rehearsed_timed_steps_run_inside_moving_nothing(monkeypatch):
    """measure_step on the fake backend: the warm-up and probed steps move as torch's fake
    backend does (the probe counts them), every timed step runs inside moving_nothing()."""
    import contextlib

    import aligndp.app.rehearse_step as rehearse_step
    from aligndp.app.rehearse import rehearse_rank

    entered = []
    real = rehearse_step.moving_nothing

    @contextlib.contextmanager
    def counted():
        with real():
            entered.append(True)
            yield

    monkeypatch.setattr(rehearse_step, "moving_nothing", counted)
    options = RehearsalOptions(config=CONFIG, dp_size=4, sharding="zero1", steps=3)
    got = rehearse_rank(options, 1)
    assert len(entered) == 3
    assert any(c.kind == "all_gather" for c in got.collectives)  # the probed step's, counted


def test_rehearse_cli_picks_the_plan_cost():
    import argparse

    from aligndp.app import rehearse_cli

    parser = argparse.ArgumentParser()
    rehearse_cli.add_arguments(parser)
    base = ["--nproc", "4", "--sharding", "zero1", "--optimizer", "muon"]
    default = rehearse_cli.options_from_args(parser.parse_args(base))
    assert default.ns_cost is None and default.split_policy == CPU_NS_COST.policy()
    flops = rehearse_cli.options_from_args(parser.parse_args([*base, "--ns-cost", "flops"]))
    assert flops.ns_cost is FLOPS_NS_COST
    assert flops.parallelize_kwargs()["split"] == FLOPS_NS_COST.policy()
    cuda = rehearse_cli.options_from_args(parser.parse_args([*base, "--ns-cost", "cuda"]))
    assert cuda.split_policy == MUON_SPLIT  # what parallelize plans with by default
