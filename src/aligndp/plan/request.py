"""One plan request: everything that decides the buffers, for the run and for the picture.

[Note: one plan request]
``parallelize()`` (aligndp/parallelize.py: ``plan_request``) builds a :class:`PlanRequest`
from the model and its arguments, ``DataParallel`` allocates exactly ``plan_buffers(request)``,
and ``aligndp layout`` builds its request through the same ``plan_request`` from a model on
the meta device — so what the command prints is what a run allocates. The sharding → modes
mapping (:func:`modes_for_sharding`) and the bucket size's meaning (default
:data:`~aligndp.plan.spec.DEFAULT_BUCKET_NUMEL`; None: one bucket) are written once, here.
Pure: no tensors are allocated and nothing of ``torch.distributed`` is imported.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence

import torch

from aligndp.plan.layout import plan_layout
from aligndp.plan.slots import BufferLayout
from aligndp.plan.spec import (
    DEFAULT_BUCKET_NUMEL,
    DEFAULT_SHARD_ALIGNMENT,
    DEFAULT_START_ALIGNMENT,
    Mode,
    OwnerCost,
    ParamSpec,
    Requirement,
    check_grad_dtype,
    check_settings,
    numel_cost,
)
from aligndp.plan.split import SplitPolicy

__all__ = ["SHARDINGS", "PlanRequest", "modes_for_sharding", "plan_buffers"]

SHARDINGS = ("none", "zero1")
"""``parallelize(sharding=)``: ``none`` replicates every buffer; ``zero1`` shards optimizer
state (whole-matrix params in layerwise buffers, the rest in sharded ones)."""


def modes_for_sharding(
    sharding: str, names: Iterable[str], *, whole: Iterable[str] = ()
) -> dict[str, Mode]:
    """Mode of every param in ``names`` for ``sharding``; ``whole`` names the params a
    whole-matrix optimizer steps (layerwise under zero1)."""
    if sharding not in SHARDINGS:
        raise ValueError(f"unknown sharding {sharding!r}: choose one of {', '.join(SHARDINGS)}")
    whole = set(whole)
    if sharding == "none":
        return {n: Mode.REPLICATED for n in names}
    return {n: Mode.LAYERWISE if n in whole else Mode.SHARDED for n in names}


@dataclasses.dataclass(frozen=True)
class PlanRequest:
    """What the planner is asked for: one request, one list of buffer layouts."""

    specs: tuple[ParamSpec, ...]
    """Trainable params in registration order (names unique, a tied param listed once)."""
    dp_size: int = 1
    """Data-parallel ranks the buffers are reduced (and sharded) over."""
    mode: Mode = Mode.REPLICATED
    """Mode of every param that ``modes`` does not name."""
    modes: Mapping[str, Mode] = dataclasses.field(default_factory=dict)
    """Mode per param name (:func:`modes_for_sharding` builds it from a sharding)."""
    requirements: tuple[Requirement, ...] = ()
    """Every active consumer's requirement (wgrad recipes, fused modules); the planner meets
    their union in every buffer."""
    bucket_numel: int | None = DEFAULT_BUCKET_NUMEL
    """Target elements per bucket (one collective each); None: one bucket per buffer."""
    start_alignment: int = DEFAULT_START_ALIGNMENT
    """Param start alignment in elements (power of two); requirements can only raise it."""
    shard_alignment: int = DEFAULT_SHARD_ALIGNMENT
    """Sharded modes: every shard's length is a multiple of this (elements, power of two)."""
    grad_dtype: torch.dtype | None = None
    """Gradient buffer dtype; None keeps each buffer's param dtype."""
    owner_cost: OwnerCost = numel_cost
    """Layerwise mode: ``cost(shape)`` of stepping one whole param (e.g. Muon's Newton–Schulz
    estimate); owners are balanced by it and each slot records its cost."""
    split: SplitPolicy | None = None
    """Layerwise mode: when a matrix's Newton–Schulz is shared by several ranks
    ([Note: split Newton–Schulz] in plan/split.py); None: every matrix stepped by its owner
    alone."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "specs", tuple(self.specs))
        object.__setattr__(self, "mode", Mode.parse(self.mode))
        object.__setattr__(self, "modes", {n: Mode.parse(m) for n, m in self.modes.items()})
        object.__setattr__(self, "requirements", tuple(self.requirements))
        if not self.specs:
            raise ValueError(
                "no trainable params to lay out: the model has no params with requires_grad=True"
            )
        unknown = set(self.modes) - {s.name for s in self.specs}
        if unknown:
            raise ValueError(f"modes name params that are not among the specs: {sorted(unknown)}")
        check_settings(
            dp_size=self.dp_size,
            bucket_numel=self.bucket_numel,
            start_alignment=self.start_alignment,
            shard_alignment=self.shard_alignment,
        )
        check_grad_dtype(self.grad_dtype)
        if not callable(self.owner_cost):
            raise TypeError(
                f"owner_cost must be a function shape -> float, got {self.owner_cost!r}"
            )

    def mode_of(self, name: str) -> Mode:
        return self.modes.get(name, self.mode)

    def bind(
        self,
        specs: Sequence[ParamSpec],
        *,
        dp_size: int,
        requirements: Iterable[Requirement] = (),
    ) -> PlanRequest:
        """This request for the module being wrapped: its params and process group must be the
        ones planned for; ``requirements`` (e.g. of fused-wgrad modules) join the request's."""
        mine = [(s.name, s.shape, s.dtype) for s in self.specs]
        theirs = [(s.name, s.shape, s.dtype) for s in specs]
        if mine != theirs:
            differ = sorted(set(mine) ^ set(theirs), key=str)[:4]
            raise ValueError(
                f"the plan request was made for other params than the module's trainable ones "
                f"(first differences {differ}): build it from the module being wrapped"
            )
        if dp_size != self.dp_size:
            raise ValueError(
                f"the plan request is for dp_size {self.dp_size} but the process group has "
                f"{dp_size} ranks: build it with the process group's size"
            )
        extra = tuple(r for r in dict.fromkeys(requirements) if r not in self.requirements)
        return dataclasses.replace(self, requirements=self.requirements + extra)


def plan_buffers(
    request: PlanRequest | Sequence[ParamSpec], **fields: object
) -> list[BufferLayout]:
    """One layout per (mode, param dtype) group, registration order kept within each group.

    The one pure function from a :class:`PlanRequest` to layouts: ``DataParallel`` allocates
    exactly this and ``aligndp layout`` shows it. Given specs instead of a request, ``fields``
    are the request's other fields (``dp_size=``, ``mode=``, ``modes=``, ``bucket_numel=``, ...).
    """
    if not isinstance(request, PlanRequest):
        request = PlanRequest(specs=tuple(request), **fields)
    elif fields:
        request = dataclasses.replace(request, **fields)
    groups: dict[tuple[Mode, torch.dtype], list[ParamSpec]] = {}
    for s in request.specs:
        groups.setdefault((request.mode_of(s.name), s.dtype), []).append(s)
    return [
        plan_layout(
            group,
            dp_size=request.dp_size,
            mode=mode,
            bucket_numel=request.bucket_numel,
            requirements=request.requirements,
            start_alignment=request.start_alignment,
            shard_alignment=request.shard_alignment,
            grad_dtype=request.grad_dtype,
            owner_cost=request.owner_cost,
            split=request.split,
        )
        for (mode, _), group in groups.items()
    ]
