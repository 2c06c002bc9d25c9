"""A torch DDP user's habits at the door: the constructor's keywords, comm hooks, one Muon lr,
and user errors reported as the user's (issue 25, groups 5-7 and two of group 9).

References are torch's own: ``DistributedDataParallel`` with the same keywords or the same
``default_hooks`` hook, torch's ``Muon`` + ``AdamW`` configured as aligndp's default, and the
exceptions torch's optimizers raise. One gloo process group at world size 2.

Why exact comparisons hold at dp 2 on gloo: every reduction is a sum of two addends (the
order does not matter), pre-divided by 2 (exact) in the dtype torch's hook uses (fp16/bf16
casts round to nearest even on both sides); every other operation is the same torch code on
the same values, so results are equal bit for bit.
"""

from __future__ import annotations

import inspect
import math
import re

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

import aligndp
from aligndp.models.gpt import GPT, PRESETS
from aligndp.parallelize import plan_request
from aligndp.plan.request import plan_buffers
from aligndp.runtime.ddp import DataParallel
from aligndp.user_input import check_device_ids
from tests._dist import case, make_tests
from tests.models import batch, loss_of, make_net, seeded

STEPS = 3


def assert_unwrapped(net: nn.Module) -> None:
    """A refusal came before wrapping: the params are still plain ``nn.Parameter``s."""
    assert all(type(p) is nn.Parameter for p in net.parameters()), "params were claimed"


def train_both(model, opt, ref, ref_opt, rank, ws, *, what: str):
    """STEPS steps of aligndp and of torch DDP on the same batches; grads and params equal."""
    device = next(model.module.parameters()).device
    for step in range(STEPS):
        idx, tgt = (t.to(device) for t in batch(step, rank, ws))
        loss_of(model, idx, tgt).backward()
        loss_of(ref, idx, tgt).backward()
        for (n, p), q in zip(model.module.named_parameters(), ref.module.parameters()):
            assert torch.equal(p.grad, q.grad), f"{what} step {step}: grad of {n} differs"
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        for (n, p), q in zip(model.module.named_parameters(), ref.module.parameters()):
            assert torch.equal(p, q), f"{what} step {step}: {n} differs from torch DDP"


# ---- group 5: torch DDP's constructor keywords ----
@case(2)
def case_torch_ddp_constructor_keywords_mean_what_they_mean_in_torch(rank, ws):
    kwargs = dict(
        device_ids=None,  # a CPU module: torch takes None only
        output_device=None,
        dim=0,
        bucket_cap_mb=0.001,
        find_unused_parameters=True,
        gradient_as_bucket_view=True,
        static_graph=True,
        check_reduction=False,
        skip_all_reduce_unused_params=False,
        batched_grad_copy=True,
        init_sync=True,
        forward_sync_buffers=True,
    )
    model, opt = aligndp.parallelize(make_net(), optimizer="sgd", lr=0.5, **kwargs)
    known = inspect.signature(nn.parallel.DistributedDataParallel).parameters  # older torch: fewer
    ref = nn.parallel.DistributedDataParallel(
        make_net(), **{k: v for k, v in kwargs.items() if k in known}
    )
    train_both(model, opt, ref, torch.optim.SGD(ref.parameters(), lr=0.5), rank, ws, what="kw")
    # bucket_cap_mb is MiB of the gradient dtype: 0.001 MiB = 1048 bytes = 262 fp32 elements,
    # 524 bf16 ones
    for grad_dtype, numel in ((None, 262), (torch.bfloat16, 524)):
        model, _ = aligndp.parallelize(make_net(), bucket_cap_mb=0.001, grad_dtype=grad_dtype)
        request, _ = plan_request(make_net(), dp_size=ws, bucket_numel=numel, grad_dtype=grad_dtype)
        assert model.config.bucket_numel == numel, (grad_dtype, model.config.bucket_numel)
        assert model.layouts == plan_buffers(request) and len(model.layouts[0].buckets) > 1
    # init_sync=False: each rank keeps its own params, as torch DDP does
    torch.manual_seed(rank)
    mine = nn.Linear(3, 2)
    own = [p.detach().clone() for p in mine.parameters()]
    model, _ = aligndp.parallelize(mine, init_sync=False)
    kept = torch.tensor([int(all(map(torch.equal, model.module.parameters(), own)))])
    dist.all_reduce(kept, op=dist.ReduceOp.MIN)  # every rank fails alike (no rank runs ahead)
    assert kept.item() == 1, "init_sync=False: a rank's params were replaced by rank 0's"
    # a 1-D device mesh is its process group
    mesh = dist.device_mesh.init_device_mesh("cpu", (ws,))
    model, _ = aligndp.parallelize(make_net(), device_mesh=mesh)
    assert model.process_group is mesh.get_group()


