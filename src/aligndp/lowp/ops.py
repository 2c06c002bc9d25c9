"""The recipes' kernels and the fused wgrad as torch custom ops, so ``torch.compile`` traces
:class:`aligndp.lowp.MXLinear` without a graph break.

[Note: compiled MX layers]
Dynamo traces ``MXLinear``'s autograd.Function, forward and backward, through the backend's
Python. What it cannot trace is a Triton launch (the Hopper backends' quantise and GEMMs) and
the grad sink: ``grad_target`` decides at run time whether the view is written or added to
([Note: write, not accumulate] in aligndp/plan/fused.py), and ``mark_ready`` may launch a
bucket's collective. So, only while compiling (``torch.compiler.is_compiling()``; eager calls
the same Python directly, without the host time of a custom op's dispatch):

- ``aligndp::scaled_mm`` wraps the Triton GEMMs, ``aligndp::quantize_rc`` the one-pass Triton
  block quantise (1x128 and MXFP8) of every operand; their fake impls give Inductor shapes and
  dtypes ([Note: operand layout] in triton_common.py). Inductor fused block quantises more
  slowly than the kernel (it cannot fold a 1x128 block reduction into the producer's row
  reduction), and the kernel needs the read-back barrier that the Hopper backends install
  ([Note: read-back barrier] in readback_barrier.py); without it they quantise what the graph
  computes with :mod:`aligndp.lowp.fp8_blocks` instead.
- the ``fp8-tensor`` quantise is plain torch ops (amax, divide, clamp, cast, transpose), which
  Inductor fuses with the operand's producer: no quantise kernel and no Python launch of its
  own. Its GEMM is ``torch._scaled_mm``, an aten op.
- ``aligndp::fused_wgrad(parts, weight)`` is the whole sink transaction as one opaque op: it
  finds the layer whose bound weight lives at ``weight``'s address, asks the layer's sink for
  the target, has the backend write or add the wgrad from ``parts`` (the backward's quantised
  wgrad operands) into the view, and calls ``mark_ready``. The view is not an argument: which
  view, and whether it holds anything yet, is the sink's state at run time, not a graph input.
  The op returns nothing, so it is registered as side-effectful (``has_side_effect``);
  otherwise dead-code elimination drops it from the compiled backward and the gradient never
  arrives (torch 2.13 drops it without). It also declares that it mutates an empty token
  tensor, since older Inductor schedulers keep an output-less fallback kernel only when its
  schema mutates something. The weight's autograd gradient is None, as in eager.

Layers are found by their weight's address rather than by a per-layer constant, so identical
blocks compiled one by one (``block.compile()``) share one graph instead of recompiling per
layer; the address table is rebuilt whenever a lookup misses or finds a weight that moved.
"""

from __future__ import annotations

import importlib
import sys
import weakref
from collections.abc import Sequence

import torch
from torch.fx.node import has_side_effect

from aligndp.lowp.recipe import ScaleFormat
from aligndp.plan.fused import GradTarget

__all__ = ["compiling", "register_layer", "fused_wgrad", "quantize_rc", "scaled_mm"]

_BOUND: weakref.WeakSet = weakref.WeakSet()
"""Layers with a grad sink bound (objects with ``weight``, ``backend`` and ``_grad_sink``)."""
_BY_ADDRESS: dict[int, weakref.ref] = {}


def compiling() -> bool:
    """Whether Dynamo is tracing: the recipes then call their custom ops."""
    return torch.compiler.is_compiling()


def register_layer(layer: object) -> None:
    """Make ``layer`` findable by its weight's address in the compiled backward."""
    _BOUND.add(layer)
    _BY_ADDRESS.clear()


def _layer_at(weight: torch.Tensor):
    """The bound layer whose weight starts at ``weight``'s address, or None."""
    address = weight.data_ptr()
    ref = _BY_ADDRESS.get(address)
    layer = ref() if ref is not None else None
    if layer is None or layer._grad_sink is None or layer.weight.data_ptr() != address:
        _BY_ADDRESS.clear()
        for bound in _BOUND:
            if bound._grad_sink is not None:
                _BY_ADDRESS[bound.weight.data_ptr()] = weakref.ref(bound)
        ref = _BY_ADDRESS.get(address)
        layer = ref() if ref is not None else None
    return layer


def write_wgrad(backend, sink, weight: torch.Tensor, parts: Sequence[torch.Tensor]):
    """The sink transaction of one wgrad: the target, the backend's write or add into it, then
    ``mark_ready``. Returns the float32 wgrad instead when the sink has no view for ``weight``
    (plain autograd then takes it)."""
    target: GradTarget | None = sink.grad_target(weight)
    if target is None:
        return backend.wgrad_from_parts(parts, None, tuple(weight.shape))
    backend.wgrad_from_parts(parts, target, tuple(weight.shape))
    sink.mark_ready(weight)
    return None


_LIB = torch.library.Library("aligndp", "DEF")
"""The ops below, defined by schema and registered with one kernel for every device: the
dispatcher calls the function itself. (``torch.library.custom_op`` wraps it in Python that
checks its outputs for aliasing on every call: several times the host time of a call here,
paid several times per layer and step in a compiled graph.) No autograd kernel: they
run only inside compiled graphs, on tensors autograd does not record; called on one that
requires grad, the output's backward raises, as a ``custom_op`` without a formula's does."""


def _op(schema: str, fn, fake) -> None:
    """Define ``aligndp::<schema>``, with ``fn`` its kernel on every device and ``fake`` its
    fake impl (shapes and dtypes for tracing)."""
    name = schema.partition("(")[0]
    _LIB.define(schema)
    _LIB.impl(name, fn, "CompositeExplicitAutograd")
    torch.library.register_fake(f"aligndp::{name}", fake, lib=_LIB)


