"""GEMM backends of :class:`aligndp.lowp.MXLinear`, behind one small interface.

[Note: wgrad backends]
Each backend does the three GEMMs of a linear layer on quantised operands, each operand
quantised along that GEMM's contraction dim (tokens for the wgrad), for the
:class:`~aligndp.lowp.recipe.Recipe` it was built with, whose layout requirements its fused
wgrad declares ([Note: wgrad recipes]). Before writing into ``main_grad`` every backend checks
the real view it was given (its pointer, shape, dtype), so a misplanned buffer is a
``ValueError`` that names the offset and the rule, never a kernel fault.

- ``reference`` (any device): quantise, dequantise, matmul in float32, add into main_grad
  (or copy into it, when the view holds nothing yet); the recipe's block, E8M0 scales.
- ``triton`` / ``fp8`` (Hopper, :mod:`aligndp.lowp.triton_backend`): the recipe's quantise
  and block-scaled GEMM kernels, the wgrad accumulating in place (or writing, when the view
  holds nothing yet: [Note: write, not accumulate] in aligndp/plan/fused.py).
Which backend a name means is read from the registered recipes
(:func:`aligndp.lowp.recipes.get_backend`; this module knows no registry, so a recipe module
may define its backend next to its recipe); the GPU backends are imported (with Triton) on
first use only, by module path.
"""

from __future__ import annotations

import abc
import enum

import torch

from aligndp.lowp.mx_format import dequantize_mxfp8, padded_length, quantize_mxfp8
from aligndp.lowp.recipe import Recipe, ScaleFormat
from aligndp.plan.fused import GradTarget
from aligndp.plan.spec import Requirement

__all__ = [
    "WgradBackend",
    "ReferenceBackend",
    "pad_tokens",
    "check_main_grad",
    "put_wgrad",
]

KERNEL_BYTE_ALIGNMENT = 16
"""Byte alignment of every pointer the GPU kernels read or write (vector loads, TMA)."""

_GRAD_DTYPES = (torch.float32, torch.bfloat16)


def pad_tokens(t: torch.Tensor, multiple: int) -> torch.Tensor:
    """Zero-pad dim 0 of a (tokens, features) tensor to a multiple of ``multiple``.

    Zero rows add nothing to a wgrad sum and never raise a block's amax, so padding the
    token dim is exact; it lets any batch size feed a GEMM quantised along tokens.
    """
    rows = t.shape[0]
    target = padded_length(rows, multiple)
    if target == rows:
        return t
    return torch.cat([t, t.new_zeros(target - rows, *t.shape[1:])])


def put_wgrad(target: GradTarget, wgrad: torch.Tensor) -> None:
    """Add ``wgrad`` into ``target.view``, or copy it there when the view holds nothing yet
    ([Note: write, not accumulate] in aligndp/plan/fused.py)."""
    if target.accumulate:
        target.view.add_(wgrad)
    else:
        target.view.copy_(wgrad)


def _where(main_grad: torch.Tensor) -> str:
    """Where ``main_grad`` starts, for an error message only (its storage's address costs a
    storage object per call, paid per wgrad if computed on the passing path)."""
    item, address = main_grad.element_size(), main_grad.data_ptr()
    offset = (address - main_grad.untyped_storage().data_ptr()) // item
    return (
        f"main_grad starts at element {offset} ({offset * item} B) of its storage, "
        f"address {address:#x}"
    )


def check_main_grad(
    main_grad: torch.Tensor,
    requirement: Requirement,
    *,
    shape: tuple[int, ...],
    device: torch.device,
    byte_alignment: int = KERNEL_BYTE_ALIGNMENT,
) -> None:
    """Raise ``ValueError`` unless ``main_grad`` is a view a fused wgrad may write into.

    Checks, from the real pointers: the weight's ``shape``, contiguous, float32/bfloat16,
    same device, and the address a multiple of the requirement's alignment in bytes
    (``start_alignment(itemsize) * itemsize``) and of ``byte_alignment``. The rule is on the
    address, not on the offset from the storage start: aligndp's buffers begin at an aligned
    address inside an over-allocated storage (:func:`aligndp.runtime.buffer.aligned_empty`), so an
    aligned view may sit at any storage offset; the offset is only quoted in the message.
    """
    if not isinstance(main_grad, torch.Tensor):
        raise TypeError(
            f"main_grad must be a tensor view of the grad buffer, got {type(main_grad).__name__}"
        )
    if tuple(main_grad.shape) != tuple(shape):
        raise ValueError(
            f"main_grad has shape {tuple(main_grad.shape)} but the weight has {tuple(shape)}; "
            "bind a view of the weight's shape, e.g. buffer[start:end].view(weight.shape)"
        )
    if main_grad.dtype not in _GRAD_DTYPES:
        raise ValueError(
            f"main_grad dtype {main_grad.dtype} is not supported; use float32 or bfloat16 grad "
            "buffers"
        )
    if main_grad.device != torch.device(device):
        raise ValueError(f"main_grad is on {main_grad.device} but the weight is on {device}")
    if not main_grad.is_contiguous():
        raise ValueError(
            f"main_grad with strides {main_grad.stride()} is not contiguous; bind a contiguous view"
        )
    item = main_grad.element_size()
    address = main_grad.data_ptr()
    align = requirement.start_alignment(item)
    if address % (align * item):
        raise ValueError(
            f"{_where(main_grad)}: address % {align * item} = {address % (align * item)}; "
            f"rule: {requirement.rule} needs {align}-element starts ({align * item} B aligned "
            f"addresses); plan the layout with start_alignment={align} and allocate the buffer "
            "with aligned_empty()"
        )
    if address % byte_alignment:
        raise ValueError(
            f"{_where(main_grad)}: address % {byte_alignment} = {address % byte_alignment}; "
            f"rule: the wgrad kernel needs {byte_alignment}-byte aligned pointers; allocate the "
            "buffer with torch"
        )


