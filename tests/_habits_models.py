"""Tiny models and the torch DDP reference for tests/test_torch_habits.py (issue 11).

Each habit test trains aligndp and torch DDP (same seed, same data split, same torch
optimizers) side by side. :class:`TorchDDP` builds the reference for one of :data:`MODES`:
AdamW over every param, or — for ``optimizer="muon"`` — torch's Muon on the routed matrices
and AdamW on the rest, cut into the same param groups in the same order as aligndp's
``opt.param_groups`` (Muon part first). Muon runs its Newton–Schulz in fp32 on both sides
(:func:`newton_schulz_fp32`): torch's bf16 iteration turns last-bit differences of the
reduction order into ~1e-4 relative differences (tests/test_muon.py).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import weakref
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import aligndp
from aligndp.plan.routing import route_params
from aligndp.runtime.collectives import TorchCollectives
from tests.models import (  # noqa: F401  (re-exported)
    MUON_GAIN,
    VOCAB,
    BatchNormNet,
    HeadReadNet,
    Net,
    assert_close,
    assert_params_match,
    assert_replicas_identical,
    batch,
    fp32_newton_schulz,
    loss_of,
    make_net,
    order_tolerance,
    rel_error,
    seeded,
    snapshot,
)

LR = 1e-2
BUCKET_NUMEL = 150
"""Several buckets for the 11/37-wide nets (each param but the head shares its bucket)."""
REL = order_tolerance(terms=40, steps=5, gain=MUON_GAIN)
"""fp32, up to 5 steps, relative to torch DDP on the same per-rank data (issue 11's bar was 1e-6,
tuned on one CPU). The sums that may differ: the all-reduce of up to 3 ranks, GEMMs over
params placed elsewhere (inner dims up to 37), clip norms over ~1,600 squares (``lambda
sqrt(1600) u``: terms 40) and the optimizers' kernels over flat shards; Muon's gain bounds
AdamW's (tests/models.py)."""

MODES: dict[str, dict] = {
    "none": {"sharding": "none"},
    "zero1": {"sharding": "zero1"},
    "muon none": {"optimizer": "muon", "sharding": "none"},
    "muon zero1": {"optimizer": "muon", "sharding": "zero1"},
}


def newton_schulz_fp32(mode: str) -> contextlib.AbstractContextManager:
    """fp32 Newton–Schulz on both sides for Muon modes; nothing otherwise."""
    return fp32_newton_schulz() if mode.startswith("muon") else contextlib.nullcontext()


def wrap(net: nn.Module, mode: str, **kwargs):
    """``aligndp.parallelize`` of ``net`` in ``mode`` with the shared test settings."""
    kwargs.setdefault("lr", LR)
    kwargs.setdefault("bucket_numel", BUCKET_NUMEL)
    return aligndp.parallelize(net, **MODES[mode], **kwargs)


class TorchDDP:
    """torch DDP over ``net`` with the torch optimizers aligndp builds for ``mode``.

    ``groups``: ``[(names, options), ...]`` as given to aligndp's ``param_groups`` (None: one).
    """

    def __init__(
        self,
        net: nn.Module,
        mode: str,
        *,
        find_unused: bool = False,
        groups: Sequence[tuple[Sequence[str], dict]] | None = None,
        lr: float = LR,
        optimizer: type[torch.optim.Optimizer] = torch.optim.AdamW,
        **ddp_kwargs,
    ) -> None:
        self.model = nn.parallel.DistributedDataParallel(
            net, find_unused_parameters=find_unused, **ddp_kwargs
        )
        named = {n: p for n, p in net.named_parameters() if p.requires_grad}
        if groups is None:
            groups = [(list(named), {})]
        if mode.startswith("muon"):
            routing = route_params(net)
            parts = [
                (
                    functools.partial(torch.optim.Muon, adjust_lr_fn="match_rms_adamw"),
                    set(routing.whole),
                ),
                (torch.optim.AdamW, set(routing.adamw)),
            ]
        else:
            parts = [(optimizer, set(named))]
        self.opts = []
        for opt_class, names in parts:
            torch_groups = [
                {"params": [named[n] for n in g if n in names], **options}
                for g, options in groups
                if any(n in names for n in g)
            ]
            if torch_groups:
                self.opts.append(opt_class(torch_groups, lr=lr))

    @property
    def module(self) -> nn.Module:
        return self.model.module

    @property
    def param_groups(self) -> list[dict]:
        return [g for opt in self.opts for g in opt.param_groups]

    def step(self) -> None:
        for opt in self.opts:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.opts:
            opt.zero_grad(set_to_none=set_to_none)


def micro_batches(
    step: int, rank: int, ws: int, count: int
) -> list[tuple[torch.Tensor, torch.Tensor, float]]:
    """This rank's slice of ``step``'s global batch in ``count`` (1-3) micro-batches along tokens:
    ``(idx, tgt, token share)``, so the weighted losses sum to the whole slice's loss."""
    idx, tgt = batch(step, rank, ws)
    cuts = {1: [0, 5], 2: [0, 2, 5], 3: [0, 2, 4, 5]}[count]
    return [(idx[:, a:b], tgt[:, a:b], (b - a) / 5) for a, b in zip(cuts, cuts[1:])]


def backward_on(
    model: nn.Module, step: int, rank: int, ws: int, *, skip_mix: bool = False
) -> torch.Tensor:
    idx, tgt = batch(step, rank, ws)
    loss = F.cross_entropy(model(idx, skip_mix=skip_mix).reshape(-1, VOCAB), tgt.reshape(-1))
    loss.backward()
    return loss


