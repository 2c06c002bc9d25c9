"""Whole-matrix optimizers: each param stepped whole by one owner rank, then all-gathered.

[Note: layer-wise step]
A whole-matrix optimizer (Muon, Shampoo, SOAP, ...: its update of one element depends on the
whole tensor) is described by a :class:`WholeMatrixSpec` — a torch optimizer class, the
options it takes, a cost function ``shape -> float`` and a param selector — and registered by
name (aligndp/optim/registry.py). Under ``sharding="zero1"`` its params live in
``Mode.LAYERWISE`` buffers: every bucket is cut into ``dp_size`` equal shards and every param
lies whole inside the shard of its owner, owners balanced by the spec's cost (the plan
request's ``owner_cost``). The DDP wrapper reduce-scatters the gradients, so after
``finish_grad_sync()`` an owner's ``main_grad`` views of its own params hold the mean
gradient (the other views hold garbage). One step of :class:`WholeMatrixPart` is then:

1. assign: owned params get ``.grad`` = their ``main_grad`` (fp32 masters for 16-bit params
   with ``master_weights``, [Note: master weights] in optim/sharded.py);
2. step owned: the torch optimizer's ``step()`` — torch optimizers skip params whose ``.grad``
   is None, so the inner optimizer holds *every* param (identical ``param_groups`` on every
   rank, also on a rank that owns none) but only touches and keeps state for its own;
3. all-gather: owners' shards of ``param_data`` go to every rank. With
   ``WholeMatrixSpec.step_per_bucket`` steps 2 and 3 go bucket by bucket: bucket k's
   all-gather (started through the composite's ``bucket_stepped`` hook) runs while bucket
   k+1 is stepped. Each bucket's launch first casts its fp32 masters back into ``param_data``
   ([Note: masters with the buckets] in aligndp/runtime/masters.py).

Its state is whole ([Note: model-space state]): held by the owner, saved with its own shape.
The maths is the torch optimizer's; this file only decides ownership and moves data.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import torch.nn as nn

from aligndp.optim.composite import BucketStepped, OptimizerPart, sum_of_squares
from aligndp.optim.groups import ParamGroup
from aligndp.optim.sharded import bucket_masters_of
from aligndp.optim.split_ns import SplitMatrix, global_split_ranks, split_groups
from aligndp.plan.routing import MuonFilter
from aligndp.plan.spec import Mode, OwnerCost
from aligndp.plan.split import SplitPolicy
from aligndp.runtime.ddp import DataParallel
from aligndp.runtime.grads import ShardedGrad
from aligndp.runtime.masters import refresh_master
from aligndp.runtime.step_agreement import ReducedGrads
from aligndp.state.model_space import (
    FlatPiece,
    model_space_to_torch_state,
    torch_state_to_model_space,
)

__all__ = ["WholeMatrixSpec", "WholeMatrixPart", "split_kwargs", "torch_groups"]


@dataclasses.dataclass(frozen=True)
class WholeMatrixSpec:
    """How aligndp drives one whole-matrix torch optimizer (registered by name)."""

    optimizer_class: type[torch.optim.Optimizer]
    """The torch optimizer, built as ``optimizer_class(param_groups, **options)``; it must skip
    params whose ``.grad`` is None (every torch optimizer does)."""
    cost: OwnerCost
    """``cost(shape)``: estimated work of one step of one param; owners are balanced by it."""
    options: tuple[str, ...] | None = None
    """Keyword options it accepts (others are refused, naming these); None: any."""
    select: MuonFilter | None = None
    """The params it steps: a predicate ``(name, param, module) -> bool`` or name patterns;
    None: the hidden 2-D matrices (aligndp/plan/routing.py); the rest go to AdamW."""
    defaults: tuple[tuple[str, object], ...] = ()
    """``(option, value)`` pairs aligndp passes unless the user gives the option (Muon:
    ``adjust_lr_fn="match_rms_adamw"``, so that one lr serves it and AdamW)."""
    step_per_bucket: bool = True
    """True when ``step()`` may be called once per bucket (state kept per param, as torch's
    optimizers do), so each bucket's all-gather overlaps the next bucket's step; False: one
    ``step()`` over every owned param (e.g. an optimizer counting steps per group)."""
    split: SplitPolicy | None = None
    """When one matrix's step is shared by several ranks ([Note: split Newton–Schulz] in
    plan/split.py; Muon only: aligndp/optim/split_ns.py runs it); None: never."""

    def __post_init__(self) -> None:
        if not (
            isinstance(self.optimizer_class, type)
            and issubclass(self.optimizer_class, torch.optim.Optimizer)
        ):
            raise TypeError(
                f"optimizer_class must be a torch.optim.Optimizer subclass, got "
                f"{self.optimizer_class!r}"
            )
        if not callable(self.cost):
            raise TypeError(f"cost must be a function shape -> float, got {self.cost!r}")
        if self.split is not None and not issubclass(self.optimizer_class, torch.optim.Muon):
            raise ValueError(
                f"{self.name} cannot share a matrix's step over ranks (split Newton–Schulz runs "
                "torch.optim.Muon's algorithm, aligndp/optim/split_ns.py): give split=None"
            )

    @property
    def name(self) -> str:
        return self.optimizer_class.__name__


def split_kwargs(spec: WholeMatrixSpec, name: str, kwargs: dict) -> tuple[dict, dict]:
    """``(whole_kwargs, adamw_kwargs)``: ``adamw_<x>`` keys go to AdamW as ``<x>``; ``lr`` to
    both, unless ``<name>_lr`` (e.g. ``muon_lr``) or ``adamw_lr`` overrides it for one; every
    other key must be one of ``spec.options``; ``spec.defaults`` fill what is not given."""
    own_lr = f"{name.lower()}_lr"
    adamw = {k.removeprefix("adamw_"): v for k, v in kwargs.items() if k.startswith("adamw_")}
    whole = {k: v for k, v in kwargs.items() if not k.startswith("adamw_") and k != own_lr}
    unknown = [] if spec.options is None else sorted(set(whole) - set(spec.options))
    if unknown:
        raise TypeError(
            f"unknown option(s) {unknown} for optimizer={name!r}: {spec.name} takes "
            f"{list(spec.options or ())} and {own_lr}; AdamW options take an 'adamw_' prefix "
            "(adamw_lr, adamw_betas, adamw_weight_decay, ...)"
        )
    if "lr" in whole:
        adamw.setdefault("lr", whole["lr"])
    if own_lr in kwargs:
        whole["lr"] = kwargs[own_lr]
    for key, value in spec.defaults:
        whole.setdefault(key, value)
    return whole, adamw


def torch_groups(groups: Sequence[ParamGroup], tensors: dict[str, torch.Tensor]) -> list[dict]:
    """torch param groups over ``tensors`` (by name): each group cut to the names it has here;
    a group with none of them is left out (so empty groups never reach a torch optimizer)."""
    return [
        {"params": [tensors[n] for n in g.names if n in tensors], **g.options}
        for g in groups
        if any(n in tensors for n in g.names)
    ]


class WholeMatrixPart(OptimizerPart):
    """A whole-matrix optimizer over the ``Mode.LAYERWISE`` buffers of ``model``: a part of a
    :class:`~aligndp.optim.composite.CompositeOptimizer`.

    ``params`` are its params as ``(name, param)`` in registration order; each must sit in a
    layerwise buffer of ``model``. ``options`` go to ``spec.optimizer_class``. An owned
    param with a separate fp32 master in its bucket (``bucket.masters``,
    [Note: masters with the buckets] in aligndp/runtime/masters.py; [Note: master weights] in
    optim/sharded.py) is stepped through it; every other param is stepped as itself.
    """

    elementwise_state = False  # [Note: model-space state]: the owner holds every state whole

    def __init__(
        self,
        model: DataParallel,
        params: Sequence[tuple[str, nn.Parameter]],
        spec: WholeMatrixSpec,
        *,
        groups: Sequence[ParamGroup] | None = None,
        options: dict | None = None,
    ) -> None:
        layerwise = set(model.index.refs_of(Mode.LAYERWISE))
        owner = {id(p): s.slot.owner for p, s in model.index.slots.items() if s.ref in layerwise}
        missing = [n for n, p in params if id(p) not in owner]
        if missing:
            raise ValueError(
                f"{spec.name} params {missing} are not in a layerwise buffer: plan every param "
                "of a whole-matrix optimizer in mode 'layerwise' (parallelize(sharding='zero1'))"
            )
        self.model, self.spec = model, spec
        self.names = [n for n, _ in params]
        self.params = [p for _, p in params]
        self.owners = [owner[id(p)] for p in self.params]
        buffers = list(dict.fromkeys(model.index.buffer(ref) for ref in layerwise))
        masters = {id(m.param): m for m in bucket_masters_of(model, buffers)}
        self.coded = {k for k, m in masters.items() if m.coded}  # [Note: FP8 param gather]
        # an owned 16-bit param with master_weights (or gathered in FP8) is stepped through
        # the fp32 master its bucket keeps
        self.targets = [
            masters[id(p)].master if id(p) in masters and masters[id(p)].cast_back else p
            for p in self.params
        ]
        groups = groups or [ParamGroup(tuple(self.names), {})]
        tensors = dict(zip(self.names, self.targets))
        self.inner = [spec.optimizer_class(torch_groups(groups, tensors), **(options or {}))]
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
        self._prepared: ReducedGrads | None = None
        index = {id(p): i for i, p in enumerate(self.params)}
        self._buckets = [  # (bucket, indices of its params), in bucket order
            (ref, [index[id(p)] for p in model.index.members[ref] if id(p) in index])
            for ref in model.index.refs_of(Mode.LAYERWISE)
        ]
        # [Note: split Newton–Schulz]: this rank's side of every matrix it shares. The plan's
        # ranks are those of the collectives' group (a mesh's shard group; ``process_group``
        # may be wider); every rank of the job makes every split group, in plan order
        # (split_groups: a collective even for a rank that shares no matrix)
        group = model.collectives.group
        mine = {
            i: split
            for _, members in self._buckets
            for i in members
            if (split := model.index.slots[self.params[i]].slot.split) is not None
            and split.part_of(model.rank) is not None
        }
        made = split_groups(
            [global_split_ranks(s, group) for s in mine.values()], model.process_group
        )
        self.splits: dict[int, SplitMatrix] = {
            i: SplitMatrix(
                self.params[i].shape,
                split,
                model.rank,
                group,
                model.device,
                made[tuple(sorted(global_split_ranks(split, group)))],
            )
            for i, split in mine.items()
        }

    @property
    def owned(self) -> list[int]:
        """Indices (into ``names``/``params``) of the params this rank steps."""
        return [i for i, o in enumerate(self.owners) if o == self.model.rank]

    def show_grads(self, grads: ReducedGrads) -> None:
        for i in self.owned:
            if self.targets[i] is not self.params[i]:  # a 16-bit param's fp32 master
                self.targets[i].grad = (
                    ShardedGrad(self.targets[i]) if grads.has_grad(self.params[i]) else None
                )

    @torch.no_grad()
    def prepare_grads(self, grads: ReducedGrads) -> None:
        """1. assign: owned params with a gradient (on some rank) get their reduced ``main_grad``
        (cast to the master's dtype); fp32 masters of 16-bit params the user wrote since our
        last step (version counter) take the new values first."""
        if self._prepared is grads:
            grads.check()
            return
        self._prepared = grads
        # params stepped in place show a ShardedGrad after each reduction: hide it from the step
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
                decoded = self.model.param_gather.coded.decoded(p) if id(p) in self.coded else None
                refresh_master(
                    self.targets[i],
                    p.detach(),
                    None if decoded is None else decoded.view(p.shape),
                )
                self._versions[i] = p._version
            self.targets[i].grad = (
                grads.view(p).to(self.targets[i].dtype) if grads.has_grad(p) else None
            )

    def local_grad_sq_sum(self) -> torch.Tensor:
        """Sum of squares of the owned params' gradients (each param counted by its owner only)."""
        grads = [self.targets[i].grad for i in self.owned if self.targets[i].grad is not None]
        return sum_of_squares(grads, device=self.model.device)

    def scale_grads(self, max_norm: float, total_norm: torch.Tensor) -> None:
        torch.nn.utils.clip_grads_with_norm_(
            [self.targets[i] for i in self.owned], max_norm, total_norm
        )

    def _step(self, members: list[int], grads: dict[int, torch.Tensor], **step_kwargs) -> None:
        """Step ``members`` that have a gradient (the shared ones with their groups, the rest
        by the torch optimizer); their bucket's gather casts the masters back."""
        reduced = self._prepared  # every rank agrees on which params have a gradient
        for i in members:
            if i in self.splits and reduced is not None and reduced.has_grad(self.params[i]):
                self._split_step(i, grads.get(i))
        mine = [i for i in members if i in grads and i not in self.splits]
        for i in mine:
            self.targets[i].grad = grads[i]
        if mine:
            self.inner[0].step(**step_kwargs)
        for i in (i for i in members if i in grads):
            self.targets[i].grad = None  # its bucket's gather casts the master back

    def _split_step(self, i: int, grad: torch.Tensor | None) -> None:
        """Matrix i's step shared with its group; the owner hands in its gradient."""
        target = self.targets[i]
        options = next(
            g for g in self.inner[0].param_groups if any(p is target for p in g["params"])
        )
        if grad is None:  # a helper: no param, no state
            self.splits[i].step(options, None, None)
            return
        target.grad = grad
        self.splits[i].step(options, target, self.inner[0].state[target])
        target.grad = None

    @torch.no_grad()
    def step_owned(self, bucket_stepped: BucketStepped, **step_kwargs) -> None:
        """2. step owned: the torch optimizer steps exactly the params that have a ``.grad``, so
        each bucket's grads are handed over in turn (or all at once without
        ``step_per_bucket``); masters are cast back. 3. all-gather: ``bucket_stepped(ref)`` starts
        each bucket's gather as soon as it is stepped."""
        grads = {i: self.targets[i].grad for i in self.owned if self.targets[i].grad is not None}
        for i in grads:
            self.targets[i].grad = None
        if not self.spec.step_per_bucket:  # every index: a helper of a split matrix owns none
            self._step([i for _, members in self._buckets for i in members], grads, **step_kwargs)
        for ref, members in self._buckets:
            if self.spec.step_per_bucket:
                self._step(members, grads, **step_kwargs)
            bucket_stepped(ref)
        for i, grad in (self._visible or {}).items():
            self.params[i].grad = grad  # as the DataParallel published it ([Note: step states])
        self._visible = None
        self._prepared = None

    def state_of(self, name: str) -> dict:
        """The inner optimizer's state of param ``name`` on this rank (empty if not owned or not
        stepped yet)."""
        return self.inner[0].state.get(self.targets[self.names.index(name)], {})

    # ---- [Note: model-space state]: the owner holds a param and its state whole ----
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
        return sd | torch_state_to_model_space(
            self.inner[0], self.names, extents, elementwise=self.elementwise_state
        )

    @torch.no_grad()
    def load_model_space_state_dict(self, sd: dict[str, object]) -> None:
        """Values and state of the owned params; the composite all-gathers the rest."""
        for i in self.owned:
            self.targets[i].copy_(sd[f"param.{self.names[i]}"].tensor.view(self.params[i].shape))
            if self.targets[i] is not self.params[i]:
                self.params[i].copy_(self.targets[i])
                self._versions[i] = self.params[i]._version
        model_space_to_torch_state(self.inner[0], self.names, sd)
