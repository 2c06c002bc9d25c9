"""Optimizers selectable by name: torch's elementwise ones and registered whole-matrix ones.

Adding a whole-matrix optimizer (Shampoo, SOAP, Dion, ...) is one module that builds a
:class:`~aligndp.optim.whole_matrix.WholeMatrixSpec` (its torch optimizer class, options,
cost function, selector) and one :func:`register_whole_matrix` line — here for a built-in,
anywhere for a user's: ``aligndp.register_whole_matrix("shampoo", spec)`` makes
``parallelize(optimizer="shampoo")`` work in both shardings.
"""

from __future__ import annotations

import torch

from aligndp.optim.base import ELEMENTWISE_OPTIMIZERS, resolve_optimizer_class
from aligndp.optim.muon import MUON
from aligndp.optim.whole_matrix import WholeMatrixSpec

__all__ = ["register_whole_matrix", "whole_matrix_spec", "known_optimizers", "resolve_optimizer"]

_WHOLE_MATRIX: dict[str, WholeMatrixSpec] = {}


def register_whole_matrix(name: str, spec: WholeMatrixSpec) -> None:
    """Make ``parallelize(optimizer=name)`` step ``spec``'s params whole on owner ranks."""
    if not isinstance(name, str) or not name or name != name.lower():
        raise ValueError(f"a whole-matrix optimizer's name is a lower-case string, got {name!r}")
    if not isinstance(spec, WholeMatrixSpec):
        raise TypeError(
            f"register_whole_matrix takes a WholeMatrixSpec, got {type(spec).__name__}: build "
            "one with aligndp.WholeMatrixSpec(optimizer_class, cost=..., options=...)"
        )
    if name in ELEMENTWISE_OPTIMIZERS:
        raise ValueError(f"{name!r} names torch's elementwise {ELEMENTWISE_OPTIMIZERS[name]}")
    if _WHOLE_MATRIX.get(name, spec) != spec:
        raise ValueError(
            f"a whole-matrix optimizer {name!r} is registered already "
            f"({_WHOLE_MATRIX[name].name}): choose another name"
        )
    _WHOLE_MATRIX[name] = spec


def whole_matrix_spec(name: str) -> WholeMatrixSpec | None:
    """The registered spec called ``name`` (case-insensitive), or None."""
    return _WHOLE_MATRIX.get(name.lower()) if isinstance(name, str) else None


def known_optimizers() -> list[str]:
    """Every name ``parallelize(optimizer=)`` takes."""
    return sorted(ELEMENTWISE_OPTIMIZERS) + sorted(_WHOLE_MATRIX)


def resolve_optimizer(
    optimizer: str | type[torch.optim.Optimizer],
) -> WholeMatrixSpec | type[torch.optim.Optimizer]:
    """A registered whole-matrix spec, or an elementwise torch optimizer class."""
    spec = whole_matrix_spec(optimizer) if isinstance(optimizer, str) else None
    if spec is not None:
        return spec
    if isinstance(optimizer, str) and optimizer.lower() not in ELEMENTWISE_OPTIMIZERS:
        raise ValueError(
            f"unknown optimizer {optimizer!r}: choose one of {known_optimizers()}, pass a "
            "torch.optim.Optimizer subclass, or register a whole-matrix one with "
            "aligndp.register_whole_matrix(name, spec)"
        )
    return resolve_optimizer_class(optimizer)


register_whole_matrix("muon", MUON)
