"""Fused MXFP8 wgrad inside DataParallel (gloo) against one process on the global batch.

[Note: fused wgrad] in aligndp/plan/fused.py: an MXLinear bound to the DataParallel sink
accumulates its weight gradient straight into ``main_grad`` and only marks the param ready.

Reference: the same MX model (reference backend, plain autograd, no DataParallel) in one
process on the global batch. Comparing with one process rather than with the same
DataParallel unfused is what makes a reduction bug visible (a sum instead of a mean, a
bucket's collective skipped, a fused weight never marked ready so its bucket launches before
its wgrad lands): such bugs would cancel between two runs through the same collectives.

Exactness: MXFP8 blocks run along tokens in the wgrad. Every micro-batch holds 32 tokens (one
block) and the global batch is the ranks' micro-batches concatenated, so the one-process GEMM
sees the same blocks. Each rank's loss is its tokens' summed cross-entropy / its token count,
and the reference uses that same per-token weight and divides its grads by the world size
afterwards: each quantised operand is then identical on both sides (MX scales are relative,
but a factor such as 1/3 would change the roundings) and only fp32 summation order differs.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from aligndp.lowp import MXLinear, convert_to_mxfp8
from aligndp.plan.fused import fused_wgrad_modules
from aligndp.plan.spec import Mode
from aligndp.runtime.ddp import DataParallel, DDPConfig
from tests._dist import case, make_tests
from tests.models import MixMLP, assert_close, order_tolerance, seeded

TOKENS, DIM, HIDDEN, CLASSES = (
    64,
    64,
    96,
    10,
)  # TOKENS per rank: 2 micro-batches of 32 (one MX block)
MICRO = 32
STEPS = 3  # step 0 learns readiness; steps 1 and 2 launch every bucket during backward


def make_mx_model(backend: str = "reference") -> nn.Module:
    model = convert_to_mxfp8(
        seeded(MixMLP, DIM, HIDDEN, CLASSES),
        filter=lambda name, m: name in ("fc1", "fc2", "mix"),
        backend=backend,
    )
    assert all(isinstance(m, MXLinear) for m in (model.fc1, model.fc2, model.mix))
    assert not isinstance(model.head, MXLinear)
    return model


def global_batch(step: int, ws: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(ws * TOKENS, DIM, generator=g), torch.randint(
        0, CLASSES, (ws * TOKENS,), generator=g
    )


def token_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy over ``x``'s tokens / TOKENS: per token, what a rank's mean loss
    weighs."""
    return F.cross_entropy(model(x), y, reduction="sum") / TOKENS


def one_process_grads(step: int, ws: int, backend: str) -> dict[str, torch.Tensor]:
    """The global batch's mean-loss gradients, unfused, in this one process."""
    model = make_mx_model(backend)
    token_loss(model, *global_batch(step, ws)).backward()
    return {n: p.grad / ws for n, p in model.named_parameters()}


def check_against_one_process(
    mode: Mode,
    *,
    rank: int,
    ws: int,
    grad_dtype: torch.dtype | None = None,
    backend: str = "reference",
) -> None:
    # buckets in backward order: [head.bias, head.weight], [mix.weight], [fc2.weight], [fc1.bias,
    # fc1.weight]. fc2.weight and mix.weight, alone and bias-free, are ready only through the fused
    # mark_ready: were it not counted, their buckets would launch as soon as the head's did, before
    # their wgrads land; mix.weight must be counted twice (two uses) before its bucket launches.
    # Layer-wise mode, as parallelize(optimizer="muon") uses it: the MX matrices layer-wise
    # (one bucket: whole params per shard), the rest sharded.
    modes = {
        n: mode
        if mode is not Mode.LAYERWISE or n in ("fc1.weight", "fc2.weight", "mix.weight")
        else Mode.SHARDED
        for n, _ in make_mx_model(backend).named_parameters()
    }
    # start_alignment=1: only the MX layers' declared requirement can give 64-element starts
    model = DataParallel(
        make_mx_model(backend),
        config=DDPConfig(bucket_numel=500, overlap=True, start_alignment=1, grad_dtype=grad_dtype),
        modes=modes,
    )
    weights = [m.weight for _, m in fused_wgrad_modules(model.module)]
    assert len(weights) == 3
    autograd_wgrads = []  # a fused weight gets no autograd gradient: its wgrad goes to main_grad
    hooks = [
        w.register_hook(lambda g, i=i: autograd_wgrads.append(i) if g is not None else None)
        for i, w in enumerate(weights)
    ]
    num_buckets = len(model.bucket_refs)
    buckets = [
        [s.name for s in buf.slots if s.bucket == b]
        for buf in model.flat_buffers
        for b in range(len(buf.layout.buckets))
    ]
    if mode is Mode.LAYERWISE:
        assert num_buckets >= 2 and {layout.mode for layout in model.layouts} == {
            Mode.LAYERWISE,
            Mode.SHARDED,
        }
    else:
        assert ["fc2.weight"] in buckets and ["mix.weight"] in buckets and num_buckets == 4, buckets
    for buf in model.flat_buffers:
        for slot, view in zip(buf.slots, buf.main_grads):
            if backend == "reference" and slot.name in ("fc1.weight", "fc2.weight", "mix.weight"):
                assert view.data_ptr() % (64 * view.element_size()) == 0, (
                    "MXFP8 wgrad needs 64-element starts"
                )
    for step in range(STEPS):
        model.zero_grad_buffer()
        x, y = global_batch(step, ws)
        mine = slice(rank * TOKENS, (rank + 1) * TOKENS)
        x, y = x[mine], y[mine]
        with model.no_sync():
            token_loss(model, x[:MICRO], y[:MICRO]).backward()
        token_loss(model, x[MICRO:], y[MICRO:]).backward()
        launched_in_backward = model.last_round.launched_during_backward
        model.finish_grad_sync()
        if step > 0:
            assert launched_in_backward == num_buckets, (
                f"step {step}: {launched_in_backward} of {num_buckets} buckets launched during "
                "backward"
            )
        ref = one_process_grads(step, ws, backend)
        for buf in model.flat_buffers:
            expected = torch.zeros_like(buf.grad_data)  # ref's fp32 values in the buffer dtype
            for slot in buf.slots:
                expected[slot.start : slot.end] = ref[slot.name].flatten()
            for b in range(len(buf.layout.buckets)):
                lo, hi = buf.layout.shard_range(b, rank)  # the part this rank holds reduced
                # the same quantised operands; the GEMM sums ws x TOKENS token rows in one
                # process, TOKENS per rank (then the reduction): fp32 order only
                assert_close(
                    buf.grad_data[lo:hi],
                    expected[lo:hi],
                    f"{mode.value} grad_dtype {grad_dtype} step {step} bucket {b}",
                    # bf16 buffers: each value rounded once locally and once by the mean
                    order_tolerance(terms=ws * TOKENS)
                    + (0 if grad_dtype is None else 2 * torch.finfo(torch.bfloat16).eps),
                )
    for h in hooks:
        h.remove()
    model.remove_hooks()