@case(2)
def case_torch_ddp_keywords_without_meaning_are_refused_before_wrapping(rank, ws):
    refused = {
        "mixed_precision": (lambda net: object(), "grad_dtype"),
        "delay_all_reduce_named_params": (lambda net: [("fc1.weight", net.fc1.weight)], "freeze"),
        "param_to_hook_all_reduce": (lambda net: net.fc2.weight, "overlap=False"),
        "bucket_cap_mb_list": (lambda net: [25, 25], "bucket_cap_mb="),
    }
    for name, (value, fix) in refused.items():
        net = make_net()
        with pytest.raises(ValueError, match=rf"{name}=.*{fix}"):
            aligndp.parallelize(net, **{name: value(net)})
        assert_unwrapped(net)
        aligndp.parallelize(make_net(), **{name: None})  # torch's default: accepted
    for kwargs, error, fix in (
        ({"dim": 1}, ValueError, "leave dim out"),
        ({"static_graph": 1}, TypeError, "True or False"),
        ({"bucket_cap_mb": 0}, ValueError, "positive number of MiB"),
        ({"bucket_cap_mb": 25, "bucket_numel": 1000}, TypeError, "not both"),
        ({"device_ids": [0, 1]}, ValueError, "one device"),
        ({"device_mesh": object()}, ValueError, "1-D DeviceMesh"),
    ):
        net = make_net()
        with pytest.raises(error, match=fix):
            aligndp.parallelize(net, **kwargs)
        assert_unwrapped(net)
    # a device one rank names wrongly is refused on every rank, naming the rank
    net = make_net()
    wrong = {"device_ids": [0]} if rank == 0 else {"device_ids": None}
    with pytest.raises(ValueError, match=r"rank 0: device_ids=\[0\] names cuda:0.*cpu"):
        aligndp.parallelize(net, **wrong)
    assert_unwrapped(net)


