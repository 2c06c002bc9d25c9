"""What layout planning is told: params, consumers' requirements, modes, and the small number
rules every planner shares (round up, max/mean, power of two, the bucket size setting).

[Note: alignment contract] lives in aligndp/plan/layout.py. Pure: no tensors are allocated
and nothing of ``torch.distributed`` is imported.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Callable, Iterable, Sequence

import torch

__all__ = [
    "DEFAULT_START_ALIGNMENT",
    "DEFAULT_BUCKET_NUMEL",
    "DEFAULT_SHARD_ALIGNMENT",
    "Mode",
    "OwnerCost",
    "ParamSpec",
    "Requirement",
    "combined_start_alignment",
    "check_bucket_numel",
    "check_grad_dtype",
    "check_settings",
    "is_power_of_two",
    "max_over_mean",
    "numel_cost",
    "round_up",
]

DEFAULT_START_ALIGNMENT = 64
"""Elements. 128 B for 16-bit views: what cuBLASLt's MXFP8 wgrad needs; ≤ 63 elements of
padding per param."""

DEFAULT_BUCKET_NUMEL = 40_000_000
"""Elements per bucket when the caller names none: the plan request, ``DDPConfig``,
``parallelize()`` and ``aligndp layout`` share it, so the picture shows the buckets the run
builds."""

DEFAULT_SHARD_ALIGNMENT = 128
"""Elements. In sharded modes bucket ends are padded so each shard is a multiple of this."""


OwnerCost = Callable[[tuple[int, ...]], float]
"""Estimated cost of stepping one whole param of a shape; layerwise owners balance it."""


def is_power_of_two(n: int) -> bool:
    return isinstance(n, int) and n >= 1 and (n & (n - 1)) == 0


def round_up(n: int, multiple: int) -> int:
    """Smallest multiple of ``multiple`` that is >= ``n``."""
    return -(-n // multiple) * multiple


def max_over_mean(values: Sequence[float]) -> float:
    """Imbalance of per-rank loads: max/mean, 1.0 when there is no load at all."""
    mean = sum(values) / len(values) if values else 0.0
    return max(values) / mean if mean > 0 else 1.0


def numel_cost(shape: Sequence[int]) -> float:
    """The plain owner cost: a param costs its number of elements (any whole-tensor optimizer
    whose step is linear in the param's size)."""
    return float(math.prod(shape))


def check_bucket_numel(bucket_numel: object, *, flag: str = "bucket_numel") -> None:
    """Refuse a bucket size that is not a positive int or None (None: one bucket per buffer)."""
    if bucket_numel is None:
        return
    if isinstance(bucket_numel, bool) or not isinstance(bucket_numel, int) or bucket_numel <= 0:
        raise ValueError(
            f"{flag} must be a positive number of elements or None (one bucket), got "
            f"{bucket_numel!r}; leave it out for the default of {DEFAULT_BUCKET_NUMEL:,} elements"
        )


def check_grad_dtype(grad_dtype: object) -> None:
    """Refuse a gradient buffer dtype that is not a floating torch dtype (None: param dtype)."""
    if grad_dtype is not None and not (
        isinstance(grad_dtype, torch.dtype) and grad_dtype.is_floating_point
    ):
        raise TypeError(f"grad_dtype must be a floating torch.dtype or None, got {grad_dtype!r}")


def check_settings(
    *, dp_size: object, bucket_numel: object, start_alignment: object, shard_alignment: object
) -> None:
    """The planner's numeric settings, checked once for every caller (plan_layout, PlanRequest)."""
    if isinstance(dp_size, bool) or not isinstance(dp_size, int) or dp_size < 1:
        raise ValueError(f"dp_size must be an integer >= 1, got {dp_size!r}")
    check_bucket_numel(bucket_numel)
    if not is_power_of_two(start_alignment):
        raise ValueError(
            f"start_alignment must be a power of two (1, 2, 4, ..., 64), got {start_alignment!r}"
        )
    if not is_power_of_two(shard_alignment):
        raise ValueError(
            f"shard_alignment must be a power of two (1, 2, 4, ..., 128), got {shard_alignment!r}"
        )


class Mode(str, enum.Enum):
    """How a buffer is reduced and who owns what."""

    REPLICATED = "replicated"
    """All-reduce; every rank owns everything (plain DDP)."""
    SHARDED = "sharded"
    """ZeRO-1: reduce-scatter; rank r owns slice r of every bucket (params may straddle)."""
    LAYERWISE = "layerwise"
    """Reduce-scatter; every param lies whole inside the shard of its owner rank."""

    @classmethod
    def parse(cls, value: Mode | str) -> Mode:
        try:
            return cls(value)
        except ValueError:
            choices = ", ".join(m.value for m in cls)
            raise ValueError(f"unknown mode {value!r}: choose one of {choices}") from None


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """What layout planning needs to know about one trainable parameter."""

    name: str
    """Fully qualified name, e.g. ``blocks.3.mlp.fc.weight``."""
    shape: tuple[int, ...]
    """Tensor shape; every dim >= 1."""
    dtype: torch.dtype = torch.float32
    """Parameter dtype (the grad buffer's dtype is chosen separately)."""
    tags: frozenset[str] = frozenset()
    """Free-form labels such as ``matrix`` or ``embedding`` (routing reads them, layout doesn't)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        object.__setattr__(self, "tags", frozenset(self.tags))
        if not isinstance(self.dtype, torch.dtype):
            raise TypeError(f"param {self.name!r}: dtype must be a torch.dtype, got {self.dtype!r}")
        if any(d < 1 for d in self.shape) or math.prod(self.shape) < 1:
            raise ValueError(
                f"param {self.name!r} has shape {self.shape} with zero elements: a zero-size "
                "param cannot be trained; freeze it (requires_grad=False) or remove it"
            )

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @classmethod
    def from_named_parameters(
        cls, named: Iterable[tuple[str, torch.nn.Parameter]]
    ) -> list[ParamSpec]:
        """Specs of the trainable params, in registration order."""
        specs = []
        for name, p in named:
            if p.requires_grad:
                tags = {"matrix"} if p.ndim == 2 else set()
                specs.append(cls(name, tuple(p.shape), p.dtype, frozenset(tags)))
        return specs


@dataclasses.dataclass(frozen=True)
class Requirement:
    """What one consumer of buffer views needs from the layout. See [Note: alignment contract]."""

    rule: str
    """Who needs it and why, quoted in errors, e.g. ``"MXFP8 wgrad (cuBLASLt)"``."""
    start_elements: int = 1
    """Every param start must be a multiple of this many elements (power of two)."""
    start_bytes: int = 1
    """Every param start must be a multiple of this many bytes in the grad buffer (power of two)."""
    shard_divisible: bool = False
    """Bucket length must split into ``dp_size`` equal shards (sharded and layerwise modes)."""
    whole_param_per_shard: bool = False
    """No param may straddle a shard boundary (whole-tensor optimizers)."""

    def __post_init__(self) -> None:
        for field in ("start_elements", "start_bytes"):
            value = getattr(self, field)
            if not is_power_of_two(value):
                raise ValueError(
                    f"requirement {self.rule!r}: {field}={value!r} is not a power of two; "
                    "use 1, 2, 4, ..., e.g. 64"
                )

    def start_alignment(self, itemsize: int) -> int:
        """This requirement's start alignment in elements of size ``itemsize`` bytes."""
        return max(
            self.start_elements, self.start_bytes // itemsize if self.start_bytes > itemsize else 1
        )


def combined_start_alignment(requirements: Iterable[Requirement], itemsize: int) -> int:
    """The lcm of every requirement's start alignment, in elements of ``itemsize`` bytes."""
    return math.lcm(1, *(r.start_alignment(itemsize) for r in requirements))