class WgradBackend(abc.ABC):
    """One recipe's three GEMMs on 2-D operands; see [Note: wgrad backends].

    Shapes: ``x`` (tokens, in), ``weight`` (out, in), ``grad_out`` (tokens, out).
    """

    name: str = ""
    """What ``get_backend`` calls it (a :class:`~aligndp.lowp.recipe.BackendRef` name)."""
    scale_formats: tuple[ScaleFormat | enum.Enum, ...] = (ScaleFormat.E8M0,)
    """Scale formats it implements; building it for another recipe raises."""

    def __init__(self, recipe: Recipe, *, name: str | None = None):
        if not isinstance(recipe, Recipe):  # this module knows no registry: see recipes.py
            raise TypeError(
                f"{type(self).__name__} is built for a Recipe, got {recipe!r}; use "
                "aligndp.lowp.get_backend(name) or pass aligndp.lowp.get_recipe(name)"
            )
        if recipe.scale_format not in self.scale_formats:
            formats = [getattr(f, "value", f) for f in self.scale_formats]
            raise ValueError(
                f"backend {type(self).__name__} implements {formats} "
                f"scales, but recipe {recipe.name!r} uses {recipe.scale_format}; pick one of "
                f"that recipe's backends: {[b.name for b in recipe.backends]}"
            )
        self.recipe = recipe
        if name is not None:
            self.name = name
        self.caches_weight = type(self).quantize_weight is not WgradBackend.quantize_weight
        """It overrides :meth:`quantize_weight`: a layer keeps what that returns (otherwise
        it skips the cache's per-forward key check, host time on every forward)."""

    @property
    def block(self) -> int:
        """Elements per quantisation block (the recipe's)."""
        return self.recipe.block

    def check_main_grad(self, main_grad: torch.Tensor, *, shape: tuple[int, ...], device) -> None:
        """Raise ``ValueError`` unless ``main_grad`` is a view this backend may write into
        (:func:`check_main_grad`) under every requirement of the recipe."""
        for requirement in self.recipe.requirements or (Requirement(f"{self.recipe.name} wgrad"),):
            check_main_grad(main_grad, requirement, shape=shape, device=device)

    def check(self, main_grad: torch.Tensor, grad_out: torch.Tensor, x: torch.Tensor) -> None:
        """Raise ``ValueError`` unless this backend may accumulate ``grad_out.T @ x`` into
        ``main_grad``."""
        self.check_main_grad(main_grad, shape=(grad_out.shape[1], x.shape[1]), device=x.device)

    @abc.abstractmethod
    def forward(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``x @ weight.T`` (tokens, out) in ``x.dtype``; contraction over in-features."""

    @abc.abstractmethod
    def dgrad(self, grad_out: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``grad_out @ weight`` (tokens, in) in ``grad_out.dtype``; contraction over
        out-features."""

    @abc.abstractmethod
    def wgrad(self, grad_out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``grad_out.T @ x`` (out, in) in float32; contraction over tokens."""

    def wgrad_into(self, grad_out: torch.Tensor, x: torch.Tensor, target: GradTarget) -> None:
        """``target.view += grad_out.T @ x`` (``=`` when not ``target.accumulate``) after
        checking the view. Backends with an in-place kernel override this; the default adds
        (or copies) the float32 wgrad."""
        self.check(target.view, grad_out, x)
        put_wgrad(target, self.wgrad(grad_out, x))

    def quantize_weight(self, weight: torch.Tensor) -> object | None:
        """``weight`` as both of its GEMMs (forward and dgrad) read it, for the weight cache of
        :class:`aligndp.lowp.MXLinear` ([Note: weights once per step] in linear.py), or None:
        this backend reads the weight per call and has nothing worth caching (the default).
        Whatever it returns is handed back as ``weight_q`` to :meth:`forward_for_backward` and
        :meth:`backward_parts`, which then must not quantise the weight again; nothing may
        write into it afterwards (several micro-batches' backwards may hold it)."""
        return None

    def forward_for_backward(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        *,
        weight_q: object | None = None,
    ) -> tuple[torch.Tensor, object]:
        """``(forward(x, weight) + bias, saved)``, ``saved`` being what :meth:`backward` needs of
        this call; ``weight_q``: :meth:`quantize_weight` of ``weight``, when the caller keeps
        one. The default adds the bias in the output's dtype and saves ``x`` itself (a
        tensor: :class:`aligndp.lowp.MXLinear` keeps it with ``save_for_backward``); backends that
        quantise each operand once, for both of its GEMMs, save those operands instead, and
        may add the bias in their GEMM's epilogue."""
        y = self.forward(x, weight)
        return (y if bias is None else y + bias.to(y.dtype)), x

    def backward_parts(
        self,
        saved: object,
        grad_out: torch.Tensor,
        weight: torch.Tensor,
        *,
        need_dgrad: bool,
        need_wgrad: bool,
        weight_q: object | None = None,
    ) -> tuple[torch.Tensor | None, tuple[torch.Tensor, ...] | None]:
        """``(grad_x, parts)`` for one :meth:`forward_for_backward` call: the input gradient
        (None unless ``need_dgrad``) and the tensors :meth:`wgrad_from_parts` makes the weight
        gradient from (None unless ``need_wgrad``). Split so that the wgrad, and the grad sink
        it writes into, can run as one opaque op under ``torch.compile``
        ([Note: compiled MX layers] in ops.py). The default: ``(grad_out, x)``."""
        grad_x = self.dgrad(grad_out, weight) if need_dgrad else None
        return grad_x, ((grad_out, saved.to(grad_out.dtype)) if need_wgrad else None)

    def wgrad_from_parts(
        self,
        parts: tuple[torch.Tensor, ...],
        target: GradTarget | None,
        shape: tuple[int, int],
    ) -> torch.Tensor | None:
        """The weight gradient (``shape``: out, in) from :meth:`backward_parts`' ``parts``: into
        ``target`` as it says, after the checks of :meth:`check` (returns None), or returned in
        float32 when ``target`` is None."""
        grad_out, x = parts
        if target is None:
            return self.wgrad(grad_out, x)
        self.wgrad_into(grad_out, x, target)
        return None

    def backward(
        self,
        saved: object,
        grad_out: torch.Tensor,
        weight: torch.Tensor,
        *,
        need_dgrad: bool,
        need_wgrad: bool,
        target: GradTarget | None,
        weight_q: object | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(grad_x, grad_w)`` for one :meth:`forward_for_backward` call, None where not needed.
        With a ``target`` (a view of the grad buffer) the wgrad goes into it as it says, after
        the checks of :meth:`check`, and ``grad_w`` is None."""
        grad_x, parts = self.backward_parts(
            saved,
            grad_out,
            weight,
            need_dgrad=need_dgrad,
            need_wgrad=need_wgrad,
            weight_q=weight_q,
        )
        grad_w = None
        if parts is not None:
            grad_w = self.wgrad_from_parts(parts, target, tuple(weight.shape))
        return grad_x, grad_w


class ReferenceBackend(WgradBackend):
    """A recipe with E8M0 scales by the book on any device: quantise, dequantise, float32
    matmul. The parity target of the GPU backends; its numerics equal an exact block-scaled
    GEMM up to fp32 rounding."""

    name = "reference"

    def _mx(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """``t`` through the recipe's E4M3 blocks along ``dim`` and back, as float32."""
        return dequantize_mxfp8(quantize_mxfp8(t, dim=dim, block_size=self.block), dim=dim)

    def _weight_for_dgrad(self, weight: torch.Tensor) -> torch.Tensor:
        """The weight through blocks along out-features, dgrad's contraction dim."""
        return self._mx(weight, 0)

    def quantize_weight(self, weight):
        """The weight through its blocks along in-features (forward) and out-features (dgrad),
        dequantised: float32, both layouts."""
        return self._mx(weight, -1), self._weight_for_dgrad(weight)

    def forward(self, x, weight):
        return (self._mx(x, -1) @ self._mx(weight, -1).T).to(x.dtype)

    def dgrad(self, grad_out, weight):
        return (self._mx(grad_out, -1) @ self._weight_for_dgrad(weight)).to(grad_out.dtype)

    def forward_for_backward(self, x, weight, bias=None, *, weight_q=None):
        if weight_q is None:
            return super().forward_for_backward(x, weight, bias)
        y = (self._mx(x, -1) @ weight_q[0].T).to(x.dtype)
        return (y if bias is None else y + bias.to(y.dtype)), x

    def backward_parts(self, saved, grad_out, weight, *, need_dgrad, need_wgrad, weight_q=None):
        if weight_q is None or not need_dgrad:
            return super().backward_parts(
                saved, grad_out, weight, need_dgrad=need_dgrad, need_wgrad=need_wgrad
            )
        grad_x = (self._mx(grad_out, -1) @ weight_q[1]).to(grad_out.dtype)
        return grad_x, ((grad_out, saved.to(grad_out.dtype)) if need_wgrad else None)

    def wgrad(self, grad_out, x):
        block = self.block
        return self._mx(pad_tokens(grad_out, block), 0).T @ self._mx(pad_tokens(x, block), 0)
