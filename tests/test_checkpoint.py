"""aligndp.save / aligndp.load: reshard across dp sizes, bucket sizes and sharding modes (gloo).

Cases write checkpoints into a directory shared by every process of this test session
(``ALIGNDP_TEST_CKPT_DIR``, created by the pytest process, inherited by the spawned ranks) and
cases at other world sizes read them: 4 -> 2 and 2 -> 1, 3, ordered with ``case(after=...)``.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn

import aligndp
from tests._dist import case, make_tests
from tests.models import (
    ADAMW_GAIN,
    GLOBAL_BATCH,
    TOKENS,
    OtherNet,
    assert_params_match,
    batch,
    ckpt,
    loss_of,
    make_net,
    order_tolerance,
)

SAVED_AT = 2  # steps trained before the save
TOTAL = 5
REL = order_tolerance(terms=GLOBAL_BATCH * TOKENS, steps=TOTAL, gain=ADAMW_GAIN)
"""fp32 AdamW against one process on the global batch's 60 token rows, over up to TOTAL steps."""
LR = 1e-2


def lr_at(step: int) -> float:
    """A schedule set through the wrapper's param_groups: a loaded optimizer must still obey it."""
    return LR * (1 - step / (2 * TOTAL))


def train(model, opt, steps: range) -> None:
    rank, ws = dist.get_rank(), dist.get_world_size()
    for step in steps:
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        loss_of(model, *batch(step, rank, ws)).backward()
        opt.step()
        opt.zero_grad()
    if hasattr(opt, "gather"):
        opt.gather.wait_all()


def reference(steps: int) -> nn.Module:
    """One process, global batch, torch AdamW: the uninterrupted run."""
    ref = make_net()
    opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        loss_of(ref, *batch(step)).backward()
        opt.step()
        opt.zero_grad()
    return ref


def build(sharding: str, bucket_numel: int | None, dtype=torch.float32, **kwargs):
    return aligndp.parallelize(
        make_net().to(dtype), sharding=sharding, lr=LR, bucket_numel=bucket_numel, **kwargs
    )


# ---- world size 4 writes, world size 2 reads; world size 2 writes, 1 and 3 read ----


@case(4)
def case_save_at_four_ranks(rank, ws):
    """Writes what the dp-2 cases resume from; loaded back here at dp 4 with another bucket
    size, training continues exactly as the model that wrote it."""
    model, opt = build("zero1", bucket_numel=200)
    train(model, opt, range(SAVED_AT))
    aligndp.save(ckpt("zero1-dp4"), model, opt, step=SAVED_AT)
    again, again_opt = build("zero1", bucket_numel=350)
    assert aligndp.load(ckpt("zero1-dp4"), again, again_opt) == SAVED_AT
    for (n, p), q in zip(model.module.named_parameters(), again.module.parameters()):
        assert torch.equal(p.detach(), q.detach()), f"{n}: loaded values differ from the saved ones"
    train(model, opt, range(SAVED_AT, SAVED_AT + 1))
    train(again, again_opt, range(SAVED_AT, SAVED_AT + 1))
    # the same 4 per-rank gradients, reduced in buckets of another size: a 4-term sum in
    # another order, then one AdamW step
    after_a_step = order_tolerance(terms=ws, gain=ADAMW_GAIN)
    assert_params_match(again.module, model.module, "after a step", after_a_step)


@case(2, after=(4,))
def case_resume_from_four_ranks(rank, ws):
    resume_and_compare("zero1-dp4", "zero1", bucket_numel=300)
    resume_and_compare("zero1-dp4", "none", bucket_numel=None)


@case(2)
def case_save_at_two_ranks(rank, ws):
    for sharding in ("zero1", "none"):
        model, opt = build(sharding, bucket_numel=200)
        train(model, opt, range(SAVED_AT))
        aligndp.save(ckpt(sharding), model, opt, step=SAVED_AT)
    assert not os.path.exists(ckpt("zero1") + ".partial")
    keys = dcp.FileSystemReader(ckpt("zero1")).read_metadata().state_dict_metadata
    assert "optim.state.fc1.weight.exp_avg" in keys and tuple(keys["model.fc1.weight"].size) == (
        37 * 11,
    )
    chunks = keys["optim.state.fc1.weight.exp_avg"].chunks
    assert len(chunks) == 2 and sum(c.sizes[0] for c in chunks) == 37 * 11, (
        "each rank writes only its own part"
    )


@case(2)
def case_bf16_resume_is_exact(rank, ws):
    """fp32 masters are what is saved: a resumed bf16 run is bit-identical to the uninterrupted
    one."""
    model, opt = build("zero1", 200, torch.bfloat16, grad_dtype=torch.float32)
    train(model, opt, range(SAVED_AT))
    aligndp.save(ckpt("bf16"), model, opt, step=SAVED_AT)
    train(model, opt, range(SAVED_AT, TOTAL))
    again, again_opt = build("zero1", 200, torch.bfloat16, grad_dtype=torch.float32)
    assert aligndp.load(ckpt("bf16"), again, again_opt) == SAVED_AT
    train(again, again_opt, range(SAVED_AT, TOTAL))
    for (n, p), q in zip(model.module.named_parameters(), again.module.parameters()):
        assert torch.equal(p, q), f"{n} differs after resuming"
    for a, b in zip(opt.pieces, again_opt.pieces):
        assert torch.equal(a.master, b.master), f"{a.segment.name}: fp32 master differs"


