"""Split Newton–Schulz plans ([Note: split Newton–Schulz] in plan/split.py): pure, no processes.

The balance goals of issue 24 on the GPT presets (specs from a meta-device model, as
``aligndp layout`` builds them), the cost model by hand, and properties over random plans;
all in the flops model (``FLOPS_SPLIT``; a device's fixed cost per part: test_ns_cost.py).
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aligndp.app.layout_cli import LayoutOptions, preset_model
from aligndp.optim.muon import FLOPS_SPLIT, newton_schulz_cost, newton_schulz_part_cost
from aligndp.plan.layout import plan_layout
from aligndp.plan.request import plan_buffers
from aligndp.plan.spec import Mode, ParamSpec, max_over_mean
from aligndp.plan.split import SplitPolicy, plan_splits, split_bounds

EAGER = dataclasses.replace(FLOPS_SPLIT, min_cols=1, col_multiple=1, min_part_cost=0)
"""Splits anything, however small (what the gloo tests force with tiny matrices)."""


def layerwise(preset: str, dp: int, split: SplitPolicy = FLOPS_SPLIT):
    request = LayoutOptions(
        model=preset_model(preset), dp_size=dp, mode=Mode.LAYERWISE, optimizer="muon"
    ).request()
    layouts = plan_buffers(dataclasses.replace(request, split=split))
    (layout,) = [lo for lo in layouts if lo.mode is Mode.LAYERWISE]
    return layout


@pytest.mark.parametrize("preset", ["1b", "gpt2-small"])
def test_presets_balanced_at_scale(preset):
    """Issue 24's goal: Newton–Schulz cost max/mean <= 1.05 at D <= 32 and <= 1.10 at D = 64
    (whole matrices per owner gave 1.17/1.33 at 32 and 1.33/1.78 at 64). Splitting moves flops
    and adds none: the ranks' costs still add up to the matrices' whole costs."""
    for dp in (8, 16, 32, 64):
        layout = layerwise(preset, dp)
        goal = 1.10 if dp == 64 else 1.05
        costs = layout.rank_costs()
        assert max_over_mean(costs) <= goal, f"{preset} at D={dp}: {max_over_mean(costs):.3f}"
        whole = sum(newton_schulz_cost(p.shape) for p in layout.params)
        assert sum(costs) == pytest.approx(whole, rel=1e-12)
        for p in layout.splits:
            assert p.split.ranks[0] == p.owner and len(set(p.split.ranks)) == len(p.split.ranks)
            widths = [b - a for a, b in zip(p.split.cols, p.split.cols[1:])]
            assert min(widths) >= FLOPS_SPLIT.min_cols, (p.name, widths)
            assert all(w % 128 == 0 for w in widths), (p.name, widths)  # preset widths allow it


def test_cost_model_by_hand():
    # 768 x 3072 (m = 768, n = 3072): X Xᵀ and B X are 768²·3072 each, A·A is 768³
    assert newton_schulz_cost((768, 3072)) == 768**2 * (2 * 3072 + 768)
    assert newton_schulz_cost((3072, 768)) == newton_schulz_cost((768, 3072))
    # in 2 parts of 1536 columns: rows (2·3072 + 768)/2 - 2·1536 = 384 each
    cols, rows = split_bounds((3072, 768), 2, FLOPS_SPLIT)
    assert cols == (0, 1536, 3072) and rows == (0, 384, 768)
    assert newton_schulz_part_cost((3072, 768), 1536, 384) == 768**2 * (2 * 1536 + 384)
    # widths multiples of 128, the last takes the rest: 1000 holds 7 units of 128, cut 3, 2, 2,
    # and 104 columns left over: 384, 256, 360
    cols, rows = split_bounds((8, 1000), 3, FLOPS_SPLIT)
    assert cols == (0, 384, 640, 1000)
    # part work 2·n_j + r_j as equal as can be: (2000 + 8)/3 = 669.3 leaves rows only for the
    # 256-wide part (2·384 and 2·360 are above it already): all 8
    assert rows == (0, 0, 8, 8)


def test_one_matrix_on_two_ranks_by_hand():
    # 128 x 1024 owned by rank 0 of 2, nothing else: whole 128²·(2048 + 128); in 2 parts of 512
    # columns and 64 rows each, 128²·1088 on each rank: imbalance 1
    (split,) = plan_splits([(128, 1024)], [0], dp_size=2, cost=newton_schulz_cost, policy=EAGER)
    assert split.ranks == (0, 1) and split.cols == (0, 512, 1024) and split.rows == (0, 64, 128)
    assert split.costs == (128**2 * 1088.0, 128**2 * 1088.0)
    # the flops policy keeps parts of at least 2^24 multiply-adds: 128²·1088 is 2^24·1.06,
    # but 64 x 1024 is only 64²·2112 = 2^24·0.52 whole
    default = plan_splits(
        [(128, 1024)], [0], dp_size=2, cost=newton_schulz_cost, policy=FLOPS_SPLIT
    )
    assert default == [split]
    small = plan_splits([(64, 1024)], [0], dp_size=2, cost=newton_schulz_cost, policy=FLOPS_SPLIT)
    assert small == [None]
    # a balanced plan is left alone; a budget splits what costs more than it
    two = [(128, 1024), (128, 1024)]
    assert plan_splits(two, [0, 1], dp_size=2, cost=newton_schulz_cost, policy=EAGER) == [None] * 2
    budget = dataclasses.replace(EAGER, budget=newton_schulz_cost((128, 1024)) / 2)
    forced = plan_splits(two, [0, 1], dp_size=4, cost=newton_schulz_cost, policy=budget)
    assert [s.ranks for s in forced] == [(0, 2), (1, 3)]


def test_layout_records_splits_and_rank_costs():
    specs = [ParamSpec("big", (64, 4096)), ParamSpec("small", (64, 64))]
    layout = plan_layout(
        specs, dp_size=4, mode="layerwise", owner_cost=newton_schulz_cost, split=EAGER
    )
    big = layout.param("big")
    assert big.split is not None and big.split.ranks[0] == big.owner
    costs = [0.0] * 4
    for p in layout.params:
        for r, c in zip(*((p.split.ranks, p.split.costs) if p.split else ((p.owner,), (p.cost,)))):
            costs[r] += c
    assert layout.rank_costs() == costs and layout.imbalance <= EAGER.target
    assert "split" in str(layout) and layout.to_dict()["params"][0]["split"] is not None


def test_policy_refuses_bad_settings():
    with pytest.raises(ValueError, match="target"):
        SplitPolicy(newton_schulz_part_cost, target=0.9)
    with pytest.raises(ValueError, match="min_cols"):
        SplitPolicy(newton_schulz_part_cost, min_cols=0)
    with pytest.raises(TypeError, match="part_cost"):
        SplitPolicy(3)


shapes = st.tuples(st.integers(1, 300), st.integers(1, 300))


@settings(max_examples=200, deadline=None)
@given(
    st.lists(shapes, min_size=1, max_size=12),
    st.integers(1, 9),
    st.data(),
)
def test_splits_partition_columns_and_never_share_a_rank(mats, dp, data):
    owners = [data.draw(st.integers(0, dp - 1)) for _ in mats]
    policy = dataclasses.replace(
        EAGER,
        target=data.draw(st.floats(1.0, 1.5)),
        max_parts=data.draw(st.integers(1, 9)),
        col_multiple=data.draw(st.sampled_from([1, 4, 64])),
    )
    splits = plan_splits(mats, owners, dp_size=dp, cost=newton_schulz_cost, policy=policy)
    loads = [0.0] * dp
    before = [0.0] * dp
    for shape, owner, split in zip(mats, owners, splits):
        before[owner] += newton_schulz_cost(shape)
        if split is None:
            loads[owner] += newton_schulz_cost(shape)
            continue
        m, n = min(shape), max(shape)
        k = len(split.ranks)
        assert 2 <= k <= min(policy.max_parts, dp)
        assert split.ranks[0] == owner and len(set(split.ranks)) == k  # never two parts on a rank
        assert split.cols[0] == 0 and split.cols[-1] == n  # every column exactly once
        assert all(a < b for a, b in zip(split.cols, split.cols[1:]))
        assert split.rows[0] == 0 and split.rows[-1] == m  # every row of B exactly once
        assert all(a <= b for a, b in zip(split.rows, split.rows[1:]))
        assert sum(split.costs) == pytest.approx(newton_schulz_cost(shape), rel=1e-12)
        for r, c in zip(split.ranks, split.costs):
            loads[r] += c
    assert max(loads) <= max(before) * (1 + 1e-12)  # splitting never makes the slowest slower


def _least_max_work(m: int, widths: list[int]) -> int:
    """Brute force: the least possible ``max_j 2·n_j + r_j`` over every split of ``m`` rows."""
    best = None

    def rows_from(j: int, left: int, worst: int) -> None:
        nonlocal best
        if j == len(widths) - 1:
            worst = max(worst, 2 * widths[j] + left)
            best = worst if best is None else min(best, worst)
            return
        for r in range(left + 1):
            rows_from(j + 1, left - r, max(worst, 2 * widths[j] + r))

    rows_from(0, m, 0)
    return best


def test_leftover_rows_go_where_they_keep_the_largest_part_smallest():
    """Issue 42, planted bug: the rows left after rounding go to the parts rounded down most,
    so the largest part's work ``2·n_j + r_j`` is the least possible (brute force over every
    row split, small shapes); hand-worked: 6x6 in 5 parts has widths 2,1,1,1,1 and rows
    0,2,2,1,1 (largest work 4; the other way round gives 5)."""
    cols, rows = split_bounds((6, 6), 5, FLOPS_SPLIT)
    assert cols == (0, 2, 3, 4, 5, 6) and rows == (0, 0, 2, 4, 5, 6), (cols, rows)
    for a in range(2, 11):
        for b in range(2, 11):
            for k in range(2, 6):
                cols, rows = split_bounds((a, b), k, FLOPS_SPLIT)
                widths = [cols[j + 1] - cols[j] for j in range(k)]
                work = max(2 * w + rows[j + 1] - rows[j] for j, w in enumerate(widths))
                assert work == _least_max_work(min(a, b), widths), (a, b, k, rows)
