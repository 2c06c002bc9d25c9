"""The whole-matrix seam: a second whole-matrix optimizer, registered through the public API.

``OneSidedShampoo`` is a test-only torch optimizer whose state is not elementwise: an m×m
left preconditioner ``L += G Gᵀ`` per m×n matrix, update ``(L + eps·I)⁻¹ G``. Registered as
``"onesided"`` with its own cost (m³ + m²n: the solve and its application), it must run
through ``parallelize`` in both shardings with nothing Muon-specific: zero1 (each matrix
stepped whole by one owner, owners balanced by that cost) and sharding none match one
process running the same torch optimizer; its state is saved whole — including the 8×8
preconditioner of the 8×8 matrix, which has exactly the param's numel — and resumes exactly,
also at another dp size.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn

import aligndp
from aligndp.plan.layout import plan_layout
from aligndp.plan.routing import route_params
from aligndp.plan.spec import Mode, ParamSpec
from aligndp.state.model_space import FlatPiece, torch_state_to_model_space
from tests._dist import case, make_tests
from tests.models import (
    ADAMW_GAIN,
    GLOBAL_BATCH,
    TOKENS,
    assert_close,
    assert_params_match,
    batch,
    ckpt,
    loss_of,
    order_tolerance,
)
from tests.models import WHOLE_MATRICES as WHOLE
from tests.models import make_whole_matrix_net as make_net

LR, ADAMW_LR, EPS = 0.05, 0.01, 0.5
STEPS, SAVED_AT = 4, 2
REL = order_tolerance(terms=GLOBAL_BATCH * TOKENS, steps=STEPS, gain=ADAMW_GAIN)
"""fp32 against one process on the global batch's 60 token rows, over STEPS steps. AdamW's gain
bounds both parts: the preconditioner ``G Gᵀ`` doubles a relative gradient difference and the
float64 solve with ``eps = 0.5`` on the diagonal keeps it (gradients of order 0.1 give
``cond(L + eps I)`` near 1)."""


class OneSidedShampoo(torch.optim.Optimizer):
    """Test reference: a one-sided Shampoo-like step on 2-D params (not elementwise)."""

    def __init__(self, params, lr: float = 0.01, eps: float = 0.1):
        super().__init__(params, {"lr": lr, "eps": eps})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad  # (m, n)
                state = self.state[p]
                if not state:  # in the param's dtype: torch's load_state_dict casts to it
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["precond"] = torch.zeros(p.shape[0], p.shape[0], dtype=p.dtype)
                state["step"] += 1
                state["precond"] += g @ g.T  # (m, m)
                eye = torch.eye(p.shape[0], dtype=torch.float64)
                left = state["precond"].double() + group["eps"] * eye
                update = torch.linalg.solve(left, g.double())  # (m, n)
                p.sub_((group["lr"] * update).to(p.dtype))
        return None


def onesided_cost(shape) -> float:
    """The solve (m³) and applying it (m²n) for an m×n matrix."""
    m, n = shape
    return float(m**3 + m * m * n)


SPEC = aligndp.WholeMatrixSpec(OneSidedShampoo, cost=onesided_cost, options=("lr", "eps"))
aligndp.register_whole_matrix("onesided", SPEC)
# the same optimizer stepped once over every owned matrix instead of bucket by bucket
aligndp.register_whole_matrix("onesided-once", dataclasses.replace(SPEC, step_per_bucket=False))


class Reference:
    """One process, global batch: the same torch optimizers on the same split of params."""

    def __init__(self):
        self.net = make_net()
        routing = route_params(self.net)
        assert routing.whole == WHOLE, routing
        named = dict(self.net.named_parameters())
        self.opts = [
            OneSidedShampoo([named[n] for n in routing.whole], lr=LR, eps=EPS),
            torch.optim.AdamW([named[n] for n in routing.adamw], lr=ADAMW_LR),
        ]

    def train(self, steps: range) -> Reference:
        for step in steps:
            loss_of(self.net, *batch(step)).backward()
            for opt in self.opts:
                opt.step()
                opt.zero_grad()
        return self


def build(sharding: str, bucket_numel: int | None = 150, optimizer: str = "onesided"):
    return aligndp.parallelize(
        make_net(),
        optimizer=optimizer,
        sharding=sharding,
        lr=LR,
        eps=EPS,
        adamw_lr=ADAMW_LR,
        bucket_numel=bucket_numel,
    )


def train(model, opt, steps: range) -> None:
    for step in steps:
        loss_of(model, *batch(step, dist.get_rank(), dist.get_world_size())).backward()
        opt.step()
        opt.zero_grad()
    opt.gather.wait_all()


def assert_matches(model, ref: Reference, what: str) -> None:
    assert_params_match(model.module, ref.net, what, REL)


# ---- pure: registration and the owner cost ----


def test_unknown_optimizer_lists_the_registered_ones():
    with pytest.raises(ValueError, match=r"unknown optimizer 'soap'.*'muon'.*'onesided'"):
        aligndp.parallelize(make_net(), optimizer="soap")
    with pytest.raises(ValueError, match="registered already"):
        aligndp.register_whole_matrix("onesided", aligndp.WholeMatrixSpec(OneSidedShampoo, len))
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['momentum'\].*\['lr', 'eps'\]"):
        aligndp.parallelize(make_net(), optimizer="onesided", momentum=0.9)


def test_only_muon_may_share_a_matrix_over_ranks():
    """Split Newton–Schulz runs Muon's algorithm (aligndp/optim/split_ns.py): another
    optimizer given a split policy is refused when its spec is made, on every rank alike."""
    from aligndp.optim.muon import MUON_SPLIT

    with pytest.raises(ValueError, match="OneSidedShampoo cannot share a matrix's step"):
        aligndp.WholeMatrixSpec(OneSidedShampoo, onesided_cost, split=MUON_SPLIT)
    with pytest.raises(TypeError, match="split must be None .*, False or an aligndp.SplitPolicy"):
        aligndp.plan_request(make_net(), optimizer="muon", sharding="zero1", split="yes")
    request, _ = aligndp.plan_request(make_net(), optimizer="muon", sharding="zero1", split=False)
    assert request.split is None


def test_owners_balance_the_registered_cost():
    """dp 2, four 128-element matrices in one bucket, each rank room for two. By hand, with
    cost m³ + m²n: A 64x2 = 270,336, C 16x8 = 6,144, D 8x16 = 1,536, B 2x64 = 264. Greedy
    (largest first, to the cheapest rank that has room): A -> 0, C -> 1, D -> 1 (1's total is
    lower), B -> 0 (rank 1 is full). Counting numel instead (all equal) alternates in layout
    order D, C, B, A: D, B -> 0 and C, A -> 1 — so the cost function decides."""
    specs = [
        ParamSpec(n, s) for n, s in [("A", (64, 2)), ("B", (2, 64)), ("C", (16, 8)), ("D", (8, 16))]
    ]
    layout = plan_layout(specs, dp_size=2, mode="layerwise", owner_cost=onesided_cost)
    assert {p.name: p.owner for p in layout.params} == {"A": 0, "B": 0, "C": 1, "D": 1}
    assert layout.rank_costs() == [270_336 + 264, 6_144 + 1_536]
    assert layout.imbalance == pytest.approx(270_600 / ((270_600 + 7_680) / 2))
    by_numel = plan_layout(specs, dp_size=2, mode="layerwise")
    assert {p.name: p.owner for p in by_numel.params} == {"D": 0, "B": 0, "C": 1, "A": 1}


def test_whole_matrix_state_is_saved_whole():
    """Regression: model space decided per-element state by ``numel == param numel``, so the
    8×8 preconditioner of an 8×8 weight was flattened into a (64,) per-element piece and cut
    across shards on load. Parts now declare it: a whole-matrix part's state is whole."""
    w = nn.Parameter(torch.randn(8, 8))
    opt = OneSidedShampoo([w])
    w.grad = torch.randn(8, 8)
    opt.step()
    whole = torch_state_to_model_space(opt, ["w"], {"w": (0, 64)}, elementwise=False)
    assert isinstance(whole["state.w.precond"], torch.Tensor)
    assert whole["state.w.precond"].shape == (8, 8)
    assert torch.equal(whole["state.w.precond"], opt.state[w]["precond"])
    adamw = torch.optim.AdamW([w])
    adamw.step()
    pieces = torch_state_to_model_space(adamw, ["w"], {"w": (0, 64)}, elementwise=True)
    assert isinstance(pieces["state.w.exp_avg"], FlatPiece)
    assert pieces["state.w.exp_avg"].tensor.shape == (64,)


