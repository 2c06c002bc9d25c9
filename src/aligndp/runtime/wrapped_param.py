"""Who owns a trainable param, and the class the param takes once a DataParallel owns it.

One owner at a time: wrapping a module again makes the new :class:`DataParallel` the owner
and retires the old one (its hooks removed, its forward refused). A plain ``nn.Parameter``
becomes a :class:`WrappedParameter`, whose ``main_grad`` is its owner's buffer view, zeroed on
first touch after ``zero_grad`` ([Note: lazy zeroing] in ddp.py), so Megatron / Transformer
Engine style writes into ``param.main_grad`` count.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator
from typing import NamedTuple, Protocol

import torch
import torch.nn as nn

__all__ = ["ParamOwner", "WrappedParameter", "binding", "claim_params", "owner_of"]


class ParamOwner(Protocol):
    """What a param's owner (:class:`~aligndp.runtime.ddp.DataParallel`) offers it."""

    _replaced: bool
    data_touched: set[nn.Parameter]

    def main_grad_view(self, param: nn.Parameter) -> torch.Tensor: ...

    def remove_hooks(self) -> None: ...


class _Ownership(NamedTuple):
    """Both weakly: a param and its owner may each be garbage-collected."""

    param: weakref.ref
    owner: weakref.ref


_OWNER: dict[int, _Ownership] = {}
"""id(param) -> its ownership. (Tensors cannot be keys of a WeakKeyDictionary: it compares
keys with ==.)"""


def owner_of(param: nn.Parameter) -> ParamOwner | None:
    """The live owner of ``param``, or None."""
    entry = _OWNER.get(id(param))
    if entry is None or entry.param() is not param:
        return None
    return entry.owner()


def claim_params(owner: ParamOwner, params: Iterable[nn.Parameter]) -> set[nn.Parameter]:
    """Make ``owner`` the owner of ``params``, retiring any older owner. Returns the params
    that keep their own ``Parameter`` subclass (their ``main_grad`` stays an attribute, so
    their views are zeroed eagerly instead of on first touch)."""
    me = weakref.ref(owner)
    eager_zero: set[nn.Parameter] = set()
    for p in params:
        old = owner_of(p)
        if old is not None and old is not owner:
            old.remove_hooks()
            old._replaced = True
        _OWNER[id(p)] = _Ownership(weakref.ref(p), me)
        if type(p) is nn.Parameter:  # main_grad becomes a property that zeroes a stale view
            p.__class__ = WrappedParameter
            p.__dict__.pop("main_grad", None)
        elif not isinstance(p, WrappedParameter):
            eager_zero.add(p)
    return eager_zero


class WrappedParameter(nn.Parameter):
    """The class of a trainable ``nn.Parameter`` once a DataParallel owns it."""

    @property
    def main_grad(self) -> torch.Tensor:
        owner = owner_of(self)
        if owner is None or owner._replaced:
            raise AttributeError(
                "main_grad: this param's DataParallel is gone; wrap the module again"
            )
        return owner.main_grad_view(self)

    @main_grad.setter
    def main_grad(self, value: torch.Tensor) -> None:
        """Ignored: the owning DataParallel's view is authoritative (a new wrap's FlatBuffer
        binds its views before it takes the params over from the old wrapper)."""

    @property
    def data(self) -> torch.Tensor:
        """``param.data``, noted: a write through it bypasses torch's version counter, so the
        owner compares this param with its fp32 master before the next step."""
        owner = owner_of(self)
        if owner is not None:
            owner.data_touched.add(self)
        return _TENSOR_DATA.__get__(self)

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        """``param.data = t`` after wrapping copies ``t`` into the param's storage, which the
        buffers own (a new storage would cut the param off from them)."""
        if _BINDING:
            _TENSOR_DATA.__set__(self, value)
            return
        current = _TENSOR_DATA.__get__(self)
        if (
            value.shape != current.shape
            or value.dtype != current.dtype
            or value.device != current.device
        ):
            raise ValueError(
                f"param.data = a {tuple(value.shape)} {value.dtype} tensor on {value.device} "
                f"after wrapping: the param is {tuple(current.shape)} {current.dtype} on "
                f"{current.device} inside aligndp's flat buffers; move or cast the module "
                "before aligndp.parallelize, or copy values in with p.copy_()"
            )
        current.copy_(value)
        self.data  # noqa: B018 -- marks the write for the owner


_TENSOR_DATA = torch.Tensor.data
_BINDING = False
"""True while a DataParallel binds params into its buffers (``p.data = view`` goes through)."""


@contextlib.contextmanager
def binding() -> Iterator[None]:
    """While inside, ``param.data = view`` rebinds a wrapped param's storage."""
    global _BINDING
    _BINDING = True
    try:
        yield
    finally:
        _BINDING = False
