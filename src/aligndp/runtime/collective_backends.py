"""Collective backends by name: ``DDPConfig(collectives=name)`` picks one.

[Note: collectives seam] in collectives.py says what a backend is. The built-in backends are
registered at the bottom of this module, one line each; a program (or a test) registers its
own with :func:`register_collectives` before it wraps a model. A factory takes the
data-parallel process group and returns the backend bound to it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist

from aligndp.runtime.collectives import Collectives, TorchCollectives

__all__ = [
    "DEFAULT_COLLECTIVES",
    "CollectivesFactory",
    "check_collectives_name",
    "make_collectives",
    "register_collectives",
    "registered_collectives",
]

CollectivesFactory = Callable[[dist.ProcessGroup | None], Collectives]
"""``factory(group) -> backend`` bound to ``group``."""

DEFAULT_COLLECTIVES = "torch"

_FACTORIES: dict[str, CollectivesFactory] = {}


def register_collectives(name: str, factory: CollectivesFactory) -> None:
    """Make ``factory`` available as ``DDPConfig(collectives=name)`` in this process (register
    it on every rank). Registering the same factory again is a no-op."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"a collectives backend needs a non-empty string name, got {name!r}")
    if not callable(factory):
        raise TypeError(
            f"register_collectives({name!r}, ...) needs a factory (group) -> backend, "
            f"got {type(factory).__name__}"
        )
    if _FACTORIES.get(name, factory) is not factory:
        raise ValueError(
            f"collectives backend {name!r} is already registered (with {_FACTORIES[name]!r}); "
            "register yours under another name"
        )
    _FACTORIES[name] = factory


def registered_collectives() -> tuple[str, ...]:
    """Names of the registered backends, sorted."""
    return tuple(sorted(_FACTORIES))


def check_collectives_name(name: str) -> None:
    """Raise ``ValueError`` naming the registered backends unless ``name`` is one."""
    if not isinstance(name, str):
        raise TypeError(
            f"collectives must be the name of a registered backend, got {type(name).__name__}: "
            "register the backend's factory with register_collectives(name, factory), then "
            "pass its name"
        )
    if name not in _FACTORIES:
        raise ValueError(
            f"unknown collectives backend {name!r}: registered are "
            f"{', '.join(repr(n) for n in registered_collectives())}; register another with "
            "aligndp.register_collectives(name, factory) on every rank before wrapping"
        )


def make_collectives(name: str, *, group: dist.ProcessGroup | None) -> Collectives:
    """The backend registered as ``name``, bound to ``group``."""
    check_collectives_name(name)
    backend = _FACTORIES[name](group)
    if backend.name != name:
        raise ValueError(
            f"the factory registered as collectives backend {name!r} made a backend named "
            f"{backend.name!r}: set its name attribute to {name!r}"
        )
    return backend


# ---- built-in backends: one line each ----
register_collectives(DEFAULT_COLLECTIVES, TorchCollectives)