def test_device_ids_name_the_module_device():
    """torch DDP's device_ids/output_device on a CUDA module (checked without a GPU)."""
    cuda1 = torch.device("cuda", 1)
    for ok in ([1], [cuda1], ["cuda:1"], (1,)):
        check_device_ids(ok, None, cuda1)
    check_device_ids([1], 1, cuda1)
    check_device_ids(None, None, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"device_ids=\[0\] names cuda:0.*cuda:1.*module.to"):
        check_device_ids([0], None, cuda1)
    with pytest.raises(ValueError, match=r"output_device=0 names cuda:0"):
        check_device_ids([1], 0, cuda1)
    with pytest.raises(TypeError, match="a device is an int"):
        check_device_ids([1.0], None, cuda1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_ids_on_a_gpu_match_torch_ddp(tmp_path):
    """One rank on NCCL: device_ids/output_device naming the module's GPU are taken, and train
    as torch DDP with the same keywords does; another GPU is refused, nothing wrapped."""
    dist.init_process_group("nccl", init_method=f"file://{tmp_path}/rdv", rank=0, world_size=1)
    try:
        gpu = torch.cuda.current_device()
        kwargs = {"device_ids": [gpu], "output_device": gpu, "bucket_cap_mb": 25}
        sgd = {"lr": 0.5, "foreach": True}  # the same kernels on both sides (not fused)
        model, opt = aligndp.parallelize(make_net().cuda(), optimizer="sgd", **sgd, **kwargs)
        ref = nn.parallel.DistributedDataParallel(make_net().cuda(), **kwargs)
        train_both(model, opt, ref, torch.optim.SGD(ref.parameters(), **sgd), 0, 1, what="gpu")
        net = make_net().cuda()
        with pytest.raises(ValueError, match=rf"device_ids=\[{gpu + 1}\] names cuda:{gpu + 1}"):
            aligndp.parallelize(net, device_ids=[gpu + 1])
        assert_unwrapped(net)
    finally:
        dist.destroy_process_group()


# ---- group 5: comm hooks ----
HOOKS = {
    "fp16_compress_hook": default_hooks.fp16_compress_hook,
    "bf16_compress_hook": default_hooks.bf16_compress_hook,
    "fp16_compress_wrapper(allreduce_hook)": default_hooks.fp16_compress_wrapper(
        default_hooks.allreduce_hook
    ),
    "bf16_compress_wrapper(allreduce_hook)": default_hooks.bf16_compress_wrapper(
        default_hooks.allreduce_hook
    ),
    "allreduce_hook": default_hooks.allreduce_hook,
}


@case(2)
def case_comm_hooks_match_torch_ddp_with_the_same_hook(rank, ws):
    """torch DDP runs the hook itself (through a lambda: a CPU build of torch refuses bf16 hooks
    by their name, though gloo reduces bf16; the arithmetic is the hook's own)."""
    idx, tgt = batch(0, rank, ws)
    plain = nn.parallel.DistributedDataParallel(make_net())
    loss_of(plain, idx, tgt).backward()
    for name, hook in HOOKS.items():
        for state in (None, dist.group.WORLD):
            model, opt = aligndp.parallelize(make_net(), optimizer="sgd", lr=0.5, bucket_numel=300)
            model.register_comm_hook(state, hook)
            ref = nn.parallel.DistributedDataParallel(make_net(), bucket_cap_mb=0.001)
            ref.register_comm_hook(state, lambda st, bucket, hook=hook: hook(st, bucket))
            ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
            train_both(model, opt, ref, ref_opt, rank, ws, what=name)
        # the hook did something: its first gradients differ from the fp32 reduction's
        model, _ = aligndp.parallelize(make_net())
        model.register_comm_hook(None, hook)
        loss_of(model, idx, tgt).backward()
        same = all(
            torch.equal(p.grad, q.grad)
            for p, q in zip(model.module.parameters(), plain.module.parameters())
        )
        assert same == (name == "allreduce_hook"), f"{name}: compressed={not same}"


@case(2)
def case_other_comm_hooks_and_sharded_modes_are_refused(rank, ws):
    model, _ = aligndp.parallelize(make_net())
    state = powerSGD_hook.PowerSGDState(process_group=None)
    for hook, what in (
        (powerSGD_hook.powerSGD_hook, "powerSGD_hook"),
        (default_hooks.fp16_compress_wrapper(powerSGD_hook.powerSGD_hook), "wrapper.powerSGD"),
        (lambda s, bucket: None, "lambda"),
    ):
        with pytest.raises(TypeError, match=f"{what}.*GradBucket hooks.*fp16_compress_hook"):
            model.register_comm_hook(state, hook)
    other = dist.new_group([0, 1])
    with pytest.raises(ValueError, match="state is the process group"):
        model.register_comm_hook(other, default_hooks.fp16_compress_hook)
    model.register_comm_hook(None, default_hooks.bf16_compress_hook)
    with pytest.raises(RuntimeError, match="only be called once"):
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    for kwargs in ({"sharding": "zero1"}, {"optimizer": "muon", "sharding": "zero1"}):
        model, _ = aligndp.parallelize(make_net(), **kwargs)
        with pytest.raises(ValueError, match="sharding='none' with the hook.*grad_dtype"):
            model.register_comm_hook(None, default_hooks.fp16_compress_hook)
        assert model._comm_hook is None


# ---- group 6: one lr for Muon and AdamW ----
DEMO = PRESETS["demo"]


def demo_batch(step: int, rank: int, ws: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank's half of 8 sequences of 32 tokens counting up from random starts (learnable)."""
    g = torch.Generator().manual_seed(step)
    seqs = (torch.randint(0, DEMO.vocab_size, (8, 1), generator=g) + torch.arange(33)) % 256
    seqs = seqs[rank * 8 // ws : (rank + 1) * 8 // ws]
    return seqs[:, :-1], seqs[:, 1:]


def demo_gpt() -> GPT:
    return seeded(GPT, DEMO)


@case(2)
def case_muon_one_lr_trains_the_demo_as_torch_muon_matching_adamw_rms(rank, ws):
    """Default and lr in {1e-3, 3e-3, 1e-2}: aligndp's Muon + AdamW (sharding none) against torch
    DDP + torch's Muon(adjust_lr_fn="match_rms_adamw") on the hidden matrices and AdamW on the
    rest, both at that one lr (torch's default 1e-3 for None): equal losses every step, and the
    loss falls."""
    steps = 12
    for lr in (None, 1e-3, 3e-3, 1e-2):
        model, opt = aligndp.parallelize(demo_gpt(), optimizer="muon", lr=lr)
        ref = nn.parallel.DistributedDataParallel(demo_gpt())
        named = dict(ref.module.named_parameters())
        hidden = [n for n, p in named.items() if p.ndim == 2 and n.startswith("blocks.")]
        same_lr = {} if lr is None else {"lr": lr}
        ref_opts = [
            torch.optim.Muon([named[n] for n in hidden], adjust_lr_fn="match_rms_adamw", **same_lr),
            torch.optim.AdamW([p for n, p in named.items() if n not in hidden], **same_lr),
        ]
        losses = []
        for step in range(steps):
            idx, tgt = demo_batch(step, rank, ws)
            loss, ref_loss = model(idx, tgt), ref(idx, tgt)
            assert torch.equal(loss, ref_loss), f"lr {lr} step {step}: {loss} vs {ref_loss}"
            losses.append(loss.item())
            for m, opts in ((loss, [opt]), (ref_loss, ref_opts)):
                m.backward()
                for o in opts:
                    o.step()
                    o.zero_grad()
        falls = max(losses) <= losses[0] and losses[-1] < 0.95 * losses[0]
        assert all(map(math.isfinite, losses)) and falls, (lr, losses)


@case(2)
def case_muon_lr_and_adamw_lr_set_one_part_each(rank, ws):
    _, opt = aligndp.parallelize(
        demo_gpt(), optimizer="muon", lr=3e-3, muon_lr=0.02, adjust_lr_fn="original"
    )
    muon, adamw = opt.inner
    assert [(g["lr"], g["adjust_lr_fn"]) for g in muon.param_groups] == [(0.02, "original")]
    assert [g["lr"] for g in adamw.param_groups] == [3e-3]
    _, opt = aligndp.parallelize(demo_gpt(), optimizer="muon", sharding="zero1", adamw_lr=1e-4)
    muon, adamw = opt.inner
    assert [(g["lr"], g["adjust_lr_fn"]) for g in muon.param_groups] == [(1e-3, "match_rms_adamw")]
    assert [g["lr"] for g in adamw.param_groups] == [1e-4]


# ---- group 7 and group 9: the user's errors, in every mode, before wrapping ----
MODES = {
    "none": {"sharding": "none"},
    "zero1": {"sharding": "zero1"},
    "muon none": {"optimizer": "muon", "sharding": "none"},
    "muon zero1": {"optimizer": "muon", "sharding": "zero1"},
}


def torch_error(opt_class: type, **options) -> BaseException:
    """What torch raises when ``opt_class`` is built with ``options``."""
    with pytest.raises(Exception) as error:
        opt_class([nn.Parameter(torch.zeros(2, 2))], **options)
    return error.value


@case(2)
def case_optimizer_errors_are_torch_s_in_every_mode(rank, ws):
    for mode, kwargs in MODES.items():
        for options, opt_class in (
            ({"weight_dacay": 0.1}, torch.optim.AdamW),
            ({"lr": -1.0}, torch.optim.AdamW),
            ({"betas": (0.9, 1.5)}, torch.optim.AdamW),
        ):
            if mode.startswith("muon"):
                options = {f"adamw_{k}": v for k, v in options.items()}
            expected = torch_error(
                opt_class, **{k.removeprefix("adamw_"): v for k, v in options.items()}
            )
            net = make_net()
            with pytest.raises(type(expected)) as error:
                aligndp.parallelize(net, **kwargs, **options)
            assert str(error.value) == str(expected), (mode, options, str(error.value))
            assert_unwrapped(net)
    expected = torch_error(torch.optim.Muon, lr=-1.0)
    for mode in ("muon none", "muon zero1"):
        with pytest.raises(type(expected), match=re.escape(str(expected))):
            aligndp.parallelize(make_net(), **MODES[mode], lr=-1.0)
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['weight_dacay'\].*muon_lr"):
        aligndp.parallelize(make_net(), optimizer="muon", weight_dacay=0.1)


@case(2)
def case_a_param_in_two_groups_is_refused_in_every_mode(rank, ws):
    for kwargs in MODES.values():
        for groups in (
            [{"params": ["fc1.weight", "fc2.weight"]}, {"params": ["fc2.weight"], "lr": 0.1}],
            [{"params": ["fc2.weight", "fc2.weight"]}],
        ):
            net = make_net()
            rest = [n for n, _ in net.named_parameters() if n not in ("fc1.weight", "fc2.weight")]
            with pytest.raises(ValueError, match=r"'fc2.weight' is in param groups \d and \d"):
                aligndp.parallelize(net, **kwargs, param_groups=[*groups, {"params": rest}])
            assert_unwrapped(net)
        net = make_net()
        as_tensor = [{"params": [net.fc1.weight]}, {"params": ["fc1.weight"]}]
        with pytest.raises(ValueError, match="'fc1.weight' is in param groups 0 and 1"):
            aligndp.parallelize(net, **kwargs, param_groups=as_tensor)


@case(2)
def case_a_plan_is_refused_for_params_whose_dtype_changed(rank, ws):
    net = make_net()
    request, _ = plan_request(net, dp_size=ws)
    net.fc2.to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"other params.*'fc2.weight'.*bfloat16.*module being"):
        DataParallel(net, plan=request)
    assert_unwrapped(net)


make_tests(globals())
