"""Several optimizer parts behind one torch-optimizer face, with one global gradient norm.

A *part* (:class:`OptimizerPart`, the one contract every mode implements fully) steps some
params with its inner torch optimizer(s) and knows which reduced gradients this rank holds
for them: a whole-matrix optimizer such as Muon
(:class:`~aligndp.optim.whole_matrix.WholeMatrixPart`), ZeRO-1 over an elementwise optimizer
(:class:`~aligndp.optim.sharded.ShardedPart`), or a replicated optimizer
(:class:`ReplicatedPart`). Its ``step()`` reads top-down ([Note: one step, top-down]): the
model's reduced gradients, one global norm, each part's step, each bucket's gather, inside the
step window of the model's gradient reducer (``model.reducer.update()``: the model owns the
order of its buffers around the update; the model calls nothing of the optimizer).
Checkpoints see it through the model-space methods of [Note: model-space state]
(aligndp/state/model_space.py), which it forwards to the part that holds each param.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence

import torch

from aligndp.optim.base import DataParallelOptimizer, check_max_grad_norm, global_grad_norm
from aligndp.optim.join import JoinableOptimizer
from aligndp.plan.routing import Routing
from aligndp.plan.slots import padding_totals
from aligndp.plan.spec import Mode, max_over_mean
from aligndp.runtime.ddp import DataParallel
from aligndp.runtime.step_agreement import ReducedGrads
from aligndp.runtime.step_state import BucketRef, StepState
from aligndp.runtime.wrapped_param import as_parameters, steps_in_place
from aligndp.state.model_space import (
    FlatPiece,
    model_space_to_torch_state,
    torch_state_to_model_space,
)

__all__ = [
    "BucketStepped",
    "OptimizerPart",
    "ReplicatedPart",
    "CompositeOptimizer",
    "sum_of_squares",
]


BucketStepped = Callable[[BucketRef], None]
"""The composite's hook that starts that bucket's param all-gather."""


class OptimizerPart(abc.ABC):
    """What a composite needs from each of its parts; every part implements all of it.

    Attributes every part sets in ``__init__``: ``inner`` (its torch optimizers), ``names``
    (every param it steps on some rank) and ``elementwise_state`` (its declaration for
    checkpoints, [Note: model-space state]: True when the inner optimizer's state tensors
    shaped like a param are per-element, False when every state tensor is whole).
    """

    inner: list[torch.optim.Optimizer]
    names: list[str]
    elementwise_state: bool

    @abc.abstractmethod
    def prepare_grads(self, grads: ReducedGrads) -> None:
        """Bind the reduced gradients ``grads`` (the model's read-only view,
        [Note: reduced grads view]) as ``.grad`` of what the inner optimizer steps (idempotent
        for one view; params without a gradient get none)."""

    @abc.abstractmethod
    def local_grad_sq_sum(self) -> torch.Tensor:
        """This rank's share of the squared global gradient norm (shares sum to it over ranks)."""

    @abc.abstractmethod
    def scale_grads(self, max_norm: float, total_norm: torch.Tensor) -> None:
        """Clip the bound gradients by the global norm
        (``torch.nn.utils.clip_grads_with_norm_``)."""

    @abc.abstractmethod
    def show_grads(self, grads: ReducedGrads) -> None:
        """After a reduction: give what the inner optimizer steps the ``.grad`` users may see
        (a :class:`~aligndp.runtime.grads.ShardedGrad` where it has no full value, so a torch
        ``GradScaler`` refuses clearly)."""

    @abc.abstractmethod
    def step_owned(self, bucket_stepped: BucketStepped, **step_kwargs) -> None:
        """Step what this rank owns (the buckets' masters reach ``param_data`` when each
        bucket's gather launches). A part that steps bucket by bucket calls
        ``bucket_stepped(ref)`` after each of its buckets, so that bucket's all-gather overlaps
        the next one's step; the composite gathers the rest.
        ``step_kwargs``: the user's ``opt.step(**kwargs)``, for each inner ``step()``."""

    @abc.abstractmethod
    def owned_range(self, name: str) -> tuple[int, int]:
        """``[lo, hi)`` of the flattened param ``name`` this rank steps; ``(0, 0)`` if none."""

    @abc.abstractmethod
    def model_space_state_dict(self) -> dict[str, object]:
        """Owned values and optimizer state in model space ([Note: model-space state])."""

    @abc.abstractmethod
    def load_model_space_state_dict(self, sd: dict[str, object]) -> None:
        """Inverse of :meth:`model_space_state_dict`, cut to this rank's current ownership."""


