"""Issue 11: a torch DDP user's habits work like torch DDP, or refuse at once with the alternative.

One case per row of the issue's table (and per item of its "What to build"). Each trains
aligndp next to ``nn.parallel.DistributedDataParallel`` (same seed, same data split, same torch
optimizer; ``find_unused_parameters=True`` where params go unused) and compares at 1e-6
relative in fp32 after 3-5 steps, on 2 and 3 gloo ranks — or asserts the refusal: its type,
and that its message names what to do instead. On the code before the step model was
rewritten (01d84d4) every row's case fails: another model than torch DDP's, a hang, or an
error that names no alternative; cases marked "guard" pin behaviour that was right there.
Muon modes run Newton–Schulz in fp32 on both sides (tests/_habits_models.py says why).
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import gc
import inspect
import math
import time
import weakref

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import aligndp
from aligndp.plan.routing import route_params
from aligndp.runtime.step_state import StepState
from tests._dist import case, make_tests
from tests._habits_models import (
    LR,
    REL,
    BatchNormNet,
    LateGathers,
    Net,
    NormalisedSGD,
    TorchDDP,
    assert_close,
    assert_params_match,
    assert_replicas_identical,
    backward_on,
    batch,
    dropped,
    loss_of,
    make_net,
    micro_batches,
    newton_schulz_fp32,
    seeded,
    shared_path,
    snapshot,
    step_both,
    train_step_both,
    wrap,
)
from tests.models import CountOps


def grads_are_main_grad_views(model) -> None:
    """[Note: step states]: after a synced backward a replicated param's ``p.grad`` IS its reduced
    view; one rank alone keeps autograd's own tensor until ``p.main_grad`` is read, which then
    holds its values and becomes ``p.grad`` ([Note: one rank steps autograd's gradients])."""
    named = list(model.module.named_parameters())
    adopted = [p.grad for _, p in named] if model.reducer.landing.adopting else None
    for i, (n, p) in enumerate(named):
        assert p.grad is not None, f"{n}: no p.grad after backward() returned"
        if adopted is not None:  # the first read of main_grad fills every view
            view = model.index.slots[p].view
            assert adopted[i].data_ptr() != view.data_ptr(), f"{n}: adopted, yet copied"
            assert torch.equal(p.main_grad, adopted[i]), f"{n}: main_grad lost the values"
        assert p.grad.data_ptr() == p.main_grad.data_ptr(), (
            f"{n}: p.grad must be the reduced main_grad view after backward() returns"
        )


def _fp8_mlp() -> nn.Module:
    """Two fp8-tensor Linears (CPU recipe) whose wgrads land in the buffer through the sink."""
    from aligndp.lowp import convert_to_mxfp8

    net = seeded(lambda: nn.Sequential(nn.Linear(32, 48), nn.Tanh(), nn.Linear(48, 16)))
    convert_to_mxfp8(net, backend="fp8-tensor", layers="all")
    return net


def _train_once(model, opt, rank: int, ws: int, fp8: bool) -> None:
    if fp8:
        x = torch.randn(8, 32, generator=torch.Generator().manual_seed(rank))
        model(x).square().mean().backward()
    else:
        backward_on(model, 0, rank, ws)
    if opt is not None:
        opt.step()
        opt.zero_grad()


@case(1, 2)
def case_dropping_the_wrapper_frees_it_as_torch_ddp(rank, ws):
    """[Note: dropped wrappers] (wrapped_param.py), beside torch DDP. Dropped with its module,
    nothing of a trained wrapped model outlives it (params, buffers). Dropped with its
    optimizer while the user keeps the module, the wrapper's buffers go too, no hook, sink or
    param class of it stays on the module, and the module trains on in plain torch: its
    gradients are those of a deep copy (no hook runs). Hooked and collecting paths, ZeRO-1
    with overlapped gathers, fused fp8 wgrads."""
    variants = [("none", {}, False), ("none", {"check_finite": True}, False)]
    variants += [("zero1", {"overlap_param_gather": True}, False), ("none", {}, True)]
    ref = TorchDDP(make_net(), "none")  # the reference: torch DDP frees the same way
    _train_once(ref.model, ref, rank, ws, False)
    torch_params = [weakref.ref(p) for p in ref.model.parameters()]
    del ref
    gc.collect()
    assert not any(r() is not None for r in torch_params), "torch DDP reference did not free"
    for mode, extra, fp8 in variants:
        what = f"{mode} {extra} fp8={fp8} ws {ws}"
        kw = {"wgrad": "fp8-tensor", **extra} if fp8 else extra

        def build(fp8=fp8, mode=mode, kw=kw):
            net = _fp8_mlp() if fp8 else make_net()
            model, opt = wrap(net, mode, **kw)
            _train_once(model, opt, rank, ws, fp8)
            return net, model, opt

        dropped(build, False, what)  # with its module
        net = dropped(build, True, what)  # the module kept: it trains on in plain torch
        twin = copy.deepcopy(net)
        for m in (net, twin):
            _train_once(m, None, rank, ws, fp8)
        for (n, p), q in zip(net.named_parameters(), twin.parameters()):
            assert torch.equal(p.grad, q.grad), f"{what}: {n}.grad differs from plain torch"


# ---- p.grad after backward(): clipping, logging, GradScaler ----


def published(model, mode: str) -> None:
    """The reduction has run by the time ``backward()`` returns: replicated grads are their
    views, sharded ones their owned pieces ([Note: step states])."""
    if mode == "none":
        grads_are_main_grad_views(model)
    else:
        assert model.reducer.state is StepState.REDUCED, model.reducer.state


@case(1, 2)
def case_one_rank_collects_gradients_at_the_end_as_torch(rank, ws):
    """[Note: one rank collects at the end] (grad_landing.py): one rank registers no per-param
    hook, yet every habit reads as with hooks, beside torch DDP: ``p.grad`` is the reduced
    view when ``backward()`` returns; micro-batches under ``no_sync`` sum; a backward that
    bypasses the wrapper (``model.module``) is still seen at the step; a second backward of
    a retained graph adds (replicated, one rank). Each mode, SGD and AdamW; two ranks keep
    their hooks."""
    for mode in ("none", "zero1"):
        for optimizer in ("sgd", "adamw"):
            model, opt = wrap(make_net(), mode, optimizer=optimizer)
            assert model.reducer.collecting == (ws == 1), (mode, ws)
            torch_opt = torch.optim.SGD if optimizer == "sgd" else torch.optim.AdamW
            ref = TorchDDP(make_net(), mode, optimizer=torch_opt)
            what = f"{mode} {optimizer} ws {ws}"
            for m in (model, ref.model):  # 0: one backward through the wrapper
                backward_on(m, 0, rank, ws)
            published(model, mode)
            step_both(model, opt, ref, f"{what} step 0")
            for m in (model, ref.model):  # 1: micro-batches, all but the last under no_sync
                parts = micro_batches(1, rank, ws, 3)
                for i, (idx, tgt, share) in enumerate(parts):
                    with m.no_sync() if i < len(parts) - 1 else contextlib.nullcontext():
                        (loss_of(m, idx, tgt) * share).backward()
            published(model, mode)
            step_both(model, opt, ref, f"{what} step 1 (no_sync)")
            if ws == 1:  # 2: the wrapped module's own forward (no collective to miss)
                for m in (model, ref.model):
                    backward_on(m.module, 2, rank, ws)
                step_both(model, opt, ref, f"{what} step 2 (model.module)")
            # 3: the same graph backward twice; zero1 refuses it (sharded grads), and torch DDP
            # leaves a second backward that no forward prepared unreduced (no peer at ws 2)
            if mode == "none" and ws == 1:
                for m in (model, ref.model):
                    loss = loss_of(m, *batch(3, rank, ws))
                    loss.backward(retain_graph=True)
                    loss.backward()
                step_both(model, opt, ref, f"{what} step 3 (retain_graph)")


def _copies(count: CountOps) -> int:
    """The copy ops (``copy_``, ``_foreach_copy_``) ``count`` has seen."""
    return sum(op.split(".")[1] in ("copy_", "_foreach_copy_") for op in count.ops)


@case(1)
def case_one_rank_steps_autograds_gradients_with_no_copy(rank, ws):
    """[Note: one rank steps autograd's gradients] (grad_landing.py): one rank alone with
    ``sharding="none"`` steps the tensors autograd made, as plain torch does: no copy runs in
    backward or step, ``p.grad`` lies outside the buffer, and the params are bit for bit those
    of the same model made to copy (``adopting`` off). Reads pay the owed copy first:
    ``ReducedGrads.view``, ``p.main_grad`` (a ``p.grad`` the user replaced stays theirs, the
    view holds the reduced value), a second backward before ``zero_grad``; ``zero_grad`` frees
    autograd's tensors. A param of the user's own ``Parameter`` class is copied as before."""
    for optimizer in ("sgd", "adamw"):
        model, opt = wrap(make_net(), "none", optimizer=optimizer)
        twin, twin_opt = wrap(make_net(), "none", optimizer=optimizer)
        assert model.reducer.landing.adopting, "one rank, sharding none: adopting"
        twin.reducer.landing.adopting = False  # the copying path, the reference
        params = list(model.module.parameters())
        buffers = {b.grad_data.untyped_storage().data_ptr() for b in model.flat_buffers}

        def outside(t, buffers=buffers):
            return t.untyped_storage().data_ptr() not in buffers

        for step in range(4):
            what = f"{optimizer} step {step}"
            with CountOps() as count:
                backward_on(model, step, rank, ws)
                autograds = [p.grad for p in params]
                assert all(outside(g) for g in autograds), f"{what}: a gradient was copied"
                if step == 1:  # a view read fills every view, once
                    grads = model.finish_grad_sync()
                    assert _copies(count) == 0, what
                    assert all(torch.equal(grads.view(p), g) for p, g in zip(params, autograds))
                    assert _copies(count) == 1, f"{what}: one multi-tensor copy"
                    assert all(p.grad is model.index.slots[p].view for p in params), what
                if step == 2:  # the user's own p.grad stays; main_grad has the reduced value
                    p0 = params[0]
                    mine = p0.grad = autograds[0] * 2
                    assert torch.equal(p0.main_grad, autograds[0]) and p0.grad is mine, what
                if step == 3:  # a second backward adds, as in torch; nothing is owed after
                    backward_on(model, step + 1, rank, ws)
                    total = [p.grad.clone() for p in params]
                    assert all(torch.equal(p.main_grad, t) for p, t in zip(params, total)), what
                opt.step()
            if step == 0:
                assert _copies(count) == 0, f"{what}: {count.ops}"
            backward_on(twin, step, rank, ws)
            if step == 2:
                twin_p0 = next(twin.module.parameters())
                twin_p0.grad = twin_p0.grad * 2
            if step == 3:
                backward_on(twin, step + 1, rank, ws)
            twin_opt.step()
            for (n, p), q in zip(model.module.named_parameters(), twin.module.parameters()):
                assert torch.equal(p, q), f"{what}: {n} differs from the copying path"
            freed = [weakref.ref(g) for g in autograds]
            del autograds
            opt.zero_grad()  # frees autograd's gradients, as torch's zero_grad does
            assert not any(r() is not None for r in freed), f"{what}: zero_grad kept a gradient"
            twin_opt.zero_grad()
    # a param of the user's own Parameter class, whose main_grad is read without us, is copied
    model, _ = wrap(net_with_tagged_mix(), "none")
    backward_on(model, 0, rank, ws)
    for n in ("weight", "bias"):
        p = getattr(model.module.mix, n)
        assert p.grad is not None and p.grad.data_ptr() == p.main_grad.data_ptr(), n


@case(1, 2, 3)
def case_clip_grad_norm_on_model_parameters_matches_torch_ddp(rank, ws):
    """Row: ``torch.nn.utils.clip_grad_norm_(model.parameters(), c)`` after ``backward()``.
    Was: returned 0.0 and clipped nothing (p.grad None, grads unreduced in main_grad).
    SGD, so a clipped gradient shows in the params; the threshold splits the steps."""
    model, opt = wrap(make_net(), "none", optimizer="sgd", lr=0.5)
    ref = TorchDDP(make_net(), "none", optimizer=torch.optim.SGD, lr=0.5)
    clip = 0.25
    norms = []
    for step in range(4):
        backward_on(model, step, rank, ws)
        backward_on(ref.model, step, rank, ws)
        grads_are_main_grad_views(model)
        ours = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        theirs = torch.nn.utils.clip_grad_norm_(ref.model.parameters(), clip)
        assert_close(ours, theirs, f"step {step} norm", REL)
        norms.append(float(theirs))
        step_both(model, opt, ref, f"step {step}")
    assert min(norms) < clip < max(norms), f"the threshold must split the steps: norms {norms}"


@case(1, 2, 3)
def case_reading_and_editing_p_grad_matches_torch_ddp(rank, ws):
    """Row: anything that reads ``p.grad`` between ``backward()`` and ``step()`` — logging
    gradient norms, custom clipping in place (``clip_grad_value_``). Was: p.grad None."""
    model, opt = wrap(make_net(), "none", optimizer="sgd", lr=0.5)
    ref = TorchDDP(make_net(), "none", optimizer=torch.optim.SGD, lr=0.5)
    for step in range(3):
        backward_on(model, step, rank, ws)
        backward_on(ref.model, step, rank, ws)
        logged = {n: p.grad.norm() for n, p in model.module.named_parameters()}
        for n, q in ref.module.named_parameters():
            assert_close(logged[n], q.grad.norm(), f"step {step} logged |grad| of {n}", REL)
        torch.nn.utils.clip_grad_value_(model.parameters(), 0.02)
        torch.nn.utils.clip_grad_value_(ref.model.parameters(), 0.02)
        step_both(model, opt, ref, f"step {step}")


@case(1, 2, 3)
def case_grad_scaler_fp16_autocast_matches_torch_ddp(rank, ws):
    """Row: ``torch.amp.GradScaler`` with fp16 autocast: scale, backward, unscale_, clip,
    scaler.step, update. Was: ``AssertionError: No inf checks were recorded``."""
    model, opt = wrap(make_net(), "none")
    ref = TorchDDP(make_net(), "none")
    scalers = [torch.amp.GradScaler("cpu"), torch.amp.GradScaler("cpu")]
    for step in range(3):
        idx, tgt = batch(step, rank, ws)
        norms = []
        for m, o, scaler in ((model, opt, scalers[0]), (ref.model, ref, scalers[1])):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = loss_of(m, idx, tgt)
            scaler.scale(loss).backward()
            scaler.unscale_(o.opts[0] if o is ref else o)
            norms.append(torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0))
            scaler.step(o.opts[0] if o is ref else o)
            scaler.update()
        opt.zero_grad()
        ref.zero_grad()
        assert_close(norms[0], norms[1], f"step {step} norm", REL)
        assert scalers[0].get_scale() == scalers[1].get_scale(), (
            f"step {step}: scale {scalers[0].get_scale()} vs torch DDP {scalers[1].get_scale()}"
        )
        assert_params_match(model.module, ref.module, f"step {step}", REL)


@case(2, 3)
def case_sharded_grads_refuse_torch_ops_and_opt_clip_grad_norm_matches(rank, ws):
    """Rows ``clip_grad_norm_`` / ``p.grad`` in sharded modes: no full reduced
    gradient exists on any rank, so p.grad is a ShardedGrad whose every use raises a TypeError
    naming ``opt.clip_grad_norm_`` and ``max_grad_norm``; ``opt.grad_norm()`` returns the global
    norm torch computes on torch DDP's grads, ``opt.clip_grad_norm_(c)`` clips by it (every
    mode, "none" too). Was: torch's call returned 0.0 and clipped nothing, silently."""
    from aligndp.runtime.grads import ShardedGrad

    clip = 0.25
    for mode in ("zero1", "muon zero1", "none"):
        with newton_schulz_fp32(mode):
            kwargs = {} if mode.startswith("muon") else {"optimizer": "sgd", "lr": 0.5}
            model, opt = wrap(make_net(), mode, **kwargs)
            ref = TorchDDP(
                make_net(),
                mode,
                **({} if mode.startswith("muon") else {"optimizer": torch.optim.SGD, "lr": 0.5}),
            )
            norms = []
            for step in range(3):
                backward_on(model, step, rank, ws)
                backward_on(ref.model, step, rank, ws)
                if mode != "none":
                    for n, p in model.module.named_parameters():
                        assert isinstance(p.grad, ShardedGrad), (
                            f"{mode}: {n}.grad is {type(p.grad).__name__}"
                        )
                    with pytest.raises(TypeError, match=r"opt\.clip_grad_norm_") as error:
                        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
                    assert "max_grad_norm" in str(error.value), str(error.value)
                    with pytest.raises(TypeError, match=r"opt\.clip_grad_norm_"):
                        model.module.fc1.weight.grad.norm()
                theirs = torch.nn.utils.clip_grad_norm_(ref.model.parameters(), clip)
                norms.append(float(theirs))
                read = opt.grad_norm()
                assert_close(read, theirs, f"{mode} step {step} opt.grad_norm()", REL)
                assert_close(
                    opt.grad_norm(), read, f"{mode} step {step}: grad_norm() must not clip", rel=0
                )
                assert_close(
                    opt.clip_grad_norm_(clip),
                    theirs,
                    f"{mode} step {step} opt.clip_grad_norm_",
                    REL,
                )
                step_both(model, opt, ref, f"{mode} step {step}")
            assert min(norms) < clip < max(norms), (
                f"{mode}: the threshold must split the steps: {norms}"
            )


@case(2, 3)
def case_grad_scaler_refused_in_sharded_modes(rank, ws):
    """Row ``GradScaler`` in sharded modes: no rank holds a full reduced gradient to unscale,
    so ``scaler.unscale_(opt)`` and ``scaler.step(opt)`` raise a TypeError that names the
    alternatives (bf16 autocast, sharding='none') — not torch's ``AssertionError: No inf
    checks were recorded``, which is what an optimizer showing no gradients gets."""
    for mode in ("zero1", "muon zero1"):
        model, opt = wrap(make_net(), mode)
        for call in ("unscale_", "step"):
            scaler = torch.amp.GradScaler("cpu")
            idx, tgt = batch(0, rank, ws)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = loss_of(model, idx, tgt)
            scaler.scale(loss).backward()
            with pytest.raises(TypeError, match="GradScaler") as error:
                getattr(scaler, call)(opt)
            assert "sharding='none'" in str(error.value), f"{mode} scaler.{call}: {error.value}"
            opt.zero_grad()


# ---- zero_grad and accumulation ----


@case(1, 2, 3)
def case_model_zero_grad_is_opt_zero_grad(rank, ws):
    """Row: ``model.zero_grad()`` (the wrapper) or ``model.module.zero_grad()`` instead of
    ``opt.zero_grad()``. Was: gradients piled up across steps (0.47 relative off after 4)."""
    for mode in ("none", "zero1", "muon zero1"):
        for how in ("model.zero_grad()", "model.module.zero_grad()"):
            with newton_schulz_fp32(mode):
                model, opt = wrap(make_net(), mode)
                ref = TorchDDP(make_net(), mode)
                for step in range(4):
                    backward_on(model, step, rank, ws)
                    backward_on(ref.model, step, rank, ws)
                    opt.step()
                    ref.step()
                    (model if how == "model.zero_grad()" else model.module).zero_grad()
                    ref.zero_grad()
                    assert all(p.grad is None for p in model.module.parameters()), (
                        f"{how} left grads visible"
                    )
                    assert_params_match(model.module, ref.module, f"{mode} {how} step {step}", REL)


@case(1, 2)
def case_torch_compile_after_parallelize_matches_torch_ddp(rank, ws):
    """Row: ``torch.compile(model)`` after ``parallelize`` (the whole model), or of each layer
    (torchtitan's per-block compile), in every mode: the same params as eager torch DDP at the
    eager bar, and no graph break — also under bf16 autocast ([Note: compiled forward]); the
    wrapper's forward is compiled code Dynamo keeps, not a frame it decides to skip each call."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    from torch._dynamo.utils import counters

    from aligndp.runtime.forward_hooks import after_forward, before_forward

    for mode in ("none", "zero1", "muon zero1", "muon none"):
        for how in ("whole", "per layer") if mode in ("none", "zero1") else ("whole",):
            torch._dynamo.reset()
            counters.clear()
            with newton_schulz_fp32(mode):
                model, opt = wrap(make_net(), mode)
                ref = TorchDDP(make_net(), mode)
                if how == "whole":
                    run = torch.compile(model, backend="aot_eager")
                else:
                    for name in ("fc1", "fc2", "mix"):
                        layer = getattr(model.module, name)
                        model.module.register_module(
                            name, torch.compile(layer, backend="aot_eager")
                        )
                    run = model
                for step in range(3):
                    backward_on(run, step, rank, ws)
                    backward_on(ref.model, step, rank, ws)
                    step_both(model, opt, ref, f"compiled {how} {mode} step {step}")
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    backward_on(run, 3, rank, ws)
                opt.zero_grad()
                assert counters["stats"]["unique_graphs"] >= 1, f"{mode} {how}: nothing compiled"
                assert not counters["graph_break"], f"{mode} {how}: {dict(counters['graph_break'])}"
                if how == "whole":  # Dynamo keeps forward's graph (no frame callback per call)
                    code = type(model).forward.__code__
                    assert _debug_get_cache_entry_list(code), f"{mode}: forward not cached"
                    for hook in (before_forward, after_forward):  # and never traces the hooks
                        code = inspect.unwrap(hook).__code__
                        assert not _debug_get_cache_entry_list(code), f"{mode}: {hook} traced"
    torch._dynamo.reset()


@case(1, 2)
def case_calling_model_forward_directly_matches_torch_ddp(rank, ws):
    """Row: ``model.forward(x)`` instead of ``model(x)`` (no module hooks run): the wrapper's
    bookkeeping still runs, as in torch DDP, whose ``forward`` does it itself; a replaced
    wrapper still refuses, also after a forward that raised ([Note: compiled forward])."""
    for mode in ("none", "zero1"):
        model, opt = wrap(make_net(), mode)
        ref = TorchDDP(make_net(), mode)
        for step in range(3):
            for m in (model, ref.model):
                idx, tgt = batch(step, rank, ws)
                out = m.forward(idx)
                nn.functional.cross_entropy(
                    out.reshape(-1, out.shape[-1]), tgt.reshape(-1)
                ).backward()
            published(model, mode)
            step_both(model, opt, ref, f"{mode} step {step}")
        for call in (model, model.forward):  # the module's own error, either way
            with pytest.raises((RuntimeError, IndexError, TypeError)):
                call(batch(0, rank, ws)[0].float())
        aligndp.parallelize(model.module, lr=LR)  # wraps the same module again
        with pytest.raises(RuntimeError, match="replaced by a newer wrap"):
            model.forward(batch(0, rank, ws)[0])  # still checked after a forward that raised


@case(1, 2, 3)
def case_two_synced_backwards_without_zero_grad_accumulate_like_torch(rank, ws):
    """Row: skipping ``zero_grad()`` to accumulate over two synced backwards (no ``no_sync``):
    torch reduces each backward and sums the two averaged gradients; the sum so far is there
    to read after each backward (``p.grad`` in "none", ``opt.grad_norm()`` in every mode).
    Was: nothing visible before ``opt.step()``, and silently wrong in zero1 once a reduction
    had run (non-owned shards kept local gradients)."""
    for mode in ("none", "zero1", "muon zero1"):
        with newton_schulz_fp32(mode):
            model, opt = wrap(make_net(), mode)
            ref = TorchDDP(make_net(), mode)
            for step in range(3):
                for k, (idx, tgt, share) in enumerate(micro_batches(step, rank, ws, 2)):
                    for m in (model, ref.model):
                        (share * loss_of(m, idx, tgt)).backward()
                    theirs = torch.linalg.vector_norm(
                        torch.stack([q.grad.norm() for q in ref.module.parameters()])
                    )
                    assert_close(
                        opt.grad_norm(), theirs, f"{mode} step {step} norm after backward {k}", REL
                    )
                    if mode == "none":
                        for (n, p), q in zip(
                            model.module.named_parameters(), ref.module.parameters()
                        ):
                            assert_close(
                                p.grad, q.grad, f"step {step} backward {k} grad of {n}", REL
                            )
                step_both(model, opt, ref, f"{mode} step {step}")


@case(1, 2, 3)
def case_backward_after_step_without_zero_grad_adds_to_old_grads(rank, ws):
    """What to build: accumulating without ``zero_grad`` follows torch in every mode, also
    across ``opt.step()``: step k sees the sum of the gradients of steps 0..k."""
    for mode in ("none", "zero1", "muon zero1"):
        with newton_schulz_fp32(mode):
            model, opt = wrap(make_net(), mode)
            ref = TorchDDP(make_net(), mode)
            for step in range(3):
                backward_on(model, step, rank, ws)
                backward_on(ref.model, step, rank, ws)
                opt.step()
                ref.step()
                assert_params_match(model.module, ref.module, f"{mode} step {step}", REL)
            if mode == "none":
                for n, p in model.module.named_parameters():
                    assert_close(
                        p.grad,
                        dict(ref.module.named_parameters())[n].grad,
                        f"summed grad of {n}",
                        REL,
                    )


@case(1, 2, 3)
def case_main_grad_written_after_zero_grad_is_reduced(rank, ws):
    """Row: writing into ``param.main_grad`` after ``zero_grad()`` (Megatron / Transformer
    Engine convention: a kernel adds its wgrad there). Was: thrown away by lazy zeroing (the
    next autograd gradient was copied over it, or an untouched view zeroed at launch).
    Each rank adds ``(rank + 1) * c`` to fc2.weight (which also gets an autograd gradient)
    and to mix.bias (which does not: skip_mix): the reduced gradient is torch DDP's plus the
    mean of the writes, and both are stepped."""
    for mode in ("none", "zero1"):
        model, opt = wrap(make_net(), mode, optimizer="sgd", lr=0.5)
        ref = TorchDDP(make_net(), mode, optimizer=torch.optim.SGD, lr=0.5, find_unused=True)
        extra = {"fc2.weight": 0.01, "mix.bias": 0.02}
        mean_write = sum(r + 1 for r in range(ws)) / ws
        for step in range(3):
            named = dict(model.module.named_parameters())
            for n, c in extra.items():
                named[n].main_grad.add_((rank + 1) * c)
            backward_on(model, step, rank, ws, skip_mix=True)
            backward_on(ref.model, step, rank, ws, skip_mix=True)
            theirs = dict(ref.module.named_parameters())
            for n, c in extra.items():
                if theirs[n].grad is None:
                    theirs[n].grad = torch.zeros_like(theirs[n])
                theirs[n].grad.add_(mean_write * c)
            step_both(model, opt, ref, f"{mode} step {step}")


# ---- optimizer state, param groups ----


def assert_state_dicts_equal(a, b, where: str = "state_dict") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), f"{where} differs"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), f"{where}: keys {sorted(a)} vs {sorted(b)}"
        for k in a:
            assert_state_dicts_equal(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: lengths {len(a)} vs {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_state_dicts_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} vs {b!r}"


@case(2, 3)
def case_opt_state_dict_round_trip_continues_identically(rank, ws):
    """Row: ``opt.load_state_dict(other_opt.state_dict())``. Was: a silent no-op (the inner
    optimizers ended with empty state). A second model + optimizer, loaded from the first's
    module and optimizer state after 2 steps, continues bit for bit like the first."""
    for mode in ("none", "zero1", "muon none", "muon zero1"):
        with newton_schulz_fp32(mode):
            first, first_opt = wrap(make_net(), mode)
            for step in range(2):
                backward_on(first, step, rank, ws)
                first_opt.step()
                first_opt.zero_grad()
            sd = first_opt.state_dict()
            assert sd["state"], f"{mode}: empty optimizer state after 2 steps"
            torch.manual_seed(123)
            second, second_opt = wrap(Net(), mode)  # other initial weights
            second.module.load_state_dict(first.module.state_dict())
            second_opt.load_state_dict(copy.deepcopy(sd))
            assert_state_dicts_equal(second_opt.state_dict(), sd, f"{mode} reloaded state")
            for step in range(2, 4):
                for m, o in ((first, first_opt), (second, second_opt)):
                    backward_on(m, step, rank, ws)
                    o.step()
                    o.zero_grad()
                for (n, p), q in zip(first.module.named_parameters(), second.module.parameters()):
                    assert torch.equal(p, q), (
                        f"{mode} step {step} {n}: the reloaded optimizer diverged"
                    )


@case(2, 3)
def case_opt_load_state_dict_of_another_layout_refused(rank, ws):
    """Row ``opt.load_state_dict``: ``opt.state_dict()`` is rank-local; a state dict of another
    dp size, sharding or bucket layout (or of a plain torch optimizer) must raise a ValueError
    naming aligndp.save/aligndp.load, which reshard — not load shard-sized state into the
    wrong params."""
    solo_groups = [dist.new_group([r]) for r in range(ws)]

    def trained(mode: str, **kwargs):
        model, opt = wrap(make_net(), mode, **kwargs)
        solo = "process_group" in kwargs
        backward_on(model, 0, 0 if solo else rank, 1 if solo else ws)
        opt.step()
        opt.zero_grad()
        return opt.state_dict()

    target = {"none": wrap(make_net(), "none")[1], "zero1": wrap(make_net(), "zero1")[1]}
    others = {
        "dp size 1 into none": ("none", trained("none", process_group=solo_groups[rank])),
        "dp size 1 into zero1": ("zero1", trained("zero1", process_group=solo_groups[rank])),
        "zero1 into none": ("none", trained("zero1")),
        "none into zero1": ("zero1", trained("none")),
        "zero1 one bucket into zero1": ("zero1", trained("zero1", bucket_numel=None)),
        "plain torch AdamW into none": (
            "none",
            torch.optim.AdamW(make_net().parameters()).state_dict(),
        ),
    }
    wrong = []
    for what, (mode, sd) in others.items():
        try:
            target[mode].load_state_dict(sd)
        except Exception as e:  # noqa: BLE001  collect every way it fails, then report them all
            if not (
                isinstance(e, ValueError) and "aligndp.save" in str(e) and "aligndp.load" in str(e)
            ):
                wrong.append(f"{what}: {type(e).__name__}: {e}")
        else:
            wrong.append(f"{what}: loaded without an error")
    assert not wrong, (
        "a state dict of another layout must raise ValueError naming aligndp.save/aligndp.load:\n"
        + "\n".join(wrong)
    )


def group_spec():
    """Three groups that cut both Muon's and AdamW's params: (names, options), in the order a
    callable's distinct answers appear in registration order."""
    a = ["emb.weight", "fc1.weight"]
    b = ["fc1.bias", "fc2.bias", "mix.bias"]
    c = ["fc2.weight", "mix.weight", "head.weight"]
    return [
        (a, {"weight_decay": 0.1, "lr": 2 * LR}),
        (b, {"weight_decay": 0.0}),
        (c, {"weight_decay": 0.05}),
    ]


@case(2, 3)
def case_param_groups_and_lr_schedulers_match_torch_ddp(rank, ws):
    """Row: parameter groups (no weight decay on biases, per-layer lr) and
    ``opt.add_param_group``. Was: TypeError / NotImplementedError. torch's list of
    ``{"params": [...], **options}`` (tensors or names) or a callable ``(name, p) -> options``,
    in every mode, with a LambdaLR of one lambda per group; ``add_param_group`` refuses
    naming ``param_groups=``."""
    spec = group_spec()
    options_of = {n: options for names, options in spec for n in names}
    forms = {
        "tensors": lambda net: [
            {"params": [dict(net.named_parameters())[n] for n in names], **o} for names, o in spec
        ],
        "names": lambda net: [{"params": list(names), **o} for names, o in spec],
        "callable": lambda net: lambda name, p: dict(options_of[name]),
    }
    for mode in ("none", "zero1", "muon none", "muon zero1"):
        for form, groups_of in forms.items():
            if mode.startswith("muon") and form != "callable":
                continue  # the list forms are resolved by the same code; one form per Muon mode
            with newton_schulz_fp32(mode):
                net = make_net()
                model, opt = wrap(net, mode, param_groups=groups_of(net))
                ref = TorchDDP(make_net(), mode, groups=spec)
                assert len(opt.param_groups) == len(ref.param_groups), (
                    f"{mode} {form}: {len(opt.param_groups)} groups, torch {len(ref.param_groups)}"
                )
                for k, (ours, theirs) in enumerate(zip(opt.param_groups, ref.param_groups)):
                    for key in ("lr", "weight_decay"):
                        assert ours[key] == theirs[key], (
                            f"{mode} {form} group {k} {key}: {ours[key]} vs {theirs[key]}"
                        )
                lambdas = [
                    lambda s, k=k: 1.0 / (1.0 + (k + 1) * s) for k in range(len(opt.param_groups))
                ]
                sched = torch.optim.lr_scheduler.LambdaLR(opt, lambdas)
                ref_scheds, start = [], 0
                for o in ref.opts:
                    ref_scheds.append(
                        torch.optim.lr_scheduler.LambdaLR(
                            o, lambdas[start : start + len(o.param_groups)]
                        )
                    )
                    start += len(o.param_groups)
                for step in range(3):
                    backward_on(model, step, rank, ws)
                    backward_on(ref.model, step, rank, ws)
                    opt.step()
                    sched.step()
                    opt.zero_grad()
                    ref.step()
                    for s in ref_scheds:
                        s.step()
                    ref.zero_grad()
                    assert [g["lr"] for g in opt.param_groups] == [
                        g["lr"] for g in ref.param_groups
                    ]
                    assert_params_match(model.module, ref.module, f"{mode} {form} step {step}", REL)
                with pytest.raises(ValueError, match="param_groups="):
                    opt.add_param_group({"params": [nn.Parameter(torch.zeros(3))], "lr": 0.1})


# ---- unused params, changing usage ----


class TaggedParameter(nn.Parameter):
    """A user's ``Parameter`` subclass: aligndp keeps its class and zeroes its gradient view
    eagerly at ``zero_grad`` (the view is never stale, so usage cannot be read from it)."""


def net_with_tagged_mix() -> Net:
    net = make_net()
    net.mix.weight = TaggedParameter(net.mix.weight.detach().clone())
    net.mix.bias = TaggedParameter(net.mix.bias.detach().clone())
    return net


@case(1, 2, 3)
def case_param_unused_on_every_rank_is_not_stepped(rank, ws):
    """Row: a param that gets no gradient in a step. Was: stepped anyway with a zero
    gradient (AdamW momentum and weight decay kept moving it). As torch DDP with
    find_unused_parameters=True: p.grad stays None and the param does not move. Also for
    params of a ``Parameter`` subclass (issue 25, group 9), whose views are zeroed eagerly. One
    rank too, whose agreement is decoded on the host without a collective."""
    for mode, factory in [(m, make_net) for m in ("none", "zero1", "muon zero1")] + [
        (m, net_with_tagged_mix) for m in ("none", "zero1")
    ]:
        with newton_schulz_fp32(mode):
            model, opt = wrap(factory(), mode)
            assert isinstance(model.module.mix.weight, TaggedParameter) == (
                factory is net_with_tagged_mix
            )
            ref = TorchDDP(factory(), mode, find_unused=True)
            what = f"{mode} {factory.__name__}"
            for step in range(3):
                skip = step == 1
                before = snapshot(model.module)
                backward_on(model, step, rank, ws, skip_mix=skip)
                backward_on(ref.model, step, rank, ws, skip_mix=skip)
                if skip:
                    for n in ("mix.weight", "mix.bias"):
                        assert dict(model.module.named_parameters())[n].grad is None, (
                            f"{what}: {n}.grad is set"
                        )
                opt.step()
                opt.zero_grad()
                ref.step()
                ref.zero_grad()
                if skip:
                    for n in ("mix.weight", "mix.bias"):
                        assert torch.equal(dict(model.module.named_parameters())[n], before[n]), (
                            f"{what}: {n} moved in a step where no rank used it"
                        )
                assert_params_match(model.module, ref.module, f"{what} step {step}", REL)


@case(2, 3)
def case_param_usage_changing_between_steps_matches_torch_ddp(rank, ws):
    """Row: a param first used after step 0, or used by different ranks on different steps.
    Was: RuntimeError on one rank while the others waited for the process-group timeout.
    ``mix`` is unused at steps 0-1, used everywhere at steps 2 and 4, by rank 0 only at
    steps 3 and 5 (there: the mean with zeros from the other ranks)."""
    for mode in ("none", "zero1", "muon zero1"):
        with newton_schulz_fp32(mode):
            model, opt = wrap(make_net(), mode)
            ref = TorchDDP(make_net(), mode, find_unused=True)
            for step in range(6):
                used = step >= 2 and (step % 2 == 0 or rank == 0)
                backward_on(model, step, rank, ws, skip_mix=not used)
                backward_on(ref.model, step, rank, ws, skip_mix=not used)
                if mode == "none":
                    for (n, p), q in zip(model.module.named_parameters(), ref.module.parameters()):
                        assert (p.grad is None) == (q.grad is None), (
                            f"step {step} {n}: grad {p.grad is None=}"
                        )
                        if q.grad is not None:
                            assert_close(p.grad, q.grad, f"step {step} grad of {n}", REL)
                step_both(model, opt, ref, f"{mode} step {step}")


@case(2, 3)
def case_zero_grad_set_to_none_false_steps_unused_params_like_torch(rank, ws):
    """What to build, what zero_grad means: ``zero_grad(set_to_none=False)`` keeps zero
    gradients visible, so a param no rank uses is still stepped (AdamW decays it), as torch.
    Guard: right before the rewrite too; the unused-param agreement must not break it."""
    for mode in ("none", "zero1"):
        model, opt = wrap(make_net(), mode)
        ref = TorchDDP(make_net(), mode, find_unused=True)
        for step in range(3):
            train_step_both(
                model,
                opt,
                ref,
                step,
                rank,
                ws,
                f"{mode} step {step}",
                skip_mix=step > 0,
                set_to_none=False,
            )


@case(2, 3)
def case_more_synced_backwards_in_a_later_step(rank, ws):
    """Row: more synced micro-batches in a later step than in the first. Was: ``RuntimeError
    ... received 4 gradient contributions this step but 2 in the first step``. Each synced
    backward is its own reduction; torch DDP does the same."""
    for mode in ("none", "zero1"):
        model, opt = wrap(make_net(), mode)
        ref = TorchDDP(make_net(), mode)
        for step, count in enumerate((1, 3, 2)):
            for m in (model, ref.model):
                for idx, tgt, share in micro_batches(step, rank, ws, count):
                    (share * loss_of(m, idx, tgt)).backward()
            step_both(model, opt, ref, f"{mode} step {step} ({count} backwards)")


@case(2, 3)
def case_requires_grad_false_after_wrapping_freezes_the_layer(rank, ws):
    """Row: ``requires_grad_(False)`` on a layer after wrapping. Was: the frozen weight kept
    moving. It gets no gradient, so it is not stepped (torch DDP find_unused: the same)."""
    for mode in ("none", "zero1", "muon zero1"):
        with newton_schulz_fp32(mode):
            model, opt = wrap(make_net(), mode)
            ref = TorchDDP(make_net(), mode, find_unused=True)
            for step in range(4):
                if step == 1:
                    model.module.fc1.requires_grad_(False)
                    ref.module.fc1.requires_grad_(False)
                    frozen = snapshot(model.module.fc1)
                backward_on(model, step, rank, ws)
                backward_on(ref.model, step, rank, ws)
                opt.step()
                opt.zero_grad()
                ref.step()
                ref.zero_grad()
                if step >= 1:
                    for n, p in model.module.fc1.named_parameters():
                        assert torch.equal(p, frozen[n]), (
                            f"{mode} step {step}: frozen fc1.{n} moved"
                        )
                assert_params_match(model.module, ref.module, f"{mode} step {step}", REL)


# ---- buffers, loading weights, wrapping ----


@case(2, 3)
def case_batchnorm_buffers_broadcast_like_torch_ddp(rank, ws):
    """Row: BatchNorm (module buffers). Was: broadcast once at wrap only, so the ranks'
    statistics drifted apart. With ``broadcast_buffers=True`` (default) rank 0's buffers reach
    every rank at each forward, as torch DDP's; ``False`` leaves them per rank, as torch's."""
    for broadcast in (True, False):
        for mode in ("none", "zero1"):
            model, opt = wrap(seeded(BatchNormNet), mode, broadcast_buffers=broadcast)
            ref = TorchDDP(seeded(BatchNormNet), mode, forward_sync_buffers=broadcast)
            for step in range(3):
                train_step_both(
                    model, opt, ref, step, rank, ws, f"{mode} broadcast={broadcast} step {step}"
                )
                for (n, b), c in zip(model.module.named_buffers(), ref.module.buffers()):
                    assert_close(b, c, f"{mode} broadcast={broadcast} step {step} buffer {n}", REL)
            mean = model.module.norm.running_mean
            every = [torch.empty_like(mean) for _ in range(ws)]
            dist.all_gather(every, mean)
            differ = any(not torch.equal(e, every[0]) for e in every)
            assert differ, f"{mode} broadcast={broadcast}: the ranks' last forwards saw other data"
            if broadcast and mode == "none":  # a checkpoint keeps rank 0's statistics
                rank0 = {n: b.clone() for n, b in model.module.named_buffers()}
                for b in rank0.values():
                    dist.broadcast(b, src=0)
                with shared_path("batchnorm") as path:
                    aligndp.save(path, model, opt)
                    fresh, fresh_opt = wrap(seeded(BatchNormNet), mode)
                    aligndp.load(path, fresh, fresh_opt)
                for n, b in fresh.module.named_buffers():
                    assert torch.equal(b, rank0[n]), (
                        f"buffer {n} after aligndp.save/load is not rank 0's"
                    )
            if broadcast:  # eval through the wrapper: rank 0's statistics everywhere
                model.eval()
                with torch.no_grad():
                    out = model(batch(0)[0])
                model.train()
                outs = [torch.empty_like(out) for _ in range(ws)]
                dist.all_gather(outs, out.contiguous())
                assert all(torch.equal(o, outs[0]) for o in outs), (
                    f"{mode}: eval outputs differ between ranks"
                )


def loaded_bf16_weights() -> dict[str, torch.Tensor]:
    """Other weights than make_net()'s, as bf16."""
    torch.manual_seed(7)
    return {n: t.to(torch.bfloat16) for n, t in Net().state_dict().items()}


def assert_written_weights_survive_a_step_at_lr_0(rank, ws, mode: str, how: str) -> None:
    """One step, then ``how`` writes other weights into the bf16 params of a ``mode`` model,
    then a step at lr 0: the params must be exactly the written weights."""
    loaded = loaded_bf16_weights()
    model, opt = wrap(make_net().to(torch.bfloat16), mode)
    backward_on(model, 0, rank, ws)
    opt.step()
    opt.zero_grad()
    if how == "module.load_state_dict":
        model.module.load_state_dict(loaded)
    elif how == "p.data.copy_":
        for n, p in model.module.named_parameters():
            p.data.copy_(loaded[n])
    else:
        source, _ = wrap(make_net().to(torch.bfloat16), mode)
        source.module.load_state_dict(loaded)
        with shared_path("weights") as path:
            aligndp.save(path, source)
            aligndp.load(path, model)
    for group in opt.param_groups:
        group["lr"] = 0.0
    backward_on(model, 1, rank, ws)
    opt.step()
    opt.zero_grad()
    for n, p in model.module.named_parameters():
        assert torch.equal(p.detach(), loaded[n]), (
            f"{mode} {how}: {n} is not the written weight after a step at lr 0"
        )


@case(2, 3)
def case_weights_loaded_after_wrapping_reach_the_bf16_masters(rank, ws):
    """Row: ``model.module.load_state_dict(sd)`` / ``aligndp.load(path, model)`` (weights only)
    after wrapping, bf16 params, zero1 or Muon. Was: the next step wrote the old fp32 masters
    back over the loaded weights, even at lr 0. At lr 0 the loaded weights must survive the
    step exactly; at lr > 0 the step from them must be close (bf16) to torch DDP's one step
    from a fresh bf16 model loaded with the same weights."""
    loaded = loaded_bf16_weights()
    for mode in ("zero1", "muon zero1"):
        for how in ("module.load_state_dict", "aligndp.load"):
            assert_written_weights_survive_a_step_at_lr_0(rank, ws, mode, how)
        # lr > 0, fresh optimizer state on both sides: loaded right after wrapping. The steps
        # are compared, not the params: a step that never happened would be as far from the
        # params as a bf16 step's own rounding (the old check, rel=2e-2, could not tell).
        # Optimizers whose step is continuous in the gradient: AdamW's first step is
        # lr * sign(g), which flips wherever bf16 reductions round a small gradient across zero
        # (aligndp reduces in fp32, torch DDP in bf16), so zero1 steps SGD here, and Muon
        # mode compares its Newton–Schulz matrices' steps (the AdamW part must just move).
        sgd = {"optimizer": "sgd"} if mode == "zero1" else {}
        lr = BF16_STEP_LR[mode]
        model, opt = wrap(make_net().to(torch.bfloat16), mode, lr=lr, **sgd)
        model.module.load_state_dict(loaded)
        reference_net = Net().to(torch.bfloat16)
        reference_net.load_state_dict(loaded)
        ref = TorchDDP(reference_net, mode, lr=lr, optimizer=torch.optim.SGD)
        for m in (model, ref.model):
            backward_on(m, 0, rank, ws)
        opt.step()
        ref.step()
        candidates = set(route_params(reference_net).whole) if sgd == {} else set(loaded)
        compared = []
        for (n, p), q in zip(model.module.named_parameters(), ref.module.parameters()):
            assert not torch.equal(p.detach(), loaded[n]), f"{mode}: {n} did not move at lr > 0"
            if n not in candidates:
                continue
            start = loaded[n].float()
            ours, theirs = p.detach().float() - start, q.detach().float() - start
            # Muon: the orthogonal factor moves by up to 2 ||G|| / (s_n + s_(n-1)) times a
            # relative change of the gradient G (tests/models.py MUON_GAIN), read off G here
            gain = 1.0 if sgd else polar_gain(q.grad)
            bound = bf16_step_bound(start, theirs, gain=gain)
            if bound >= 0.5:  # an ill-conditioned G: bf16 rounding alone may move its step
                assert not sgd, f"{mode}: the step of {n} drowns in bf16 rounding"
                continue
            assert_close(ours, theirs, f"{mode} lr>0 step of {n}", bound)
            compared.append(n)
        assert compared, f"{mode}: no step was compared"


BF16_STEP_LR = {"zero1": 10.0, "muon zero1": 0.1}
"""Steps well above bf16's rounding of params of rms <= 1: SGD's gradients here are 1e-2-ish;
Muon's orthogonal update moves each matrix by about lr."""


def polar_gain(grad: torch.Tensor) -> float:
    """``2 ||G|| / (s_n + s_(n-1))``: how much the orthogonal factor of ``G`` can move per unit
    relative change of ``G`` (Li 1995; tests/models.py MUON_GAIN)."""
    s = torch.linalg.svdvals(grad.double())
    return float(2 * s[0] / (s[-1] + s[-2]))


def bf16_step_bound(start: torch.Tensor, step: torch.Tensor, *, gain: float = 1.0) -> float:
    """Normwise bound on the difference of two one-step updates of bf16 params from ``start``:
    torch reduces and steps in bf16 (about six roundings of the update: the pre-divided
    gradients, their sum over up to 3 ranks, the optimizer's arithmetic) and each side rounds
    the new params to bf16 once (``u ||start||`` each over the elements that move, relative to
    the step's norm); ``gain`` multiplies the gradient's part. Compared below 0.5 only, so a
    missing step (relative error 1) fails."""
    u = torch.finfo(torch.bfloat16).eps / 2
    moved = step != 0  # an element the step leaves alone (an unused embedding row) is exact
    return u * (6 * gain + 2 * float(start[moved].norm() / step.norm()))


@case(2, 3)
def case_weights_copied_into_p_data_reach_the_bf16_masters(rank, ws):
    """Row (weights copied in after wrapping, e.g. pretrained weights): ``p.data.copy_(w)``
    writes through ``.data``, which does not bump the param's version counter, so masters
    that follow the counter miss it and the next step restores the old weights silently."""
    for mode in ("zero1", "muon zero1"):
        assert_written_weights_survive_a_step_at_lr_0(rank, ws, mode, "p.data.copy_")


@case(2, 3)
def case_wrapping_again_moves_the_gradients_to_the_new_wrapper(rank, ws):
    """Row: wrapping a module again after dropping (or while keeping) the first wrapper. Was:
    the first wrapper's hooks still took every gradient and the new main_grad stayed zero.
    The new wrapper trains like torch DDP; calling the old one raises RuntimeError."""
    for mode in ("none", "zero1"):
        for keep in (True, False):
            net = make_net()
            first, first_opt = wrap(net, mode)
            backward_on(first, 0, rank, ws)
            first_opt.step()
            first_opt.zero_grad()
            model, opt = wrap(net, mode)
            if keep:
                with pytest.raises(RuntimeError, match="new"):
                    first(batch(1, rank, ws)[0])
            else:
                del first, first_opt
                gc.collect()
            ref = TorchDDP(make_net(), mode)
            backward_on(ref.model, 0, rank, ws)
            ref.step()
            ref.zero_grad()
            ref.opts = [
                torch.optim.AdamW(ref.module.parameters(), lr=LR)
            ]  # the second wrap's fresh optimizer
            for step in range(1, 4):
                backward_on(model, step, rank, ws)
                assert all(p.main_grad.abs().sum() > 0 for p in model.module.parameters()), (
                    f"{mode} keep={keep}: the new wrapper's main_grad stayed zero"
                )
                backward_on(ref.model, step, rank, ws)
                step_both(model, opt, ref, f"{mode} keep={keep} step {step}")


@case(2, 3)
def case_meta_device_module_refused_naming_to_empty(rank, ws):
    """Row: a model built on the meta device, wrapped, then ``to_empty()`` + init. Was:
    accepted; the gradient buffers stayed on meta and the params never trained."""
    with torch.device("meta"):
        net = Net()
    for mode in ("none", "zero1"):
        with pytest.raises(ValueError, match="to_empty"):
            wrap(net, mode)
    with pytest.raises(ValueError, match="to_empty"):
        aligndp.DataParallel(net)


# ---- optimizers ----


@case(2, 3)
def case_zero1_rmsprop_and_adagrad_match_torch_ddp(rank, ws):
    """Row: ``sharding="zero1"`` with ``torch.optim.RMSprop`` / ``Adagrad`` (elementwise).
    Was: refused as "not elementwise"."""
    for opt_class in (torch.optim.RMSprop, torch.optim.Adagrad):
        model, opt = wrap(make_net(), "zero1", optimizer=opt_class)
        ref = TorchDDP(make_net(), "zero1", optimizer=opt_class)
        for step in range(3):
            train_step_both(model, opt, ref, step, rank, ws, f"{opt_class.__name__} step {step}")


@case(2, 3)
def case_zero1_refuses_non_elementwise_optimizers(rank, ws):
    """Guard for the row above: an optimizer whose update of an element depends on others
    (torch's Muon, a per-tensor-norm SGD) would be silently wrong on ZeRO-1's slices; the
    refusal names both ways out (optimizer='muon', sharding='none')."""
    for opt_class in (torch.optim.Muon, NormalisedSGD):
        with pytest.raises(ValueError, match="elementwise|element depends") as error:
            wrap(make_net(), "zero1", optimizer=opt_class)
        assert "optimizer='muon'" in str(error.value) and "sharding='none'" in str(error.value), (
            str(error.value)
        )


# ---- non-finite gradients on one rank ----


def poison_on(rank: int, param: nn.Parameter, value: float = math.nan):
    """A gradient hook that puts ``value`` into one element of ``param``'s local gradient on
    ``rank`` only."""
    if dist.get_rank() != rank:
        return contextlib.nullcontext()
    handle = param.register_hook(
        lambda g: g.flatten().index_fill(0, torch.tensor([1]), value).view_as(g)
    )

    @contextlib.contextmanager
    def scope():
        try:
            yield
        finally:
            handle.remove()

    return scope()


@case(2, 3)
def case_nonfinite_on_one_rank_skips_the_step_on_every_rank(rank, ws):
    """What to build (check_finite): a NaN in one rank's local gradient makes every rank skip
    the step (params and optimizer state bit-identical, ``opt.skipped_steps == 1``) with
    ``on_nonfinite="skip"``; training continues in sync, like torch DDP without that step."""
    for mode in ("none", "zero1", "muon zero1"):
        with newton_schulz_fp32(mode):
            model, opt = wrap(make_net(), mode, check_finite=True, on_nonfinite="skip")
            ref = TorchDDP(make_net(), mode)
            for step in range(4):
                if step == 1:
                    params, state = snapshot(model.module), copy.deepcopy(opt.state_dict())
                    with poison_on(0, model.module.fc2.bias):
                        backward_on(model, step, rank, ws)
                    opt.step()
                    opt.zero_grad()
                    for n, p in model.module.named_parameters():
                        assert torch.equal(p, params[n]), f"{mode}: {n} moved in a skipped step"
                    assert_state_dicts_equal(
                        opt.state_dict(), state, f"{mode} optimizer state after the skip"
                    )
                    assert opt.skipped_steps == 1, f"{mode}: skipped_steps {opt.skipped_steps}"
                    continue
                backward_on(model, step, rank, ws)
                backward_on(ref.model, step, rank, ws)
                opt.step()
                opt.zero_grad()
                ref.step()
                ref.zero_grad()
                assert_replicas_identical(model.module, f"{mode} step {step}")
                assert_params_match(model.module, ref.module, f"{mode} step {step}", REL)


@case(2, 3)
def case_nonfinite_on_one_rank_raises_on_every_rank_naming_param_and_rank(rank, ws):
    """check_finite with ``on_nonfinite="raise"``: an Inf in the last rank's gradient of
    fc2.bias raises FloatingPointError on every rank, naming the param and that rank;
    after ``zero_grad()`` training goes on in sync."""
    last = ws - 1
    for mode in ("none", "zero1"):
        model, opt = wrap(make_net(), mode, check_finite=True)
        ref = TorchDDP(make_net(), mode)
        with poison_on(last, model.module.fc2.bias, math.inf):
            with pytest.raises(FloatingPointError, match=r"fc2\.bias") as error:
                backward_on(model, 0, rank, ws)
        assert f"rank {last}" in str(error.value), str(error.value)
        opt.zero_grad()
        for step in range(1, 3):
            train_step_both(model, opt, ref, step, rank, ws, f"{mode} step {step}")


# ---- overlap_param_gather ----


def late(model):
    """``model``'s LateGathers backend, after checking the gathers went through it."""
    assert isinstance(model.collectives, LateGathers) and model.collectives.gathers, (
        "no param all-gather went through the late-gather backend: the delay was not injected"
    )
    return model


@case(2, 3)
def case_overlap_param_gather_state_dict_waits_for_the_gather(rank, ws):
    """Row ``overlap_param_gather=True``: after the last ``step()`` a gather is still in flight;
    ``model.module.state_dict()`` (and so save_pretrained) right after it must wait for it.
    Was: stale weights. Compared with the non-overlapped run, bit for bit."""
    runs = {}
    for overlap in (False, True):
        model, opt = wrap(
            make_net(), "zero1", overlap_param_gather=overlap, collectives="late-gather"
        )
        states = []
        for step in range(3):
            backward_on(model, step, rank, ws)
            opt.step()
            opt.zero_grad()
            states.append({k: v.clone() for k, v in model.module.state_dict().items()})
        runs[overlap] = states
        late(model)
    for step, (plain, overlapped) in enumerate(zip(runs[False], runs[True])):
        for k in plain:
            assert torch.equal(plain[k], overlapped[k]), (
                f"step {step} {k}: state_dict() read before the gather landed"
            )


# ---- uneven inputs (last: a failure here may leave the process group out of step) ----


@case(2, 3)
def case_join_uneven_inputs_train_on_within_seconds(rank, ws):
    """Row: uneven inputs (rank 1 has one batch fewer). Was: no ``join()``; "Connection closed
    by peer" or a hang; then every rank raised. Inside ``with model.join():`` the ranks train
    on as torch DDP does under its ``join()`` (tests/test_join.py); even inputs pass through
    join() untouched. The model trains on its own process group with an 8 s timeout, so a join
    that leaves the ranks' collectives out of step fails this case quickly and leaves the other
    cases' group clean."""
    for mode in ("none", "zero1"):
        group = dist.new_group(list(range(ws)), timeout=datetime.timedelta(seconds=8))
        model, opt = wrap(make_net(), mode, process_group=group)
        ref = TorchDDP(make_net(), mode)
        for batches in (2, 3 if rank != 1 else 2):
            start = time.monotonic()
            for m, o in ((model, opt), (ref.model, ref)):
                with m.join():
                    for step in range(batches):
                        backward_on(m, step, rank, ws)
                        o.step()
                        o.zero_grad()
            what = f"{mode}, {batches} batches on rank {rank} under join()"
            assert_params_match(model.module, ref.module, what, REL)
            elapsed = time.monotonic() - start
            assert elapsed < 10, f"{what}: took {elapsed:.1f} s"
        dist.barrier(group=group)  # the group is still in step: the same collectives on every rank


make_tests(globals())