@case(2)
def case_fused_layer_used_more_often_than_last_step_raises_on_every_rank(rank, ws):
    """[Note: bucket readiness]: ``mix`` (fused) is used twice per forward, so its bucket
    launches after its second wgrad; a step that uses it three times delivers the third after
    the launch. That contribution cannot be reduced any more, so it is flagged in the agreement
    and the next reduction raises the same error on every rank (every param had a gradient,
    so the flags were read without a host sync: [Note: agreement without a host sync])."""
    model = DataParallel(make_mx_model(), config=DDPConfig(bucket_numel=500, start_alignment=1))
    net = model.module

    def loss(x, y, uses: int):
        h = x + net.fc2(F.gelu(net.fc1(x)))
        for _ in range(uses - 1):
            h = torch.tanh(net.mix(h))
        return F.cross_entropy(net.head(net.mix(h)), y, reduction="sum") / TOKENS

    def step(k: int, uses: int) -> None:
        model.zero_grad_buffer()
        x, y = global_batch(k, ws)
        mine = slice(rank * TOKENS, (rank + 1) * TOKENS)
        model(x[mine])  # through the wrapper: arms the step
        loss(x[mine], y[mine], uses).backward()
        model.finish_grad_sync()

    for k in range(2):
        step(k, uses=2)  # readiness learned: mix arrives twice
    step(2, uses=3)
    try:
        step(3, uses=2)
    except RuntimeError as e:
        assert "mix.weight" in str(e) and "after their bucket's collective started" in str(e), e
    else:
        raise AssertionError("a wgrad that arrived after its bucket launched was not reported")
    model.remove_hooks()


@case(2, 3)
def case_fused_replicated_matches_one_process(rank, ws):
    check_against_one_process(Mode.REPLICATED, rank=rank, ws=ws)


@case(2)
def case_fused_replicated_lazily_zeroed_views_match_one_process(rank, ws):
    """A bf16 grad buffer of fp32 params: autograd cannot accumulate into its views, so
    zero_grad leaves them stale ([Note: lazy zeroing] in ddp.py) and the fused kernel must
    overwrite a stale view, then add ([Note: write, not accumulate])."""
    check_against_one_process(Mode.REPLICATED, rank=rank, ws=ws, grad_dtype=torch.bfloat16)


@case(2, 3)
def case_fused_sharded_matches_one_process(rank, ws):
    check_against_one_process(Mode.SHARDED, rank=rank, ws=ws)


@case(2, 3)
def case_fused_layerwise_matches_one_process(rank, ws):
    check_against_one_process(Mode.LAYERWISE, rank=rank, ws=ws)


@case(2)
def case_fused_bf16_recipe_matches_one_process(rank, ws):
    """The ``bf16`` recipe ([Note: fused bf16 wgrad]): its wgrad GEMM writes, then adds, into
    main_grad, replicated and sharded, bf16 buffers too; float32 here (no autocast), so only
    the summation order differs from one process."""
    for mode in (Mode.REPLICATED, Mode.SHARDED):
        check_against_one_process(mode, rank=rank, ws=ws, backend="bf16")
    check_against_one_process(
        Mode.REPLICATED, rank=rank, ws=ws, backend="bf16", grad_dtype=torch.bfloat16
    )


make_tests(globals())