def train_step_both(
    model,
    opt,
    ref: TorchDDP,
    step: int,
    rank: int,
    ws: int,
    what: str,
    *,
    skip_mix: bool = False,
    set_to_none: bool = True,
) -> None:
    """One step of ``step``'s data on aligndp and on torch DDP (backward, step, zero_grad), then
    the params compared."""
    backward_on(model, step, rank, ws, skip_mix=skip_mix)
    backward_on(ref.model, step, rank, ws, skip_mix=skip_mix)
    step_both(model, opt, ref, what, set_to_none=set_to_none)


def step_both(model, opt, ref: TorchDDP, what: str, *, set_to_none: bool = True) -> None:
    """``step()`` and ``zero_grad()`` on aligndp and on torch DDP, then the params compared."""
    opt.step()
    opt.zero_grad(set_to_none=set_to_none)
    ref.step()
    ref.zero_grad(set_to_none=set_to_none)
    assert_params_match(model.module, ref.module, what, REL)


@contextlib.contextmanager
def shared_path(name: str) -> Iterator[str]:
    """A fresh directory path the same on every rank (rank 0's temp dir), removed afterwards."""
    import shutil
    import tempfile

    obj = [tempfile.mkdtemp(prefix="aligndp_habits_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(obj)
    try:
        yield f"{obj[0]}/{name}"
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(obj[0], ignore_errors=True)


class _PerParamSGD(torch.optim.Optimizer):
    """Test-only optimizers (not torch's own): :meth:`update` each param with a gradient."""

    def __init__(self, params, lr: float = 1e-2) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.update(p, group["lr"])

    def update(self, p: torch.Tensor, lr: float) -> None:
        raise NotImplementedError


class NormalisedSGD(_PerParamSGD):
    """Not elementwise: each tensor moves by ``lr * grad / ||grad||`` (a per-tensor norm)."""

    def update(self, p: torch.Tensor, lr: float) -> None:
        p.add_(p.grad / p.grad.norm().clamp(min=1e-12), alpha=-lr)


class RebindingSGD(_PerParamSGD):
    """Old-style SGD that rebinds ``p.data`` to a new tensor each step instead of writing the
    param in place."""

    def update(self, p: torch.Tensor, lr: float) -> None:
        p.data = p.data - lr * p.grad


class _Late:
    """The handle of a gather whose result lands in its bucket only when waited for."""

    def __init__(self, bucket: torch.Tensor, staged: torch.Tensor, unwaited: dict) -> None:
        self.bucket, self.staged, self.unwaited = bucket, staged, unwaited
        self.landed = False

    def wait(self, *args, **kwargs) -> bool:
        if not self.landed:
            self.bucket.copy_(self.staged)
            self.landed = True
            self.unwaited.pop(_bucket_key(self.bucket), None)
        return True

    def is_completed(self) -> bool:
        return self.landed


def _bucket_key(bucket: torch.Tensor) -> tuple[int, int]:
    return bucket.data_ptr(), bucket.numel()


class LateGathers(TorchCollectives):
    """Every param all-gather lands in its bucket only when waited for: a slow network, made
    deterministic, so a missing wait reads stale weights every time (FSDP2's delay injection).
    A gather nobody waited for lands, at the latest, when the next gather of its bucket is
    launched, over whatever was written into the bucket meanwhile (a real backend completes
    it some time, and gloo runs two collectives of a group on two threads in any order): a
    step that casts its masters back before waiting for the last step's gathers loses them.
    Registered through the collectives seam as ``"late-gather"``; ``gathers`` counts them."""

    name = "late-gather"

    def __init__(self, group) -> None:
        super().__init__(group)
        self.gathers = 0
        self.unwaited: dict[tuple[int, int], _Late] = {}
        """The gathers launched and not waited for, by their bucket."""
        self.clobbered = 0
        """Gathers that landed at the next launch of their bucket (never waited for)."""

    def all_gather_shards(self, bucket: torch.Tensor) -> _Late:
        earlier = self.unwaited.get(_bucket_key(bucket))
        if earlier is not None:  # never waited for: it lands now, over this step's writes
            self.clobbered += 1
            earlier.wait()
        self.gathers += 1
        staged = bucket.clone()  # this rank's shard as it is now
        super().all_gather_shards(staged).wait()
        late = _Late(bucket, staged, self.unwaited)
        self.unwaited[_bucket_key(bucket)] = late
        return late


aligndp.register_collectives(LateGathers.name, LateGathers)


def dropped(build: Callable[[], tuple], keep: bool, what: str) -> nn.Module | None:
    """[Note: dropped wrappers]: ``build()`` returns ``(module, wrapper, optimizer)``, trained,
    holding their only references. Drop wrapper and optimizer (and the module, unless
    ``keep``) and assert that nothing of the wrapper outlives them: no buffer, and without
    ``keep`` no param; with ``keep`` the module comes back with no hook, grad sink or wrapped
    param class of the wrapper's left on it."""
    net, model, opt = build()
    buffers = [weakref.ref(b) for b in model.flat_buffers]
    params = [weakref.ref(p) for p in net.parameters()]
    del model, opt
    if not keep:
        del net
    gc.collect()
    assert not any(r() is not None for r in buffers), f"{what} keep={keep}: buffers outlive it"
    if not keep:
        assert not any(r() is not None for r in params), f"{what}: params outlive the wrapper"
        return None
    left = [
        n
        for n, m in net.named_modules()
        if m._forward_pre_hooks or m._state_dict_pre_hooks or m.__dict__.get("_grad_sink")
    ]
    left += [n for n, p in net.named_parameters() if p._post_accumulate_grad_hooks]
    left += [n for n, p in net.named_parameters() if type(p) is not nn.Parameter]
    assert not left, f"{what}: the dropped wrapper left hooks, sinks or classes on {left}"
    return net
