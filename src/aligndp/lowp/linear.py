"""``MXLinear``: a drop-in ``nn.Linear`` whose GEMMs run on quantised operands, and a converter.

The backend decides the recipe ([Note: wgrad recipes]): MXFP8 by default, or any registered
recipe's backend (``backend="fp8"``, ...). The recipe's ``layer_dim_multiple`` decides which
layers can be converted, its requirements what the fused wgrad needs of ``main_grad``.

The weight gradient can be fused into the data-parallel grad buffer: see [Note: fused wgrad]
in :mod:`aligndp.plan.fused`. With a sink bound and a view available, backward accumulates
``grad_out.T @ x`` straight into ``sink.grad_target(weight)`` (float32 or bfloat16, whatever
the weight's dtype; written rather than added when the view holds nothing yet), returns no
weight gradient (so no ``param.grad`` is allocated) and calls
``sink.mark_ready(weight)``. The bias gradient always flows through plain autograd.

[Note: weights once per step]
The weight changes once per optimizer step, but a step of ``k`` micro-batches (``no_sync`` or
plain gradient accumulation) runs ``k`` forwards. So an eager layer keeps its weight as the
backend quantised it (:meth:`~aligndp.lowp.backends.WgradBackend.quantize_weight`: payload and
scales, every layout its forward and dgrad read) and quantises again only when the weight may
have changed. The cache is keyed on what can tell: the weight object and its storage (weakly:
``param.data = t`` and ``layer.weight = p`` give a new storage, and a freed storage can never
match again even if its address is reused), its storage offset, shape, strides and dtype, its
version counter (bumped by every in-place write through the param or a view of it: a
foreach or for-loop optimizer step, ``with torch.no_grad(): w.add_(...)``,
``load_state_dict``), the count of ``torch.optim`` optimizer steps taken in this process (a
global step pre-hook: torch's *fused* optimizers write the params without bumping their
version counters, so without it a fused AdamW step would leave the layer computing with the
weight of the step before — any optimizer's step drops every cache, which costs one quantise
at most), and the grad
sink's :meth:`~aligndp.plan.fused.GradSink.param_writes` (the DataParallel's all-gathers, which
write the params' storage without bumping their counters; ``param.data = t`` after wrapping is
a copy that bumps it). A write through ``param.data`` (``w.data.add_(...)``) is invisible to
the version counter, as it is to autograd's saved-tensor check: call
:meth:`MXLinear.drop_quantised_weight` after one, or build the layer with
``cache_weight=False``. Cached tensors are never written again (a change makes new ones), so
the backwards of earlier micro-batches that still hold them read what their forward read.
The price is memory: the quantised weight stays allocated from one step to the next (for
``fp8-tensor`` 2 bytes per element, both layouts) instead of from forward to backward only;
the stale one is dropped before its successor is made, so no step holds two.
Under ``torch.compile`` there is no cache: the quantise is in the graph, where Inductor fuses
it with its neighbours, and a cached tensor handed in through an opaque op would be an
Inductor buffer it may reuse in place; one quantise per forward is the compiled cost.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from aligndp.lowp.backends import WgradBackend
from aligndp.lowp.layer_rule import capability_of, slow_reason
from aligndp.lowp.linear_subclass import adopt, converted_class, linear_layers, subclass_why_not
from aligndp.lowp.ops import compiling, fused_wgrad, register_layer
from aligndp.lowp.recipe import Recipe
from aligndp.lowp.recipes import get_backend, get_recipe
from aligndp.plan.fused import GradSink
from aligndp.plan.spec import Requirement

__all__ = ["MXLinear", "convert_to_mxfp8", "conversion_plan"]


class _MXLinearFunction(torch.autograd.Function):
    """``x @ weight.T`` with quantised GEMMs; the weight grad optionally fused into main_grad."""

    @staticmethod
    def forward(
        ctx,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        backend: WgradBackend,
        sink: GradSink | None,
        weight_q: object | None,
    ):
        x2d = x.reshape(-1, x.shape[-1])  # (tokens, in)
        with torch.autocast(x.device.type, enabled=False):  # the backends pick their own precisions
            y, saved = backend.forward_for_backward(x2d, weight, bias, weight_q=weight_q)
        # the weight goes through save_for_backward for autograd's in-place-modification check;
        # a backend's quantised operands (not inputs or outputs of this node) ride on ctx
        if isinstance(saved, torch.Tensor):
            ctx.save_for_backward(weight, saved)
            ctx.saved_operands = None
        else:
            ctx.save_for_backward(weight)
            ctx.saved_operands = saved
        ctx.backend, ctx.sink, ctx.weight_q = backend, sink, weight_q
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        weight, *saved = ctx.saved_tensors
        saved = saved[0] if saved else ctx.saved_operands
        if saved is None:
            raise RuntimeError(
                "MXLinear's quantised operands were freed by the first backward through this "
                "graph; backward(retain_graph=True) twice is not supported by the GPU backends"
            )
        # free the operands now, not when the graph is collected (the loss may outlive backward)
        ctx.saved_operands = None
        backend, sink, weight_q = ctx.backend, ctx.sink, ctx.weight_q
        ctx.weight_q = None
        dy = grad_out.reshape(-1, grad_out.shape[-1]).contiguous()  # (tokens, out)
        need_dgrad, need_wgrad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_x, parts = backend.backward_parts(
            saved, dy, weight, need_dgrad=need_dgrad, need_wgrad=need_wgrad, weight_q=weight_q
        )
        if grad_x is not None:
            grad_x = grad_x.reshape(*grad_out.shape[:-1], weight.shape[1])
        grad_w = None
        if parts is not None:
            if sink is not None:  # into main_grad; a wgrad back only if the sink has no view
                grad_w = fused_wgrad(backend, sink, weight, parts)
            else:
                grad_w = backend.wgrad_from_parts(parts, None, tuple(weight.shape))
        if grad_w is not None:
            grad_w = grad_w.to(weight.dtype)
        grad_b = dy.sum(0, dtype=torch.float32) if ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b, None, None, None


class _CachedWeight(NamedTuple):
    """One layer's quantised weight and what it was quantised from
    ([Note: weights once per step])."""

    weight: weakref.ref
    storage: weakref.ref
    key: tuple
    quantised: object


_optimizer_steps = [0]
"""``torch.optim`` optimizer steps since the first cached quantise (see
[Note: weights once per step]): counted by a global step pre-hook, registered once (before
the step, so weights an FP8 param gather sets during the step carry the new count)."""
_step_hook = None


def _count_optimizer_step(optimizer, args, kwargs) -> None:
    _optimizer_steps[0] += 1


def optimizer_steps() -> int:
    """The process's ``torch.optim`` step count (the hook is registered on first call)."""
    global _step_hook
    if _step_hook is None:
        _step_hook = register_optimizer_step_pre_hook(_count_optimizer_step)
    return _optimizer_steps[0]