# ---- multi-rank: parity with one process, owners, checkpoints ----


@case(2, 3)
def case_matches_one_process(rank, ws):
    ref = Reference().train(range(STEPS))
    runs = [("zero1", "onesided"), ("zero1", "onesided-once"), ("none", "onesided")]
    for sharding, optimizer in runs:
        model, opt = build(sharding, optimizer=optimizer)
        assert opt.routing.whole == WHOLE and [g["optimizer"] for g in opt.param_groups] == [
            "onesidedshampoo",
            "adamw",
        ]
        train(model, opt, range(STEPS))
        assert_matches(model, ref, f"{optimizer} {sharding} dp {ws}")
        if sharding == "none":
            continue
        part = opt.parts[0]
        mine = [part.names[i] for i in part.owned]
        every: list[list[str]] = [None] * ws  # type: ignore[list-item]
        dist.all_gather_object(every, mine)  # before any rank-local assertion
        assert sorted(n for names in every for n in names) == sorted(WHOLE), every
        (layout,) = [lo for lo in model.layouts if lo.mode is Mode.LAYERWISE]
        assert {p.name: p.cost for p in layout.params} == {
            n: onesided_cost(p.shape) for n, p in model.module.named_parameters() if n in WHOLE
        }
        assert sorted(n for n in WHOLE if part.state_of(n)) == sorted(mine), "state off-owner"
        named = dict(ref.net.named_parameters())
        for n in mine:  # the owner's state is the one-process optimizer's
            a, b = part.state_of(n)["precond"], ref.opts[0].state[named[n]]["precond"]
            assert_close(a, b, f"{n} precond", REL)