def _fused_wgrad_op(parts: list[torch.Tensor], weight: torch.Tensor, token: torch.Tensor) -> None:
    layer = _layer_at(weight)
    if layer is None:
        raise RuntimeError(
            f"internal: no MX layer with a grad sink holds a weight at {weight.data_ptr():#x}, "
            "but a compiled backward writes its wgrad into one; recompile after rebinding "
            "(torch._dynamo.reset())"
        )
    leftover = write_wgrad(layer.backend, layer._grad_sink, layer.weight, parts)
    if leftover is not None:
        raise RuntimeError(
            "a compiled MX layer's weight has no view in its grad sink; its gradient would be "
            "lost. Freeze the weight before compiling, or wrap the model before torch.compile"
        )


_op(
    "fused_wgrad(Tensor[] parts, Tensor weight, Tensor(a!) token) -> ()",
    _fused_wgrad_op,
    lambda parts, weight, token: None,
)
has_side_effect(torch.ops.aligndp.fused_wgrad.default)


def fused_wgrad(backend, sink, weight, parts: Sequence[torch.Tensor]):
    """:func:`write_wgrad`, through the opaque op while compiling (returns None there)."""
    if compiling():
        # the empty token it "mutates" keeps Inductor releases whose scheduler asks only the
        # schema (not has_side_effect) from dropping the op; torch 2.13 needs has_side_effect
        torch.ops.aligndp.fused_wgrad(list(parts), weight, weight.new_empty(0))
        return None
    return write_wgrad(backend, sink, weight, parts)


# ---- the Hopper kernels (Triton imported by the real impls only) ----


def _triton_kernels():
    """:mod:`aligndp.lowp.triton_kernels` as ``sys.modules`` holds it (tests put CPU stand-ins
    there), imported with Triton on first use: a dict lookup, cheaper per call than an import
    statement."""
    kernels = sys.modules.get("aligndp.lowp.triton_kernels")
    return kernels or importlib.import_module("aligndp.lowp.triton_kernels")


def _quantize_rc(
    x: torch.Tensor,
    block: int,
    mx: bool,
    rowwise: bool,
    colwise: bool,
    one: bool = True,
    workspace: dict | None = None,
) -> list[torch.Tensor]:
    row, col = _triton_kernels().quantize_rows_and_columns(
        x,
        block=block,
        scale_format=ScaleFormat.E8M0 if mx else ScaleFormat.FP32,
        rowwise=rowwise,
        colwise=colwise,
        one_allocation=one,  # a custom op's outputs may not share storage
        workspace=workspace,
    )
    return [t for op in (row, col) if op is not None for t in op]


def _quantize_rc_separate(
    x: torch.Tensor, block: int, mx: bool, rowwise: bool, colwise: bool
) -> list[torch.Tensor]:
    return _quantize_rc(x, block, mx, rowwise, colwise, one=False)


def _quantize_rc_fake(x, block, mx, rowwise, colwise):
    m, n = x.shape
    scale = torch.uint8 if mx else torch.float32
    out = []
    if rowwise:  # data (M, N) quantised along N, scales (N / block, M)
        out += [
            x.new_empty(m, n, dtype=torch.float8_e4m3fn),
            x.new_empty(n // block, m, dtype=scale),
        ]
    if colwise:  # data (N, M) = x.T quantised along M, scales (M / block, N)
        out += [
            x.new_empty(n, m, dtype=torch.float8_e4m3fn),
            x.new_empty(m // block, n, dtype=scale),
        ]
    return out


_op(
    "quantize_rc(Tensor x, int block, bool mx, bool rowwise, bool colwise) -> Tensor[]",
    _quantize_rc_separate,
    _quantize_rc_fake,
)


def quantize_rc(
    x: torch.Tensor,
    *,
    block: int,
    mx: bool,
    rowwise: bool,
    colwise: bool,
    workspace: dict | None = None,
):
    """``quantize_rows_and_columns`` as ``(row, col)`` pairs ``(data, scale_t)`` or None; into
    ``workspace``'s operands in eager (a compiled graph allocates its own)."""
    if compiling():
        flat = iter(torch.ops.aligndp.quantize_rc(x, block, mx, rowwise, colwise))
    else:
        flat = iter(_quantize_rc(x, block, mx, rowwise, colwise, workspace=workspace))
    return tuple((next(flat), next(flat)) if wanted else None for wanted in (rowwise, colwise))


def _scaled_mm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    block: int,
    mx: bool,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    kernels = _triton_kernels()
    out = a.new_empty(a.shape[0], b.shape[0], dtype=out_dtype)
    kernels.scaled_gemm(
        kernels.QuantizedOperand(a, a_scale),
        kernels.QuantizedOperand(b, b_scale),
        out,
        block=block,
        scale_format=ScaleFormat.E8M0 if mx else ScaleFormat.FP32,
        bias=bias,
    )
    return out


_op(
    "scaled_mm(Tensor a, Tensor a_scale, Tensor b, Tensor b_scale, int block, bool mx, "
    "ScalarType out_dtype, Tensor? bias) -> Tensor",
    _scaled_mm,
    lambda a, a_scale, b, b_scale, block, mx, out_dtype, bias: a.new_empty(
        a.shape[0], b.shape[0], dtype=out_dtype
    ),
)


def scaled_mm(a, b, *, block: int, mx: bool, out_dtype: torch.dtype, bias=None) -> torch.Tensor:
    """``A @ B.T (+ bias)`` of quantised ``(data, scale_t)`` pairs into a new (M, N) tensor."""
    fn = torch.ops.aligndp.scaled_mm if compiling() else _scaled_mm
    return fn(a[0], a[1], b[0], b[1], block, mx, out_dtype, bias)
