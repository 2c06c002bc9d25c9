"""Layer-wise sharded Muon: each rank steps the whole matrices it owns, then params are all-gathered.

[Note: layer-wise step]
The Muon matrices live in ``Mode.LAYERWISE`` buffers: every bucket is cut into ``dp_size``
equal shards and every matrix lies whole inside the shard of its owner (owners balanced by
Newton–Schulz cost, :mod:`aligndp.plan.assign`). The DDP wrapper reduce-scatters the gradients,
so after ``finish_grad_sync()`` an owner's ``main_grad`` views of its own matrices hold the
mean gradient (the other views hold garbage). One step is then:

1. assign: owned matrices get ``.grad`` = their ``main_grad`` (fp32 masters for 16-bit params);
2. step owned: ``torch.optim.Muon.step()`` — Muon skips params whose ``.grad`` is None, so the
   inner optimizer holds *every* matrix (identical ``param_groups`` on every rank, also on a
   rank that owns none) but only touches and keeps momentum for its own;
3. all-gather: owners' shards of ``param_data`` go to every rank. Steps 2 and 3 go bucket by
   bucket: bucket k's all-gather (started through the composite optimizer's
   :class:`~aligndp.optim.composite.BucketGather`) runs while bucket k+1 is orthogonalised.

The maths is torch's ``Muon``; this file only decides ownership and moves data.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn as nn

from aligndp.optim.composite import CompositeOptimizer, ReplicatedPart, sum_of_squares
from aligndp.optim.groups import ParamGroup
from aligndp.optim.sharded import ShardedPart, refresh_master
from aligndp.plan.layout import Mode, Requirement
from aligndp.plan.routing import MuonFilter, route_params
from aligndp.runtime.buffer import FlatBuffer
from aligndp.runtime.ddp import DataParallel, DDPConfig
from aligndp.runtime.grads import ShardedGrad
from aligndp.state.model_space import (
    FlatPiece,
    model_space_to_torch_state,
    torch_state_to_model_space,
)

__all__ = ["LayerwiseMuon", "MUON_OPTIONS", "split_muon_kwargs", "parallelize_muon"]

MUON_OPTIONS = (
    "lr",
    "momentum",
    "nesterov",
    "ns_steps",
    "ns_coefficients",
    "eps",
    "adjust_lr_fn",
    "weight_decay",
)
"""Keyword arguments passed through to ``torch.optim.Muon`` (its defaults otherwise)."""


class LayerwiseMuon:
    """The Muon part of a composite optimizer over the ``Mode.LAYERWISE`` buffers of ``model``.

    ``params`` are the Muon matrices as ``(name, param)`` in registration order; each must sit
    in a layerwise buffer of ``model``. ``muon_kwargs`` go to ``torch.optim.Muon``.
    """

    def __init__(
        self,
        model: DataParallel,
        params: Sequence[tuple[str, nn.Parameter]],
        *,
        groups: Sequence[ParamGroup] | None = None,
        **muon_kwargs,
    ) -> None:
        unknown = set(muon_kwargs) - set(MUON_OPTIONS)
        if unknown:
            raise TypeError(
                f"unknown Muon option(s) {sorted(unknown)}: choose from {list(MUON_OPTIONS)}"
            )
        owner = {}
        for buf in model.buffers_for(Mode.LAYERWISE):
            owner.update({id(p): s.owner for p, s in zip(buf.params, buf.slots)})
        missing = [n for n, p in params if id(p) not in owner]
        if missing:
            raise ValueError(
                f"Muon params {missing} are not in a layerwise buffer: wrap the model with "
                "DataParallel(modes={name: Mode.LAYERWISE}) for every Muon matrix"
            )
        self.model = model
        self.names = [n for n, _ in params]
        self.params = [p for _, p in params]
        self.owners = [owner[id(p)] for p in self.params]
        # a 16-bit param is stepped through an fp32 master copy, made only where this rank owns it
        self.targets = [
            p.detach().float().clone() if o == model.rank and p.dtype != torch.float32 else p
            for p, o in zip(self.params, self.owners)
        ]
        groups = groups or [ParamGroup(tuple(self.names), {})]
        self.inner = [
            torch.optim.Muon(
                _torch_groups(groups, dict(zip(self.names, self.targets))), **muon_kwargs
            )
        ]
        order = [n for g in groups for n in g.names if n in set(self.names)]
        if order != self.names:  # the inner optimizer's param order is group-major
            perm = [self.names.index(n) for n in order]
            self.names, self.params, self.owners, self.targets = (
                [seq[i] for i in perm]
                for seq in (self.names, self.params, self.owners, self.targets)
            )
        self._versions = {
            i: self.params[i]._version for i in self.owned if self.targets[i] is not self.params[i]
        }
        self._visible: dict[int, torch.Tensor | None] | None = None
        self._prepared_at: int | None = None
        index = {id(p): i for i, p in enumerate(self.params)}
        self._buckets = [  # (buffer, bucket, indices of its Muon matrices), in gather order
            (
                buf,
                b,
                [
                    index[id(p)]
                    for p, s in zip(buf.params, buf.slots)
                    if s.bucket == b and id(p) in index
                ],
            )
            for buf in model.buffers_for(Mode.LAYERWISE)
            for b in range(len(buf.layout.buckets))
        ]
        self.on_bucket_stepped: Callable[[FlatBuffer, int], None] | None = None
        """Called after each layer-wise bucket is stepped (the composite starts its all-gather)."""

    @property
    def owned(self) -> list[int]:
        """Indices (into ``names``/``params``) of the matrices this rank steps."""
        return [i for i, o in enumerate(self.owners) if o == self.model.rank]

    def on_reduced(self) -> None:
        for i in self.owned:
            if self.targets[i] is not self.params[i]:  # a 16-bit matrix's fp32 master
                self.targets[i].grad = (
                    ShardedGrad(self.targets[i]) if self.model.has_grad(self.params[i]) else None
                )

    @torch.no_grad()
    def prepare_grads(self) -> None:
        """1. assign: owned matrices with a gradient (on some rank) get their reduced ``main_grad``
        (cast to the master's dtype); fp32 masters of 16-bit matrices the user wrote since our
        last step (version counter) take the new values first."""
        if self._prepared_at == self.model.reductions:
            return
        self._prepared_at = self.model.reductions
        # params stepped in place show a ShardedGrad after each reduction: hide it from Muon
        self._visible = {
            i: p.grad for i, (p, t) in enumerate(zip(self.params, self.targets)) if p is t
        }
        for i in self._visible:
            self.params[i].grad = None
        for i in self.owned:
            p = self.params[i]
            if i in self._versions and (
                p._version != self._versions[i] or p in self.model.data_touched
            ):
                refresh_master(self.targets[i], p.detach())
                self._versions[i] = self.params[i]._version
            p = self.params[i]
            self.targets[i].grad = (
                self.model.reduced_grad(p).to(self.targets[i].dtype)
                if self.model.has_grad(p)
                else None
            )

    def local_grad_sq_sum(self) -> torch.Tensor:
        """Sum of squares of the owned matrices' gradients (each matrix counted by its owner only)."""
        grads = [self.targets[i].grad for i in self.owned if self.targets[i].grad is not None]
        return sum_of_squares(grads, device=self.model.device)

    def scale_grads(self, max_norm: float, total_norm: torch.Tensor) -> None:
        torch.nn.utils.clip_grads_with_norm_(
            [self.targets[i] for i in self.owned], max_norm, total_norm
        )

    @torch.no_grad()
    def step_owned(self) -> None:
        """2. step owned, bucket by bucket: torch's Muon steps exactly the matrices that have a
        ``.grad``, so each bucket's grads are handed over in turn; masters are cast back.
        3. all-gather: ``on_bucket_stepped(buffer, bucket)`` (set by the composite optimizer)
        starts each bucket's gather, overlapping the next bucket's Newton–Schulz."""
        grads = {i: self.targets[i].grad for i in self.owned if self.targets[i].grad is not None}
        for i in grads:
            self.targets[i].grad = None
        for buf, bucket, members in self._buckets:
            mine = [i for i in members if i in grads]
            for i in mine:
                self.targets[i].grad = grads[i]
            if mine:
                self.inner[0].step()
            for i in mine:
                self.targets[i].grad = None
                if self.targets[i] is not self.params[i]:
                    self.params[i].copy_(
                        self.targets[i]
                    )  # fp32 master -> the param's view in param_data
                    self._versions[i] = self.params[i]._version
            if self.on_bucket_stepped is not None:
                self.on_bucket_stepped(buf, bucket)
        for i, grad in (self._visible or {}).items():
            self.params[i].grad = grad  # as the DataParallel published it ([Note: step states])
        self._visible = None
        self._prepared_at = None

    def momentum(self, name: str) -> torch.Tensor | None:
        """The momentum buffer of matrix ``name`` on this rank (None if not owned or not stepped yet)."""
        i = self.names.index(name)
        return self.inner[0].state.get(self.targets[i], {}).get("momentum_buffer")

    # ---- [Note: model-space state] (aligndp/state/checkpoint.py): the owner holds a matrix whole ----
    def owned_range(self, name: str) -> tuple[int, int]:
        i = self.names.index(name)
        return (0, self.params[i].numel()) if self.owners[i] == self.model.rank else (0, 0)

    def model_space_state_dict(self) -> dict[str, object]:
        sd: dict[str, object] = {}
        for i in self.owned:
            sd[f"param.{self.names[i]}"] = FlatPiece(
                self.targets[i].detach().float().reshape(-1), 0, self.params[i].numel()
            )
        extents = {n: (0, p.numel()) for n, p in zip(self.names, self.params)}
        return sd | torch_state_to_model_space(self.inner[0], self.names, extents)

    @torch.no_grad()
    def load_model_space_state_dict(self, sd: dict[str, object]) -> None:
        """Values and momentum of the owned matrices; the composite all-gathers the rest."""
        for i in self.owned:
            self.targets[i].copy_(sd[f"param.{self.names[i]}"].tensor.view(self.params[i].shape))
            if self.targets[i] is not self.params[i]:
                self.params[i].copy_(self.targets[i])
                self._versions[i] = self.params[i]._version
        model_space_to_torch_state(self.inner[0], self.names, sd)


def split_muon_kwargs(kwargs: dict) -> tuple[dict, dict]:
    """``(muon_kwargs, adamw_kwargs)``: ``adamw_<x>`` keys go to AdamW as ``<x>``; ``lr`` to both
    unless ``adamw_lr`` is given; every other key must be a Muon option."""
    adamw = {k.removeprefix("adamw_"): v for k, v in kwargs.items() if k.startswith("adamw_")}
    muon = {k: v for k, v in kwargs.items() if not k.startswith("adamw_")}
    unknown = sorted(set(muon) - set(MUON_OPTIONS))
    if unknown:
        raise TypeError(
            f"unknown option(s) {unknown} for optimizer='muon': Muon takes {list(MUON_OPTIONS)}; "
            "AdamW options take an 'adamw_' prefix (adamw_lr, adamw_betas, adamw_weight_decay, ...)"
        )
    if "lr" in muon:
        adamw.setdefault("lr", muon["lr"])
    return muon, adamw


def _torch_groups(groups: Sequence[ParamGroup], tensors: dict[str, torch.Tensor]) -> list[dict]:
    """torch param groups over ``tensors`` (by name): each group cut to the names it has here;
    a group with none of them is left out (so empty groups never reach a torch optimizer)."""
    return [
        {"params": [tensors[n] for n in g.names if n in tensors], **g.options}
        for g in groups
        if any(n in tensors for n in g.names)
    ]


def parallelize_muon(
    model: nn.Module,
    *,
    sharding: str,
    process_group,
    config: DDPConfig,
    requirements: Sequence[Requirement],
    max_grad_norm: float | None,
    groups: Sequence[ParamGroup],
    overlap_param_gather: bool = False,
    muon_filter: MuonFilter | None = None,
    adamw_fused: bool = False,
    **kwargs,
) -> tuple[DataParallel, CompositeOptimizer]:
    """``parallelize(model, optimizer="muon", ...)``: route, wrap, build Muon + AdamW parts.

    ``sharding="none"``: every buffer replicated (all-reduce), every rank steps everything.
    ``sharding="zero1"``: Muon matrices in layerwise buffers stepped by their owners
    ([Note: layer-wise step]); the rest stepped by ZeRO-1 AdamW. Each of ``groups`` is cut
    into its Muon and its AdamW params, with the same options.
    """
    muon_kwargs, adamw_kwargs = split_muon_kwargs(kwargs)
    if adamw_fused:
        adamw_kwargs.setdefault("fused", True)
    routing = route_params(model, muon_filter=muon_filter)
    zero1 = sharding == "zero1"
    modes = (
        {n: Mode.LAYERWISE for n in routing.muon} | {n: Mode.SHARDED for n in routing.adamw}
        if zero1
        else {}
    )
    ddp = DataParallel(
        model, process_group=process_group, config=config, modes=modes, requirements=requirements
    )
    named = dict(model.named_parameters())
    muon_groups = [
        ParamGroup(tuple(n for n in g.names if n in routing.muon), g.options) for g in groups
    ]
    adamw_groups = [
        ParamGroup(tuple(n for n in g.names if n in routing.adamw), g.options) for g in groups
    ]
    muon_groups = [g for g in muon_groups if g.names]
    adamw_groups = [g for g in adamw_groups if g.names]
    parts = []
    if routing.muon and zero1:
        parts.append(
            LayerwiseMuon(
                ddp, [(n, named[n]) for n in routing.muon], groups=muon_groups, **muon_kwargs
            )
        )
    elif routing.muon:
        tensors = {n: named[n] for n in routing.muon}
        parts.append(
            ReplicatedPart(
                ddp, torch.optim.Muon(_torch_groups(muon_groups, tensors), **muon_kwargs)
            )
        )
    if routing.adamw and zero1:
        parts.append(
            ShardedPart(
                ddp,
                ddp.buffers_for(Mode.SHARDED),
                torch.optim.AdamW,
                groups=adamw_groups,
                **adamw_kwargs,
            )
        )
    elif routing.adamw:
        tensors = {n: named[n] for n in routing.adamw}
        parts.append(
            ReplicatedPart(
                ddp, torch.optim.AdamW(_torch_groups(adamw_groups, tensors), **adamw_kwargs)
            )
        )
    optimizer = CompositeOptimizer(
        ddp, parts, max_grad_norm=max_grad_norm, overlap_param_gather=overlap_param_gather
    )
    optimizer.routing = routing
    return ddp, optimizer