def _weight_key(weight: torch.Tensor, sink: GradSink | None) -> tuple:
    writes = getattr(sink, "param_writes", None)
    return (
        optimizer_steps(),
        weight._version,
        weight.storage_offset(),
        tuple(weight.shape),
        weight.stride(),
        weight.dtype,
        writes() if writes is not None else 0,
    )


class MXLinear(nn.Linear):
    """``nn.Linear`` with quantised forward, dgrad and wgrad GEMMs (MXFP8 unless ``backend``
    runs another recipe); same params and state_dict keys.

    ``in_features`` and ``out_features`` must be multiples of the recipe's
    ``layer_dim_multiple`` (32 for MXFP8, the MX block), since each is the contraction dim of
    one GEMM. Implements :class:`aligndp.plan.fused.FusedWgradModule`. ``cache_weight``: keep
    the quantised weight until the weight changes ([Note: weights once per step]).
    """

    adopted_attrs = ("backend", "cache_weight", "_grad_sink", "_cached")
    """Instance attributes an MXLinear sets on a layer it adopts ([Note: Linear subclasses])."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        backend: str | WgradBackend = "reference",
        cache_weight: bool = True,
        device=None,
        dtype=None,
    ):
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self._set_backend(backend, cache_weight)

    def _set_backend(self, backend: str | WgradBackend, cache_weight: bool) -> None:
        backend = get_backend(backend)
        multiple = backend.recipe.layer_dim_multiple
        for name, size in (("in_features", self.in_features), ("out_features", self.out_features)):
            if size % multiple:
                raise ValueError(
                    f"MXLinear needs {name} to be a multiple of {multiple} (the "
                    f"{backend.recipe.name} block, along which its GEMM contracts), got {size}; "
                    "keep this layer an nn.Linear or pad it"
                )
        self.backend = backend
        self._grad_sink: GradSink | None = None
        self.cache_weight = cache_weight
        """Keep the quantised weight until the weight changes ([Note: weights once per step])."""
        self._cached: _CachedWeight | None = None

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        *,
        backend: str | WgradBackend = "reference",
        cache_weight: bool = True,
    ) -> MXLinear:
        """An MXLinear sharing ``linear``'s parameter objects (optimizers built on them keep
        working). A subclass of ``nn.Linear`` keeps its class and state under ``MXLinear``
        ([Note: Linear subclasses]), or is refused with what it would lose."""
        if type(linear) is not nn.Linear:
            if why := subclass_why_not(linear, cls):
                raise ValueError(f"cannot convert this {type(linear).__qualname__}: {why}")
            new = adopt(linear, converted_class(cls, type(linear)))
            new._set_backend(backend, cache_weight)
            return new
        new = cls(
            linear.in_features,
            linear.out_features,
            linear.bias is not None,
            backend=backend,
            cache_weight=cache_weight,
            device="meta",
        )
        new.weight = linear.weight
        new.bias = linear.bias
        new.train(linear.training)
        return new

    def wgrad_requirements(self) -> list[Requirement]:
        return list(self.backend.recipe.requirements)

    def bind_grad_sink(self, sink: GradSink | None) -> None:
        # not through nn.Module.__setattr__: a sink that is a Module (the DataParallel was one)
        # would become a child of this layer, a cycle (state_dict() of the model recursed)
        self.__dict__["_grad_sink"] = sink
        if sink is not None:  # findable in a compiled backward ([Note: compiled MX layers])
            register_layer(self)

    # ---- [Note: weights once per step] ----
    def quantised_weight(self) -> object | None:
        """The backend's quantised form of the weight's current values
        (:meth:`~aligndp.lowp.backends.WgradBackend.quantize_weight`), from the cache when the
        weight has not changed since it was made; None where the backend caches nothing."""
        weight, cached = self.weight, self._cached
        key = _weight_key(weight, self._grad_sink)
        if (
            cached is not None
            and cached.key == key
            and cached.weight() is weight
            and cached.storage() is weight.untyped_storage()
        ):
            return cached.quantised
        self._cached = None  # the stale bytes go before the new ones are made
        with torch.no_grad(), torch.autocast(weight.device.type, enabled=False):
            quantised = self.backend.quantize_weight(weight)
        self.set_quantised_weight(quantised)
        return quantised

    def set_quantised_weight(self, quantised: object) -> None:
        """Hand the layer the weight's current values already quantised, in the form
        :meth:`~aligndp.lowp.backends.WgradBackend.quantize_weight` of its backend returns
        (e.g. FP8 bytes and scales that an all-gather delivered): forwards use it until the
        weight changes. Call it after the weight's values (and their version) are final; the
        tensors must not be written while the weight keeps them (an FP8 param gather rewrites
        its storage at the next gather, after the weight has changed)."""
        weight = self.weight
        key = _weight_key(weight, self._grad_sink)
        storage = weakref.ref(weight.untyped_storage())
        self._cached = _CachedWeight(weakref.ref(weight), storage, key, quantised)

    def __getstate__(self) -> dict:
        """Pickled and deep-copied without the cache (weak references do not pickle; a copy's
        weight is another tensor anyway)."""
        return {**self.__dict__, "_cached": None}

    def drop_quantised_weight(self) -> None:
        """Forget the cached quantised weight (after a write through ``weight.data``, which
        torch's version counter does not see)."""
        self._cached = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_autocast_enabled(x.device.type):
            # as nn.Linear under autocast: input, output and bias add in the autocast dtype
            # (the weight is quantised from its own dtype, so it needs no cast)
            x = x.to(torch.get_autocast_dtype(x.device.type))
        weight_q = None
        if self.cache_weight and self.backend.caches_weight and not compiling():
            weight_q = self.quantised_weight()
        return _MXLinearFunction.apply(
            x, self.weight, self.bias, self.backend, self._grad_sink, weight_q
        )

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, backend={self.backend.name}"


def _shared_weight_linears(model: nn.Module) -> frozenset:
    """Names of Linear modules whose weight is also a param of another module."""
    owners: dict[int, list[str]] = {}
    for mod_name, mod in model.named_modules():
        for p in mod.parameters(recurse=False):
            owners.setdefault(id(p), []).append(mod_name)
    return frozenset(n for names in owners.values() if len(names) > 1 for n in names)


def conversion_plan(
    model: nn.Module,
    recipe: str | Recipe,
    *,
    layers: str = "pays",
    capability: tuple[int, int] | None | str = "auto",
) -> list[tuple[str, str]]:
    """``(name, why_not)`` for every ``nn.Linear`` of ``model`` (subclasses too, not those
    already converted), in registration order: ``why_not`` is "" for a layer ``recipe`` (a
    name or a Recipe) converts (:meth:`~aligndp.lowp.recipe.Recipe.why_not`; a subclass that
    would lose behaviour says what, [Note: Linear subclasses]). ``capability``: the CUDA
    compute capability the rule is judged for (None: a CPU); ``"auto"`` reads it from the
    model's first param."""
    if not isinstance(recipe, Recipe):
        recipe = get_recipe(recipe)
    if capability == "auto":
        first = next(model.parameters(), None)
        capability = capability_of(first.device) if first is not None else None
    linears = linear_layers(model, MXLinear)
    last, shared = (linears[-1][0] if linears else ""), _shared_weight_linears(model)
    plan = [
        (
            n,
            subclass_why_not(m, MXLinear)
            or recipe.why_not(
                n, m, last_linear=last, shared=shared, layers=layers, capability=capability
            ),
        )
        for n, m in linears
    ]
    if recipe.gain is not None and layers == "pays" and not recipe.gain.fast_on(capability):
        if any(recipe.converts(n, m, last_linear=last, shared=shared) for n, m in linears):
            slow_reason(recipe.name, recipe.gain, capability)  # one warning per recipe and device
    return plan


def convert_to_mxfp8(
    model: nn.Module,
    *,
    filter: Callable[[str, nn.Linear], bool] | None = None,
    backend: str | WgradBackend = "reference",
    layers: str = "pays",
    cache_weight: bool = True,
) -> nn.Module:
    """Swap ``nn.Linear`` modules of ``model`` (in place) for :class:`MXLinear`; return ``model``.
    Subclasses of ``nn.Linear`` convert too, keeping their class and methods
    ([Note: Linear subclasses]); one that would lose behaviour is kept (a ``filter`` that
    picks it raises).

    ``backend`` (a name or instance) picks the recipe, MXFP8 by default. Which layers:
    ``layers="pays"`` (default) those whose GEMMs gain from FP8 on the model's device
    ([Note: layers that pay] in layer_rule.py: none on a device without the format's fast
    path, with one warning); ``layers="all"`` every layer the recipe can run
    (:meth:`~aligndp.lowp.recipe.Recipe.converts`); ``filter(name, module) -> bool`` replaces
    both (``name`` as in ``named_modules``). Parameters are reused, so state_dict keys and
    optimizers are unchanged; model code is not touched. ``cache_weight``: each layer keeps its
    quantised weight until the weight changes ([Note: weights once per step]).
    """
    backend = get_backend(backend)
    if filter is None:
        chosen = {n for n, why in conversion_plan(model, backend.recipe, layers=layers) if not why}
        filter = lambda n, m: n in chosen  # noqa: E731
    for name, module in linear_layers(model, MXLinear):
        if not filter(name, module):
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        new = MXLinear.from_linear(module, backend=backend, cache_weight=cache_weight)
        setattr(parent, child, new)
    return model
