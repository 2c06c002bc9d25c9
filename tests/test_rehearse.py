"""`aligndp rehearse` against reality ([Note: rehearsal] in aligndp/app/rehearse.py).

The same step runs twice for every rank r of D = 2, 3, 4 (and a 2 x 2 mesh): for real on
gloo (``measure_step`` on the world group, every rank at once) and rehearsed, r alone on
torch's fake process group. The rehearsed rank must launch the same collectives as the real
one — kind, group, bytes, dtype and phase, in the same order — and reach the same peak of
live tensor storage within 2 % (both counted by the one probe, [Note: one probe on every
backend]). Modes: DDP, ZeRO-1 AdamW, layer-wise Muon with split Newton–Schulz groups (the
fake backend makes only the rank's own groups, [Note: rehearsal on the fake process group]).
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import tempfile

import pytest

from aligndp.app.rehearse import RehearsalOptions, measure_step, rehearse_rank
from aligndp.app.rehearse_probe import UNSTAGED, register_unstaged
from aligndp.models.gpt import GPTConfig
from aligndp.optim.ns_cost import FLOPS_NS_COST
from tests._dist import case, make_tests

# width 256: at 2 and 4 ranks Muon's plan by the flops model splits a matrix's Newton-Schulz
# over two ranks (a device's fixed cost per part would keep such small matrices whole)
CONFIG = GPTConfig(vocab_size=256, seq_len=16, dim=256, num_layers=1, head_dim=64)
JOBS = {
    "ddp": dict(sharding="none"),
    "zero1": dict(sharding="zero1"),
    "muon": dict(sharding="zero1", optimizer="muon", ns_cost=FLOPS_NS_COST),
}


def jobs(ws: int) -> dict[str, RehearsalOptions]:
    out = {
        name: RehearsalOptions(config=CONFIG, dp_size=ws, bucket_numel=100_000, **kw)
        for name, kw in JOBS.items()
    }
    if ws == 4:
        out["mesh-2x2"] = RehearsalOptions(
            config=CONFIG, dp_size=4, replicas=2, sharding="zero1", bucket_numel=100_000
        )
    return out


register_unstaged()


def _dir(parent_pid: int) -> str:
    """Where the gloo ranks leave their measurements for the test process (their parent)."""
    return os.path.join(tempfile.gettempdir(), f"aligndp-rehearse-{parent_pid}")


def _summary(got) -> dict:
    return {
        "collectives": [c.key() for c in got.collectives],
        "peak": got.peak_allocated,
    }


@case(2, 3, 4)
def case_measure_every_job_on_gloo(rank, ws):
    out = _dir(os.getppid())
    os.makedirs(out, exist_ok=True)
    measured = {
        name: _summary(measure_step(dataclasses.replace(options, collectives=UNSTAGED)))
        for name, options in jobs(ws).items()
    }
    with open(os.path.join(out, f"ws{ws}-rank{rank}.pkl"), "wb") as f:
        pickle.dump(measured, f)


make_tests(globals())


@pytest.mark.parametrize("ws", [2, 3, 4])
def test_rehearsed_rank_launches_what_the_real_one_does(ws):
    globals()["test_case_measure_every_job_on_gloo"](ws)  # the gloo world, once per size
    seen_split = False
    for rank in range(ws):
        with open(os.path.join(_dir(os.getpid()), f"ws{ws}-rank{rank}.pkl"), "rb") as f:
            real = pickle.load(f)
        for name, options in jobs(ws).items():
            fake = _summary(rehearse_rank(options, rank))
            want = real[name]
            assert fake["collectives"] == want["collectives"], (name, rank)
            assert want["collectives"], "a step launches collectives"
            assert abs(fake["peak"] - want["peak"]) <= 0.02 * want["peak"], (name, rank)
            kinds = {c[0] for c in want["collectives"]}
            if name == "ddp":
                assert "all_reduce" in kinds and "reduce_scatter" not in kinds
            else:
                assert {"reduce_scatter", "all_gather"} <= kinds
            sizes = {len(c[1]) for c in want["collectives"]}
            if name == "mesh-2x2":
                assert 2 in sizes  # the shard group's and the replicas' collectives
            if name == "muon" and ws in (2, 4):
                seen_split |= any(c[0] == "scatter" for c in want["collectives"])
    assert seen_split or ws == 3, "the Muon plan splits a matrix at 2 and 4 ranks"
