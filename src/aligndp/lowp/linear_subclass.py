"""Which ``nn.Linear`` subclasses a recipe can convert, and the converted layer's class.

[Note: Linear subclasses]
Models bring their own ``nn.Linear`` subclasses (torchtitan's ``Linear`` adds a config, param
init and ``parallelize`` methods; torch's ``NonDynamicallyQuantizableLinear`` marks
``nn.MultiheadAttention``'s output projection). A converted subclass layer becomes an instance
of ``MX<Name>``, a class made once per subclass with ``MXLinear`` first in its bases and the
subclass after it, holding the layer's own attributes, params, buffers and hooks: the
subclass's methods keep working and ``isinstance(layer, Subclass)`` still holds. Only what
``MXLinear`` itself defines replaces the subclass's version, so a subclass that overrides
any of those names (``forward`` above all: its GEMM would silently become ``F.linear``'s) or
keeps an attribute of the same name is refused with the names; so is a layer whose weight is
parametrized (the fused wgrad writes a leaf param's grad, a parametrization has none) and
``NonDynamicallyQuantizableLinear`` (its parent reads the weight without calling the layer,
so no MX GEMM would run). A refused layer stays as it was; ``conversion_plan`` says why.
"""

from __future__ import annotations

import copy
import functools

import torch.nn as nn
from torch.nn.modules.linear import NonDynamicallyQuantizableLinear
from torch.nn.utils import parametrize

# names every class body has, which replace nothing of the subclass's behaviour
_CLASS_BOOKKEEPING = frozenset(
    {
        "__module__",
        "__qualname__",
        "__doc__",
        "__dict__",
        "__weakref__",
        "__annotations__",
        "__firstlineno__",
        "__static_attributes__",
        "__init__",  # a converted layer is never constructed: it adopts the layer's state
    }
)


def linear_layers(model: nn.Module, converted: type) -> list[tuple[str, nn.Linear]]:
    """``(name, module)`` of every ``nn.Linear`` (subclasses too) of ``model`` that is not
    already ``converted`` (an ``MXLinear``), in registration order."""
    return [
        (n, m)
        for n, m in model.named_modules()
        if isinstance(m, nn.Linear) and not isinstance(m, converted)
    ]


def subclass_why_not(module: nn.Linear, converted: type) -> str:
    """Why ``module`` (an ``nn.Linear`` or subclass) cannot become a ``converted`` layer
    without losing behaviour; "" when it can ([Note: Linear subclasses])."""
    cls = type(module)
    if parametrize.is_parametrized(module):
        return "its weight is parametrized (torch.nn.utils.parametrize)"
    if cls is nn.Linear:
        return ""
    if isinstance(module, NonDynamicallyQuantizableLinear):
        return "NonDynamicallyQuantizableLinear: its parent reads the weight without calling it"
    replaced = set(vars(converted)) - _CLASS_BOOKKEEPING
    own = {
        name
        for klass in cls.__mro__[: cls.__mro__.index(nn.Linear)]
        for name in vars(klass)
        if name in replaced
    }
    own |= set(getattr(converted, "adopted_attrs", ())) & (set(vars(module)) | set(dir(cls)))
    if own:
        return f"{cls.__qualname__} defines {', '.join(sorted(own))}, which MXLinear would replace"
    return ""


@functools.cache
def converted_class(converted: type, cls: type) -> type:
    """The class a converted ``cls`` layer becomes: ``converted`` for ``nn.Linear`` itself,
    else ``MX<cls name>`` with bases ``(converted, cls)`` (one per subclass)."""
    if cls is nn.Linear:
        return converted

    def __reduce_ex__(self, protocol):  # pickled by its bases: the made class has no import path
        return _rebuild, (converted, cls, self.__getstate__())

    body = {"__module__": cls.__module__, "__doc__": f"{cls.__qualname__} run by MXLinear."}
    return type(f"MX{cls.__name__}", (converted, cls), {**body, "__reduce_ex__": __reduce_ex__})


def _rebuild(converted: type, cls: type, state: dict) -> nn.Linear:
    klass = converted_class(converted, cls)
    new = klass.__new__(klass)
    new.__setstate__(state)
    return new


def adopt(module: nn.Linear, klass: type) -> nn.Linear:
    """A new ``klass`` instance holding ``module``'s attributes: its own dicts of params,
    buffers, submodules and hooks (the same tensors), not ``module``'s."""
    new = klass.__new__(klass)
    state = {k: copy.copy(v) if isinstance(v, (dict, set)) else v for k, v in vars(module).items()}
    object.__setattr__(new, "__dict__", state)
    return new