def sum_of_squares(grads: Sequence[torch.Tensor], *, device: torch.device) -> torch.Tensor:
    """fp32 sum of squares of every element of ``grads`` (0 for none)."""
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    return torch.stack([g.float().square().sum() for g in grads]).sum()


class ReplicatedPart(OptimizerPart):
    """A part over all-reduced params: every rank steps all of them with ``inner`` (plain DDP).

    The reduced gradients are already ``param.grad`` ([Note: step states] in DESIGN.md), possibly
    edited by the user (clipping, unscaling) or dropped (``None``: not stepped).
    ``elementwise_state``: False for a whole-matrix optimizer, so its checkpoint entries are
    the same as the zero1 whole-matrix part's (a run can resume in the other sharding)."""

    def __init__(
        self, model: DataParallel, inner: torch.optim.Optimizer, *, elementwise_state: bool
    ) -> None:
        self.model = model
        self.inner = [inner]
        self.elementwise_state = elementwise_state
        self.params = [p for g in inner.param_groups for p in g["params"]]
        self.names = [model.param_names[p] for p in self.params]
        self._plain = steps_in_place(inner)

    def prepare_grads(self, grads: ReducedGrads) -> None:
        pass  # steps from param.grad: the reduced view, as published, maybe edited by the user

    def show_grads(self, grads: ReducedGrads) -> None:
        pass  # the params themselves: the DataParallel published their grads

    def _grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self.params if p.grad is not None]

    def local_grad_sq_sum(self) -> torch.Tensor:
        # every rank holds every gradient: each contributes 1/dp_size so one all-reduce sums to it
        return sum_of_squares(self._grads(), device=self.model.device) / self.model.dp_size

    def scale_grads(self, max_norm: float, total_norm: torch.Tensor) -> None:
        torch.nn.utils.clip_grads_with_norm_(self.params, max_norm, total_norm)

    def step_owned(self, bucket_stepped: BucketStepped, **step_kwargs) -> None:
        # replicated buffers hold no params to gather
        if self._plain:  # [Note: plain class while stepping] in aligndp/runtime/wrapped_param.py
            with as_parameters(self.params):
                self.inner[0].step(**step_kwargs)
        else:
            self.inner[0].step(**step_kwargs)

    def owned_range(self, name: str) -> tuple[int, int]:
        return 0, self.params[self.names.index(name)].numel()

    def model_space_state_dict(self) -> dict[str, object]:
        sd: dict[str, object] = {
            f"param.{n}": FlatPiece(p.detach().float().reshape(-1), 0, p.numel())
            for n, p in zip(self.names, self.params)
        }
        extents = {n: (0, p.numel()) for n, p in zip(self.names, self.params)}
        return sd | torch_state_to_model_space(
            self.inner[0], self.names, extents, elementwise=self.elementwise_state
        )

    @torch.no_grad()
    def load_model_space_state_dict(self, sd: dict[str, object]) -> None:
        for n, p in zip(self.names, self.params):
            p.copy_(sd[f"param.{n}"].tensor.view(p.shape))
        model_space_to_torch_state(self.inner[0], self.names, sd)


