"""Data parallelism over a 2-D DeviceMesh ([Note: replicate x shard mesh] in
aligndp/runtime/mesh.py) on gloo: 4 ranks as 2x2, 8 ranks as 2x4 and 4x2.

Every mode trains as one process on the global batch does (the same tolerances as the flat
parity tests: tests/models.py [Tolerances]); replicas hold bit-identical params after every
step; a 1-D mesh is the flat group bit for bit; each rank's bytes across replicas per step
are its owned shards, once per step whatever the number of micro-batches; a mesh that does
not fit the job is refused on every rank with one line.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import aligndp
from aligndp.plan.routing import route_params
from aligndp.runtime.ddp import DataParallel
from tests._dist import case, make_tests
from tests.models import (
    ADAMW_GAIN,
    MUON_GAIN,
    TOKENS,
    assert_params_match,
    assert_replicas_identical,
    batch,
    fp32_newton_schulz,
    loss_of,
    make_net,
    make_shaped_net,
    order_tolerance,
)

ROWS = 24
"""Global batch rows: divisible by 4 and 8."""
STEPS = 3
_MESHES: dict[tuple, DeviceMesh] = {}


def mesh(*shape: int, names: tuple[str, ...] | None = ("replicate", "shard")) -> DeviceMesh:
    """One mesh per shape and names for the whole module (building one is a collective)."""
    key = (shape, names)
    if key not in _MESHES:
        _MESHES[key] = init_device_mesh("cpu", shape, mesh_dim_names=names)
    return _MESHES[key]


def shapes(ws: int) -> list[tuple[int, int]]:
    return [(2, 2)] if ws == 4 else [(2, 4), (4, 2)]


def one_line(e: BaseException) -> str:
    text = str(e)
    assert "\n" not in text, f"not one line: {text!r}"
    return text


# ---- refusals ----


@case(4)
def case_meshes_that_do_not_fit_are_refused_on_every_rank(rank, ws):
    net = make_net()
    small = DeviceMesh("cpu", [0, 1], mesh_dim_names=("dp",))  # a collective on every rank
    refused = [
        (dict(mesh=small), ValueError, "on a job of 4 ranks"),
        (dict(mesh=mesh(2, 2), process_group=dist.group.WORLD), ValueError, "not both"),
        (dict(mesh=mesh(1, 2, 2, names=("a", "replicate", "shard"))), ValueError, "got 3 dims"),
        (dict(mesh=mesh(2, 2, names=None)), ValueError, "needs named dims"),
        (dict(mesh=mesh(2, 2, names=("replicate", "tp"))), ValueError, "needs named dims"),
        (dict(mesh="2x2"), TypeError, "DeviceMesh"),
    ]
    for kwargs, error, words in refused:
        with pytest.raises(error) as info:
            aligndp.parallelize(net, sharding="zero1", **kwargs)
        assert words in one_line(info.value), (kwargs, info.value)
        with pytest.raises(error):
            DataParallel(net, **kwargs)


# ---- parity ----


def train_against_one_process(
    rank: int, ws: int, m: DeviceMesh, *, sharding: str, optimizer: str = "adamw", micro=1
) -> None:
    """STEPS steps on ``m`` against one process on the global batch, every step; replicas
    bit-identical after each."""
    muon = optimizer == "muon"
    factory = make_shaped_net if muon else make_net
    model, opt = aligndp.parallelize(
        factory(),
        optimizer=optimizer,
        sharding=sharding,
        mesh=m,
        lr=0.02 if muon else 1e-2,
        bucket_numel=150,
        max_grad_norm=0.5,
        **({"adamw_lr": 1e-2} if muon else {}),
    )
    ref = factory()
    named = dict(ref.named_parameters())
    if muon:
        routing = route_params(ref)
        ref_opts = [
            torch.optim.Muon(
                [named[n] for n in routing.whole], lr=0.02, adjust_lr_fn="match_rms_adamw"
            ),
            torch.optim.AdamW([named[n] for n in routing.adamw], lr=1e-2),
        ]
    else:
        ref_opts = [torch.optim.AdamW(ref.parameters(), lr=1e-2)]
    rel = order_tolerance(terms=ROWS * TOKENS, steps=STEPS, gain=MUON_GAIN if muon else ADAMW_GAIN)
    for step in range(STEPS):
        idx, tgt = batch(step, rank, ws, rows=ROWS)
        for i in range(micro):  # split every row's tokens; equal weights keep the mean exact
            cols = slice(i * TOKENS // micro, (i + 1) * TOKENS // micro)
            weight = (cols.stop - cols.start) / TOKENS
            sync = model.no_sync() if i < micro - 1 else contextlib.nullcontext()
            with sync:
                (weight * loss_of(model, idx[:, cols], tgt[:, cols])).backward()
        opt.step()
        opt.zero_grad()
        loss_of(ref, *batch(step, rows=ROWS)).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        for o in ref_opts:
            o.step()
            o.zero_grad()
        what = f"{tuple(m.shape)} {sharding} {optimizer} step {step}"
        assert_replicas_identical(model.module, what)
        assert_params_match(model.module, ref, what, rel)


@case(4, 8)
def case_every_mode_matches_one_process_on_every_mesh(rank, ws):
    for shape in shapes(ws):
        m = mesh(*shape)
        train_against_one_process(rank, ws, m, sharding="none")
        train_against_one_process(rank, ws, m, sharding="zero1", micro=2)
        with fp32_newton_schulz():
            train_against_one_process(rank, ws, m, sharding="zero1", optimizer="muon")


make_tests(globals())
