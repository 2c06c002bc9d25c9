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

__all__ = [
    "ParamOwner",
    "WrappedParameter",
    "as_parameters",
    "attach_to_module",
    "binding",
    "claim_params",
    "owner_of",
    "steps_in_place",
]


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


def attach_to_module(owner, hooks: list, sink, gather, layers: list[nn.Module]) -> None:
    """Bind ``owner`` (a DataParallel) to the user's module so that dropping ``owner`` frees
    it ([Note: dropped wrappers]): a state-dict pre-hook that waits for ``gather``'s param
    gathers (its handle appended to ``hooks``), ``sink`` bound to the fused-wgrad ``layers``
    as a ``weakref.proxy``, and a finaliser that detaches everything when ``owner`` is
    collected.

    [Note: dropped wrappers]
    Dropping a wrapped model frees it, as dropping torch DDP does. A param's post-accumulate
    hook lives in a table torch keeps from C++, out of sight of Python's cycle collector, so a
    hook that reached its param back (through its bucket group or buffer) kept both alive for
    ever: the hooks reach the reducer weakly and find view and group through it
    (reducer.py). A fused layer's sink is a proxy: the reducer reaches the optimizer, which
    reaches the wrapper, so a strong sink kept the wrapper alive as long as the module. The
    module's own hooks (state dict, gather pre-hooks) may hold the gather and its groups,
    which reach neither the params nor the wrapper. A user who keeps the module but drops
    wrapper and optimizer gets the module back detached once the wrapper is collected:
    gathers still in flight waited for (the finaliser holds the gather), hooks removed, sinks
    unbound, and params no newer wrapper owns given their ``nn.Parameter`` class back, so it
    trains on in plain torch.
    """
    hooks.append(owner.module.register_state_dict_pre_hook(_WaitAll(gather)))
    proxy = weakref.proxy(sink)
    for m in layers:
        m.bind_grad_sink(proxy)
    release = weakref.finalize(
        owner,
        _release,
        gather.release,
        [weakref.ref(p) for p in owner.params],
        [hooks, gather.hooks],
        [weakref.ref(m) for m in layers],
        proxy,
    )
    release.atexit = False  # at exit there is nothing to hand back, maybe no group to wait on


class _WaitAll:
    """A state-dict pre-hook that waits for the param gathers; a module-level class, so that
    ``torch.save(model)`` can pickle the module's hooks."""

    def __init__(self, gather) -> None:
        self.gather = gather

    def __call__(self, *_) -> None:
        if self.gather is not None:
            self.gather.wait_all()

    def __reduce__(self):  # a loaded module's hook waits for nothing: its gather is gone
        return _WaitAll, (None,)


def _release(release, params: list, handle_lists: list, layers: list, sink: object) -> None:
    release()  # gathers still in flight land first: pending params get their class back
    for handles in handle_lists:
        for h in handles:
            h.remove()
    for ref in layers:
        m = ref()
        if m is not None and m.__dict__.get("_grad_sink") is sink:
            m.bind_grad_sink(None)
    for ref in params:
        p = ref()
        if p is not None and type(p) is WrappedParameter and owner_of(p) is None:
            p.__class__ = nn.Parameter


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
        # a write into the param's values, announced as an in-place op on the param would be:
        # the owner's masters and the quantised-weight caches compare versions
        torch.autograd.graph.increment_version(self)


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


def steps_in_place(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` is one of torch's own (``torch.optim``): those write a param's
    values in place and never rebind ``param.data``, so they may step the params as plain
    ``nn.Parameter`` (:func:`as_parameters`)."""
    return type(optimizer).__module__.split(".")[:2] == ["torch", "optim"]


@contextlib.contextmanager
def as_parameters(params: Iterable[nn.Parameter]) -> Iterator[None]:
    """While inside, the :class:`WrappedParameter` among ``params`` are plain ``nn.Parameter``.

    [Note: plain class while stepping]
    torch's C++ takes its fast path for ``Tensor`` and ``nn.Parameter`` alone: on any other
    class every op, every ``.grad`` read and every hash first asks the class for
    ``__torch_function__``. A fused AdamW step over the 148 params of gpt2-small reads each
    param a few times (``_init_group``, the grouping by device and dtype, the fused kernel's
    argument lists): on one H200 it cost measurably more host time per step over
    ``WrappedParameter``s than over plain params, in a step that is host-bound under
    ``torch.compile`` (docs/performance.md). So a replicated part steps its params as plain
    ``nn.Parameter``: two cheap class assignments per param instead of the subclass's toll
    on every read. Only torch's own optimizers do
    (:func:`steps_in_place`): one that rebinds ``param.data = new`` would, without the
    class's setter, give the param new storage without moving its version, which the
    quantised-weight caches key on ([Note: weights once per step] in aligndp/lowp/linear.py).
    Under ``torch.compile`` (Dynamo cannot trace a class assignment) the params keep their
    class. An inner-optimizer hook reads no
    ``main_grad`` while inside (the property is the class's); the composite's own hooks run
    outside.
    """
    if torch.compiler.is_compiling():
        yield
        return
    wrapped = [p for p in params if type(p) is WrappedParameter]
    for p in wrapped:
        p.__class__ = nn.Parameter
    try:
        yield
    finally:
        for p in wrapped:
            p.__class__ = WrappedParameter
