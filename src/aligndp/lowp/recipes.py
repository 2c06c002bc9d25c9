"""The registry of wgrad recipes: the one list, and the functions everything else asks.

[Note: wgrad recipes] in :mod:`aligndp.lowp.recipe` says what a recipe holds. Adding one is a
module ``recipe_<name>.py`` defining ``RECIPE = Recipe(...)`` plus its line in
:data:`BUILTIN_RECIPES`; ``parallelize(wgrad=)``, ``aligndp train --wgrad``, ``aligndp layout
--wgrad``, ``get_backend`` and the MX modules all read the registry, so nothing else changes.
Code outside the package (a test, an experiment) may :func:`register_recipe` its own.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Iterator

from aligndp.lowp.recipe import BackendRef, Recipe
from aligndp.plan.spec import Requirement

__all__ = [
    "BUILTIN_RECIPES",
    "register_recipe",
    "unregister_recipe",
    "registered_recipe",
    "get_recipe",
    "recipe_names",
    "find_backend",
    "backend_names",
    "wgrad_requirements",
]

BUILTIN_RECIPES = (
    "aligndp.lowp.recipe_none",
    "aligndp.lowp.recipe_fp8",
    "aligndp.lowp.recipe_mxfp8",
    "aligndp.lowp.recipe_fp8_tensor",
)
"""Modules whose ``RECIPE`` is registered, in this order (the CLI's choices), on the
registry's first use."""

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


@functools.cache
def _registry() -> dict[str, Recipe]:
    """The registry, the built-in recipes registered on first use rather than at import, so
    that a recipe module may import :mod:`aligndp.lowp.backends` (which imports this one) to
    define its backends next to its recipe."""
    for module in BUILTIN_RECIPES:
        _add(importlib.import_module(module).RECIPE)
    return _REGISTRY


def register_recipe(recipe: Recipe) -> Recipe:
    """Make ``recipe`` known by its name; return it. Refuses a name or a backend name that a
    registered recipe already uses."""
    _registry()
    return _add(recipe)


def unregister_recipe(name: str) -> Recipe:
    """Forget the recipe called ``name`` and return it."""
    recipe = get_recipe(name)
    del _registry()[name]
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
    return tuple(_registry())


def get_recipe(name: str) -> Recipe:
    """The registered recipe called ``name``; ``ValueError`` naming the known ones otherwise."""
    try:
        return _registry()[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown wgrad recipe {name!r}: choose one of {', '.join(recipe_names())}"
        ) from None


def backend_names() -> tuple[str, ...]:
    """Names of every registered recipe's backends."""
    return tuple(b.name for r in _registry().values() for b in r.backends)


def find_backend(name: str) -> tuple[Recipe, BackendRef] | None:
    """The recipe that has a backend called ``name``, and that backend; None if none has."""
    for recipe in _registry().values():
        if (backend := recipe.backend(name)) is not None:
            return recipe, backend
    return None


def wgrad_requirements(name: str) -> list[Requirement]:
    """The requirements a wgrad GEMM of recipe ``name`` puts on every param start."""
    return list(get_recipe(name).requirements)