class CompositeOptimizer(DataParallelOptimizer, JoinableOptimizer):
    """One optimizer over several parts (e.g. layer-wise Muon + ZeRO-1 AdamW).

    ``param_groups`` lists every part's groups, tagged ``group["optimizer"]`` (``"muon"``,
    ``"adamw"``); lr schedulers reach the inner optimizers. ``max_grad_norm`` clips all parts
    by one global norm, as ``torch.nn.utils.clip_grad_norm_`` over every param would.
    ``routing``: the :class:`~aligndp.plan.routing.Routing` that split the params, when one did.
    """

    def __init__(
        self,
        model: DataParallel,
        parts: Sequence[OptimizerPart],
        *,
        max_grad_norm: float | None = None,
        routing: Routing | None = None,
    ) -> None:
        check_max_grad_norm(max_grad_norm)
        for part in parts:
            if not isinstance(part, OptimizerPart):
                raise TypeError(
                    f"a composite's parts implement aligndp.optim.composite.OptimizerPart, "
                    f"got {type(part).__name__}"
                )
        super().__init__(model, [opt for part in parts for opt in part.inner])
        self._join_init(model)  # torch's Join: optim/join.py
        self.parts = list(parts)
        for part in self.parts:
            for opt in part.inner:
                for group in opt.param_groups:
                    group.setdefault("optimizer", type(opt).__name__.lower())
        self.max_grad_norm = max_grad_norm
        self.skipped_steps = 0
        """Steps skipped on every rank for non-finite gradients (``on_nonfinite="skip"``)."""
        self.routing = routing
        """The :class:`~aligndp.plan.routing.Routing` that split the params, when one did."""
        self.reducer = model.reducer
        """The model's gradient reducer: its step window and ``zero_grad``, the optimizer's
        two calls into the model ([Note: one step, top-down])."""
        self.gather = model.param_gather
        """The model's param gather (a part that steps bucket by bucket launches each one's
        gather as it is stepped; checkpoints wait for them)."""
        self._shown_epoch = -1
        """The reduction whose gradients the parts' tensors show ([Note: grads shown on read])."""

    def _show_grads(self) -> None:
        """[Note: grads shown on read]
        After a reduction, torch code that walks ``opt.param_groups`` (a ``GradScaler``'s
        ``unscale_``) must find on each tensor a part steps the ``.grad`` users may see: a
        :class:`~aligndp.runtime.grads.ShardedGrad` on a sharded part's fp32 masters, which
        refuses clearly. The optimizer pulls it here, when its groups are read after a new
        reduction; the model never calls the optimizer. ``step()`` binds the real gradients
        for the same reduction, after which nothing is shown over them."""
        if self.model.state is not StepState.REDUCED:
            return
        grads = self.model.reducer.reduced()  # the last reduction's view; gathers keep flying
        if grads.epoch != self._shown_epoch:
            self._shown_epoch = grads.epoch
            for part in self.parts:
                part.show_grads(grads)

    def _prepare(self, grads: ReducedGrads) -> None:
        """Bind every part's gradients from ``grads`` (idempotent for one view)."""
        self._shown_epoch = grads.epoch
        for part in self.parts:
            part.prepare_grads(grads)

    def _global_norm(self, grads: ReducedGrads) -> torch.Tensor:
        self._prepare(grads)
        return global_grad_norm(
            [part.local_grad_sq_sum() for part in self.parts], collectives=self.model.collectives
        )

    def _clip(self, max_norm: float, grads: ReducedGrads) -> torch.Tensor:
        total = self._global_norm(grads)
        for part in self.parts:
            part.scale_grads(max_norm, total)
        return total

    @torch.no_grad()
    def grad_norm(self) -> torch.Tensor:
        """The global 2-norm of the reduced gradients over every param (one all-reduce), as
        ``torch.nn.utils.clip_grad_norm_`` would compute it over every rank's full gradients."""
        self._join_refuse_norm("opt.grad_norm()")
        return self._global_norm(self.model.finish_grad_sync())

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` for every mode: scale the reduced gradients so their
        global 2-norm is at most ``max_norm``; returns the norm before clipping."""
        self._join_refuse_norm("opt.clip_grad_norm_()")
        if float(norm_type) != 2.0:
            raise ValueError(f"aligndp clips by the 2-norm only, got norm_type={norm_type!r}")
        if not max_norm > 0:
            raise ValueError(f"max_norm must be > 0, got {max_norm!r}")
        return self._clip(max_norm, self.model.finish_grad_sync())

    @torch.no_grad()
    def step(self, closure=None, **kwargs):
        """torch's ``step``: ``closure`` (forward and backward, returning the loss) runs first,
        with grad, and its loss is returned; ``kwargs`` go to every inner optimizer's ``step``
        (as ``ZeroRedundancyOptimizer.step`` passes them on).

        [Note: one step, top-down]
        The step runs inside the model's step window, ``model.reducer.update()``, one of the
        optimizer's two calls into the model (``zero_grad`` is the other):
        1. reduced grads: entering the window waits for the param gathers still in flight
           (they read the shards this step writes), reduces and agrees, and hands the step
           the read-only :class:`ReducedGrads`; agreed non-finite gradients skip the step or
           raise on every rank;
        2. clip: every part binds its gradients to what it steps and, with ``max_grad_norm``,
           scales them by one global norm (one all-reduce);
        3. per bucket: each part steps the masters its buckets keep
           ([Note: masters with the buckets] in aligndp/runtime/masters.py) — ZeRO-1 every
           bucket's in one multi-tensor step ([Note: one ZeRO-1 step] in optim/sharded.py),
           the layer-wise part bucket by bucket, launching each one's gather as soon as it
           is stepped (``launch_stepped``); leaving the window launches every other
           bucket's, in forward order. A bucket's launch casts its masters back into
           ``param_data`` and hands an FP8 gather the masters it encodes, then starts the
           all-gather, waited for now or, with ``overlap_param_gather``, by the next forward.
        The model calls nothing of the optimizer, and the optimizer installs nothing in it.
        """
        if self._join_config.enable:  # inside a torch Join only (aligndp/optim/join.py)
            self._join_check_step()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with self.reducer.update() as grads:  # 1. the reduced grads' view
            if grads.nonfinite is not None:
                if self.model.config.on_nonfinite == "skip":
                    self.skipped_steps += 1
                    return loss
                raise FloatingPointError(grads.nonfinite)
            if self.max_grad_norm is not None:  # 2. bind, clip
                self._clip(self.max_grad_norm, grads)
            else:
                self._prepare(grads)
            for part in self.parts:  # 3. step the buckets' masters, cast back, gather
                part.step_owned(self.gather.launch_stepped, **kwargs)
            self.model.data_touched.clear()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Same as ``model.zero_grad()``: drop every gradient for the next step (the gradients
        live in the model's buffers, so the optimizer's zero_grad must reach the model)."""
        self.reducer.zero_grad(set_to_none)

    # ---- [Note: model-space state] (aligndp/state/model_space.py) ----
    def _part_of(self, name: str) -> OptimizerPart:
        for part in self.parts:
            if name in part.names:
                return part
        raise KeyError(f"param {name!r} is stepped by no part of this optimizer")

    def owned_range(self, name: str) -> tuple[int, int]:
        return self._part_of(name).owned_range(name)

    def model_space_state_dict(self) -> dict[str, object]:
        self.gather.wait_all()
        sd: dict[str, object] = {"param_groups": []}
        for part in self.parts:
            part_sd = part.model_space_state_dict()
            sd["param_groups"] += part_sd.pop("param_groups")
            sd.update(part_sd)
        return sd

    @torch.no_grad()
    def load_model_space_state_dict(self, sd: dict[str, object]) -> None:
        self.gather.wait_all()
        groups = list(sd.get("param_groups", []))
        counts = [sum(len(opt.param_groups) for opt in part.inner) for part in self.parts]
        if groups and len(groups) != sum(counts):
            raise ValueError(
                f"the checkpoint has {len(groups)} optimizer param group(s) but this optimizer has "
                f"{sum(counts)} ({counts} per part): build it with the same optimizer and routing"
            )
        for part, count in zip(self.parts, counts):
            part.load_model_space_state_dict(sd | {"param_groups": groups[:count]})
            groups = groups[count:]
        self.gather.launch_rest()
        self.gather.wait_all()

    # ---- reporting ----
    @property
    def imbalance(self) -> float:
        """Max/mean owner cost over ranks of the layer-wise buffers (1.0 if none), as planned."""
        costs = [0.0] * self.model.dp_size
        for layout in self.model.layouts:
            if layout.mode is Mode.LAYERWISE:
                costs = [a + b for a, b in zip(costs, layout.rank_costs())]
        return max_over_mean(costs)

    @property
    def padding_fraction(self) -> float:
        """Padding elements over all elements, over every buffer of the model."""
        real, padded = padding_totals(self.model.layouts)
        return (padded - real) / padded if padded else 0.0

    def __repr__(self) -> str:
        inner = ", ".join(type(opt).__name__ for opt in self.inner)
        return (
            f"CompositeOptimizer({inner}; {len(self.param_groups)} param group(s), "
            f"owner cost imbalance {self.imbalance:.3f}, "
            f"padding {100 * self.padding_fraction:.2f}%)"
        )