@case(2)
def case_checkpoint_round_trip(rank, ws):
    for sharding in ("zero1", "none"):
        model, opt = build(sharding)
        train(model, opt, range(SAVED_AT))
        path = ckpt(f"onesided-{sharding}-dp{ws}")
        aligndp.save(path, model, opt, step=SAVED_AT)
        keys = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
        assert tuple(keys["optim.state.mix.weight.precond"].size) == (8, 8), "saved whole"
        assert tuple(keys["optim.state.up.weight.precond"].size) == (37, 37)
        fresh, fresh_opt = build(sharding)
        assert aligndp.load(path, fresh, fresh_opt) == SAVED_AT
        for name in WHOLE:
            a = opt.parts[0].state_of(name) if sharding == "zero1" else opt.state[
                dict(model.module.named_parameters())[name]]  # fmt: skip
            b = fresh_opt.parts[0].state_of(name) if sharding == "zero1" else fresh_opt.state[
                dict(fresh.module.named_parameters())[name]]  # fmt: skip
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
        train(model, opt, range(SAVED_AT, STEPS))
        train(fresh, fresh_opt, range(SAVED_AT, STEPS))
        for (n, p), q in zip(model.module.named_parameters(), fresh.module.parameters()):
            assert torch.equal(p, q), f"{sharding}: {n} differs after resuming at the same dp"


@case(2)
def case_state_a_checkpoint_cannot_hold_fails_on_every_rank(rank, ws):
    """State that is not a tensor on one owner only: the save raises the same ValueError on
    every rank (agreed before any collective) rather than losing it or hanging the others."""
    model, opt = build("zero1")
    train(model, opt, range(1))
    part = opt.parts[0]
    if "mix.weight" in [part.names[i] for i in part.owned]:
        part.state_of("mix.weight")["history"] = [1.0]
    with pytest.raises(ValueError, match=r"state 'history' of param 'mix.weight' as a list"):
        aligndp.save(ckpt("onesided-list-state"), model, opt)


@case(3, after=(2,))
def case_checkpoint_reshards_two_to_three(rank, ws):
    ref = Reference().train(range(STEPS))
    for saved, sharding in [("zero1", "zero1"), ("none", "zero1"), ("zero1", "none")]:
        model, opt = build(sharding, bucket_numel=None)
        assert aligndp.load(ckpt(f"onesided-{saved}-dp2"), model, opt) == SAVED_AT
        train(model, opt, range(SAVED_AT, STEPS))
        assert_matches(model, ref, f"dp 2 {saved} -> dp 3 {sharding}")


make_tests(globals())