@case(2)
def case_bf16_without_masters_resume(rank, ws):
    """``master_weights=False``: the bf16 params and bf16 AdamW state are what is saved (values
    as fp32 model-space entries). Resumed with another bucket size, and under sharding='none'
    (at dp 2 the same numerics: tests/test_zero1.py), the run continues bit for bit; a
    default (fp32 master) run loads the same values into its masters and fp32 state."""
    model, opt = build("zero1", 200, torch.bfloat16, master_weights=False)
    train(model, opt, range(SAVED_AT))
    saved = [p.detach().clone() for p in model.module.parameters()]
    aligndp.save(ckpt("bf16-no-masters"), model, opt, step=SAVED_AT)
    keys = dcp.FileSystemReader(ckpt("bf16-no-masters")).read_metadata().state_dict_metadata
    assert keys["model.fc1.weight"].properties.dtype == torch.float32, "model-space values: fp32"
    assert keys["optim.state.fc1.weight.exp_avg"].properties.dtype == torch.bfloat16
    train(model, opt, range(SAVED_AT, TOTAL))
    for sharding, bucket_numel, master_weights in [
        ("zero1", 300, False),
        ("none", 200, None),
        ("zero1", 200, None),
    ]:
        what = f"{sharding}, bucket {bucket_numel}, master_weights={master_weights}"
        again, again_opt = build(
            sharding, bucket_numel, torch.bfloat16, master_weights=master_weights
        )
        assert aligndp.load(ckpt("bf16-no-masters"), again, again_opt) == SAVED_AT
        for (n, p), q in zip(again.module.named_parameters(), saved):
            assert torch.equal(p, q), f"{what}: {n} not restored"
        masters = sharding == "zero1" and master_weights is None
        state_dtype = torch.float32 if masters else torch.bfloat16
        state = [s for inner in again_opt.inner for s in inner.state.values()]
        assert state and all(s["exp_avg"].dtype == state_dtype for s in state), what
        if masters:
            assert all(p.cast_back and p.master.dtype == torch.float32 for p in again_opt.pieces)
            continue  # fp32 masters: other numerics from here on (tests/test_zero1.py)
        train(again, again_opt, range(SAVED_AT, TOTAL))
        for (n, p), q in zip(model.module.named_parameters(), again.module.parameters()):
            assert torch.equal(p, q), f"{what}: {n} differs after resuming"


@case(2)
def case_failed_save_keeps_previous_checkpoint(rank, ws):
    path = ckpt("interrupted")
    model, opt = build("zero1", 200)
    train(model, opt, range(1))
    aligndp.save(path, model, opt, step=1)
    saved = [p.detach().clone() for p in model.module.parameters()]
    train(model, opt, range(1, 2))
    original = dcp.FileSystemWriter.write_data

    def broken(self, plan, planner):
        if dist.get_rank() == 1:
            raise OSError("disk full (injected)")
        return original(self, plan, planner)

    dcp.FileSystemWriter.write_data = broken
    try:
        with pytest.raises(Exception, match="disk full"):
            aligndp.save(path, model, opt, step=2)
    finally:
        dcp.FileSystemWriter.write_data = original
    dist.barrier()
    fresh, fresh_opt = build("zero1", 300)
    assert aligndp.load(path, fresh, fresh_opt) == 1
    for (n, p), q in zip(fresh.module.named_parameters(), saved):
        assert torch.equal(p, q), f"{n}: the previous checkpoint did not survive the failed save"
    aligndp.save(path, model, opt, step=2)  # a later save replaces the stale partial directory
    assert aligndp.load(path, fresh, fresh_opt) == 2


@case(2)
def case_wrong_model_is_a_clear_error(rank, ws):
    model, opt = aligndp.parallelize(OtherNet(), sharding="zero1", lr=LR)
    with pytest.raises(ValueError) as info:
        aligndp.load(ckpt("zero1"), model, opt)
    text = str(info.value)
    for expected in (
        "extra.weight",
        "fc1.weight: checkpoint [37, 11] vs model [36, 11]",
        "missing",
        "unexpected",
    ):
        assert expected in text, f"{expected!r} not in {text!r}"
    with pytest.raises(ValueError, match="no aligndp checkpoint"):
        aligndp.load(ckpt("nothing-here"), model, opt)


# ---- world sizes 1 and 3: read what world size 2 wrote ----


def resume_and_compare(saved: str, sharding: str, bucket_numel: int | None) -> None:
    model, opt = build(sharding, bucket_numel)
    assert aligndp.load(ckpt(saved), model, opt) == SAVED_AT
    assert_params_match(
        model.module, reference(SAVED_AT), f"{saved} -> {sharding} right after load", REL
    )
    train(model, opt, range(SAVED_AT, TOTAL))
    assert_params_match(
        model.module,
        reference(TOTAL),
        f"{saved} -> {sharding} after {TOTAL - SAVED_AT} more steps",
        REL,
    )


@case(1, 3, after=(2,))
def case_resume_zero1_other_dp_size_and_bucket_size(rank, ws):
    resume_and_compare("zero1", "zero1", bucket_numel=300)
    resume_and_compare("zero1", "zero1", bucket_numel=None)


@case(1, 3, after=(2,))
def case_resume_across_sharding_modes(rank, ws):
    resume_and_compare("none", "zero1", bucket_numel=250)
    resume_and_compare("zero1", "none", bucket_numel=250)


make_tests(globals())
