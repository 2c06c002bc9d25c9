"""The registry of wgrad recipes: the one list, and the functions everything else asks.

[Note: wgrad recipes] in :mod:`aligndp.lowp.recipe` says what a recipe holds. Adding one is a
module ``recipe_<name>.py`` defining ``RECIPE = Recipe(...)`` plus its line in
:data:`BUILTIN_RECIPES`; ``parallelize(wgrad=)``, ``aligndp train --wgrad``, ``aligndp layout
--wgrad``, :func:`get_backend` and the MX modules all read the registry, so nothing else
changes. Code outside the package (a test, an experiment) may :func:`register_recipe` its own.

Imports point one way: this module imports the recipe modules, a recipe module may import
:mod:`aligndp.lowp.backends` to define its backend, and ``backends`` imports no registry (a
backend is built for a :class:`Recipe` object; names are resolved here).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from aligndp.lowp.backends import WgradBackend
from aligndp.lowp.recipe import BackendRef, Recipe
from aligndp.lowp.recipe_bf16 import RECIPE as BF16
from aligndp.lowp.recipe_fp8 import RECIPE as FP8
from aligndp.lowp.recipe_fp8_tensor import RECIPE as FP8_TENSOR
from aligndp.lowp.recipe_mxfp8 import RECIPE as MXFP8
from aligndp.lowp.recipe_none import RECIPE as NONE
from aligndp.plan.spec import Requirement

__all__ = [
    "BUILTIN_RECIPES",
    "register_recipe",
    "unregister_recipe",
    "registered_recipe",
    "get_recipe",
    "recipe_names",
    "find_backend",
    "get_backend",
    "backend_names",
    "wgrad_requirements",
]

BUILTIN_RECIPES = (NONE, FP8, MXFP8, FP8_TENSOR, BF16)
"""The recipes registered at import, in this order (the CLI's choices)."""

_REGISTRY: dict[str, Recipe] = {}


def _add(recipe: Recipe) -> Recipe:
    if not isinstance(recipe, Recipe):
        raise TypeError(f"register_recipe takes a Recipe, got {type(recipe).__name__}")
    if recipe.name in _REGISTRY:
        raise ValueError(
            f"a wgrad recipe named {recipe.name!r} is already registered; pick another name "
            "or unregister_recipe() the old one first"
        )
    taken = {b.name for r in _REGISTRY.values() for b in r.backends}
    clash = taken & {b.name for b in recipe.backends}
    if clash:
        raise ValueError(
            f"recipe {recipe.name!r}: backend name(s) {', '.join(sorted(clash))} are taken by "
            "registered recipes; backend names are global, rename yours"
        )
    _REGISTRY[recipe.name] = recipe
    return recipe


for _builtin in BUILTIN_RECIPES:
    _add(_builtin)


def register_recipe(recipe: Recipe) -> Recipe:
    """Make ``recipe`` known by its name; return it. Refuses a name or a backend name that a
    registered recipe already uses."""
    return _add(recipe)


def unregister_recipe(name: str) -> Recipe:
    """Forget the recipe called ``name`` and return it."""
    recipe = get_recipe(name)
    del _REGISTRY[name]
    return recipe


@contextlib.contextmanager
def registered_recipe(recipe: Recipe) -> Iterator[Recipe]:
    """``recipe`` registered inside the ``with`` block only."""
    register_recipe(recipe)
    try:
        yield recipe
    finally:
        unregister_recipe(recipe.name)


def recipe_names() -> tuple[str, ...]:
    """Names of the registered recipes, in registration order."""
    return tuple(_REGISTRY)


def get_recipe(name: str) -> Recipe:
    """The registered recipe called ``name``; ``ValueError`` naming the known ones otherwise."""
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown wgrad recipe {name!r}: choose one of {', '.join(recipe_names())}"
        ) from None


def backend_names() -> tuple[str, ...]:
    """Names of every registered recipe's backends."""
    return tuple(b.name for r in _REGISTRY.values() for b in r.backends)


def find_backend(name: str) -> tuple[Recipe, BackendRef] | None:
    """The recipe that has a backend called ``name``, and that backend; None if none has."""
    for recipe in _REGISTRY.values():
        if (backend := recipe.backend(name)) is not None:
            return recipe, backend
    return None


def wgrad_requirements(name: str) -> list[Requirement]:
    """The requirements a wgrad GEMM of recipe ``name`` puts on every param start."""
    return list(get_recipe(name).requirements)


def get_backend(backend: str | WgradBackend) -> WgradBackend:
    """A backend instance by name (one of :func:`backend_names`, e.g. ``reference``,
    ``triton``, ``fp8``), built for the recipe that declares it; or ``backend`` itself."""
    if isinstance(backend, WgradBackend):
        return backend
    found = find_backend(backend)
    if found is None:
        raise ValueError(
            f"unknown MX backend {backend!r}: choose one of {', '.join(backend_names())} or "
            "pass a WgradBackend"
        )
    recipe, ref = found
    if ref.needs_cuda and not torch.cuda.is_available():
        on_cpu = [b.name for b in recipe.backends if not b.needs_cuda] or [
            n for n in backend_names() if not find_backend(n)[1].needs_cuda
        ]
        raise ValueError(
            f"backend {backend!r} runs {recipe.name} kernels on a CUDA GPU (Hopper), and none "
            f"is available; use backend={on_cpu[0]!r} on CPU"
        )
    return ref.load(recipe)
