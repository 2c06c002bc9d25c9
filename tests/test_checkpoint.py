"""aligndp.save / aligndp.load: reshard across dp sizes, bucket sizes and sharding modes (gloo).

Cases write checkpoints into a directory shared by every process of this test session
(``ALIGNDP_TEST_CKPT_DIR``, created by the pytest process, inherited by the spawned ranks) and
cases at other world sizes read them: 4 -> 2 and 2 -> 1, 3, ordered with ``case(after=...)``.
"""

from __future__ import annotations

import math
import os
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import aligndp
from tests._dist import case, make_tests
from tests.models import (
    ADAMW_GAIN,
    GLOBAL_BATCH,
    TOKENS,
    VOCAB,
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
        37,
        11,
    )
    chunks = keys["optim.state.fc1.weight.exp_avg"].chunks
    assert sum(math.prod(c.sizes) for c in chunks) == 37 * 11, "each element written once"


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


def saved_then_trained(path: str):
    """A model and optimizer saved at ``path`` after one step (its params returned), then
    stepped once more."""
    model, opt = build("zero1", 200)
    train(model, opt, range(1))
    aligndp.save(path, model, opt, step=1)
    saved = [p.detach().clone() for p in model.module.parameters()]
    train(model, opt, range(1, 2))
    return model, opt, saved


@case(2)
def case_failed_save_keeps_previous_checkpoint(rank, ws):
    path = ckpt("interrupted")
    model, opt, saved = saved_then_trained(path)
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


# ---- plain PyTorch reads what aligndp wrote ([Note: checkpoint format]) ----


@case(1, after=(2,))
def case_plain_torch_resumes_aligndp_checkpoints(rank, ws):
    """An unwrapped module, and torch AdamW through torch's own state-dict helpers, resume from
    checkpoints written at dp 4 and dp 2 (zero1, none) with DCP alone, no process group: the
    model part right after the load and the run after more steps match the uninterrupted one."""
    for saved in ("zero1-dp4", "zero1", "none"):
        net = make_net()
        dcp.load({"model": net.state_dict()}, checkpoint_id=ckpt(saved), no_dist=True)
        assert_params_match(
            net, reference(SAVED_AT), f"{saved}: model part read into a plain module", REL
        )
        net = make_net()
        opt = torch.optim.AdamW(net.parameters(), lr=LR)
        model_sd, optim_sd = get_state_dict(net, opt)
        dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=ckpt(saved), no_dist=True)
        set_state_dict(net, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
        for step in range(SAVED_AT, TOTAL):
            for group in opt.param_groups:
                group["lr"] = lr_at(step)
            loss_of(net, *batch(step)).backward()
            opt.step()
            opt.zero_grad()
        assert_params_match(net, reference(TOTAL), f"{saved}: plain torch resumed it", REL)


class Odd(nn.Module):
    """A tied embedding and head, a 3-D conv weight, BatchNorm buffers (one of them int64)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 6)
        self.conv = nn.Conv1d(6, 5, 3, padding=1)
        self.norm = nn.BatchNorm1d(5)
        self.out = nn.Linear(5, 6)
        self.head = nn.Linear(6, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.norm(self.conv(self.emb(idx).transpose(1, 2))).transpose(1, 2)
        return self.head(self.out(x))


@case(2)
def case_plain_module_reads_every_key_at_full_shape(rank, ws):
    """Every key of a plain ``state_dict()`` (tied second name, buffers) is in the checkpoint at
    full shape, each rank's pieces cut into N-D chunks: DCP's default planner reads on each rank
    alone exactly the values the wrapped module holds (buffers: rank 0's)."""
    torch.manual_seed(0)
    model, opt = aligndp.parallelize(Odd(), sharding="zero1", lr=LR, bucket_numel=200)
    train(model, opt, range(SAVED_AT))
    aligndp.save(ckpt("odd"), model, opt, step=SAVED_AT)
    keys = dcp.FileSystemReader(ckpt("odd")).read_metadata().state_dict_metadata
    assert len(keys["model.conv.weight"].chunks) > ws, "the conv weight is cut inside its rows"
    expected = [{k: v.detach().clone() for k, v in model.module.state_dict().items()}]
    dist.broadcast_object_list(expected, src=0)
    plain = Odd()
    state = plain.state_dict()
    dcp.load({"model": state}, checkpoint_id=ckpt("odd"), no_dist=True)
    assert state.keys() == expected[0].keys()
    for key, value in expected[0].items():
        assert torch.equal(state[key], value), f"{key}: read back differs on rank {rank}"
    if rank == 0:  # DCP's own converter to one torch.save file, then a strict load_state_dict
        dcp_to_torch_save(ckpt("odd"), ckpt("odd.pt"))
        again = Odd()
        again.load_state_dict(torch.load(ckpt("odd.pt"), weights_only=True)["model"])
        for key, value in again.state_dict().items():
            assert torch.equal(value, expected[0][key]), f"{key}: differs through torch.save"


@case(1, after=(2,))
def case_aligndp_reads_nd_chunks_at_another_cut(rank, ws):
    """What dp 2 wrote in N-D chunks, aligndp reads at dp 1 with another bucket size exactly as
    DCP's default planner reads it into a plain module."""
    plain = Odd()
    dcp.load({"model": plain.state_dict()}, checkpoint_id=ckpt("odd"), no_dist=True)
    model, opt = aligndp.parallelize(Odd(), sharding="zero1", lr=LR, bucket_numel=50)
    assert aligndp.load(ckpt("odd"), model, opt) == SAVED_AT
    for (n, p), q in zip(model.module.named_parameters(), plain.parameters()):
        assert torch.equal(p, q), f"{n}: aligndp and DCP read different values"


@case(1, after=(2,))
def case_load_after_a_save_died_between_its_renames(rank, ws):
    """A save killed after moving the old checkpoint aside (``<path>.old``) and before renaming
    the new one into place: load falls back to the previous checkpoint; the next save cleans up."""
    path = ckpt("died")
    model, opt, saved = saved_then_trained(path)

    class Killed(BaseException):
        pass

    real, renames = os.replace, []

    def dies_second(src, dst):
        renames.append((src, dst))
        if len(renames) == 2:
            raise Killed
        real(src, dst)

    with mock.patch.object(os, "replace", dies_second), pytest.raises(Killed):
        aligndp.save(path, model, opt, step=2)
    assert renames[0] == (path, path + ".old") and not os.path.exists(path)
    fresh, fresh_opt = build("zero1", 300)
    assert aligndp.load(path, fresh, fresh_opt) == 1
    for (n, p), q in zip(fresh.module.named_parameters(), saved):
        assert torch.equal(p, q), f"{n}: not the previous checkpoint's value"
    aligndp.save(path, model, opt, step=3)
    assert aligndp.load(path, fresh, fresh_opt) == 3
    assert not os.path.exists(path + ".old") and not os.path.exists(path + ".partial")


make_tests(globals())
