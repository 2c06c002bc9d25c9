"""The ``fp8-tensor`` wgrad recipe: FP8 E4M3 with one float32 scale per tensor (current scaling).

Each GEMM operand is quantised with a single scale ``amax(|t|) / 448`` taken over the whole
tensor just before use, so the GEMM needs no per-block promotion: ``torch._scaled_mm``
(cuBLASLt on CUDA, a CPU kernel otherwise) multiplies the two scales into its epilogue. That
is the cheapest FP8 GEMM there is; the price is precision, since one outlier sets the scale of
every element. The forward GEMM uses cuBLAS's fast accumulation; dgrad and wgrad, whose
contraction dims are long, do not. The first wgrad of a step is written by the GEMM straight
into ``main_grad`` ([Note: write, not accumulate] in aligndp/plan/fused.py); later ones are
computed in float32 and added (cuBLASLt cannot accumulate into its output through
``_scaled_mm``).

A tensor's per-tensor scale is the same for it and its transpose, so each operand is
quantised once, and the pass that casts it also writes the transposed layout its other GEMM
wants (:mod:`aligndp.lowp.fp8_tensor_kernels` on CUDA). cuBLASLt's FP8 GEMM needs 16-byte
aligned output pointers and dims that are multiples of 16. The recipe is this module (the
recipe and its one backend) and its kernel module.

With ``parallelize(fp8_param_gather=True)`` a weight arrives already quantised: the param
all-gather moved its FP8 bytes and scale ([Note: FP8 param gather] in
aligndp/runtime/gather_codec.py) and :func:`publish_weight` hands them to the backend, whose
forward takes them instead of quantising the weight (the same bytes and scale a quantise of
the fp32 master would give) until the weight is written again (its version counter moves).
Under ``torch.compile`` the weight is quantised in the graph as before: from the decoded
value, whose scale can differ from the gathered one in the last bit.
"""

from __future__ import annotations

import enum
import weakref
from typing import NamedTuple

import torch

from aligndp.lowp.backends import WgradBackend
from aligndp.lowp.layer_rule import FP8_TENSOR_SKIP, GainRule
from aligndp.lowp.ops import compiling
from aligndp.lowp.recipe import BackendRef, Recipe
from aligndp.plan.spec import Requirement

__all__ = [
    "RECIPE",
    "TensorScale",
    "TensorScaledBackend",
    "quantize_tensor",
    "scale_of",
    "cast_e4m3",
    "publish_weight",
    "gathered_weight",
]

E4M3_MAX = 448.0
"""Largest finite float8_e4m3fn value."""
AMAX_FLOOR = 1e-30
"""Smallest amax a scale is taken from: an all-zero tensor gets ``1e-30 / 448``, a normal
float32, so GPUs that flush denormals still divide by a non-zero scale."""


class TensorScale(enum.Enum):
    """This recipe's scale format: one float32 ``amax / 448`` per tensor."""

    FP32_PER_TENSOR = "fp32-per-tensor"


class Quantized(NamedTuple):
    """An FP8 tensor and the float32 scale that multiplies it back (``data * scale ≈ t``), and
    its transpose when the quantise wrote one."""

    data: torch.Tensor
    scale: torch.Tensor
    data_t: torch.Tensor | None = None

    def t(self) -> Quantized:
        """The transpose, contiguous (per-tensor scales do not care about layout)."""
        data_t = self.data_t if self.data_t is not None else self.data.t().contiguous()
        return Quantized(data_t, self.scale, self.data)


def quantize_tensor(t: torch.Tensor, *, transposed: bool = False) -> Quantized:
    """``t`` (2-D) as E4M3 with one scale ``max|t| / 448``; with ``transposed``, its transpose
    too. CUDA, eager: two Triton passes (:mod:`aligndp.lowp.fp8_tensor_kernels`) writing both
    layouts; elsewhere, and under torch.compile, torch ops with the same maths."""
    if t.is_cuda and not compiling():
        from aligndp.lowp.fp8_tensor_kernels import quantize_per_tensor

        data, data_t, scale = quantize_per_tensor(t.contiguous(), transposed=transposed)
        return Quantized(data, scale, data_t)
    # torch ops: on CPU, and under torch.compile, where Inductor fuses the amax and the cast
    # with their neighbours ([Note: compiled MX layers] in ops.py)
    scale = scale_of(torch.linalg.vector_norm(t, float("inf"), dtype=torch.float32))
    data = cast_e4m3(t, scale)
    return Quantized(data, scale, data.t().contiguous() if transposed else None)


def scale_of(amax: torch.Tensor) -> torch.Tensor:
    """The float32 scale(s) ``max(amax, floor) / 448`` of float32 ``amax`` (any shape)."""
    # divided by a tensor, not the number: CUDA divides a tensor by a Python number as a
    # multiply by its reciprocal, one bit off the Triton kernel's (and the CPU's) IEEE division
    return torch.clamp(amax, min=AMAX_FLOOR) / amax.new_full((), E4M3_MAX)


def cast_e4m3(
    t: torch.Tensor, scale: torch.Tensor, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``t / scale`` rounded to E4M3 (saturating at 448), into ``out`` when given (the same
    cast kernel ``.to`` runs, one pass and one allocation fewer)."""
    scaled = (t.float() / scale).clamp_(-E4M3_MAX, E4M3_MAX)
    return scaled.to(torch.float8_e4m3fn) if out is None else out.copy_(scaled)


_GATHERED: dict[int, tuple[weakref.ref, int, Quantized]] = {}
"""id(weight) -> (the weight, its version when published, its gathered operand)."""


def publish_weight(weight: torch.Tensor, data: torch.Tensor, scale: torch.Tensor) -> None:
    """From now on, until ``weight`` is written, its layers' forward GEMM takes ``data`` (E4M3,
    the weight's shape) and ``scale`` as the quantised weight ([Note: FP8 param gather])."""
    if id(weight) not in _GATHERED:  # dropped with the weight (the operand views its buffer)
        weakref.finalize(weight, _GATHERED.pop, id(weight), None)
    _GATHERED[id(weight)] = (
        weakref.ref(weight),
        weight._version,
        Quantized(data, scale, data.t().contiguous()),
    )


def gathered_weight(weight: torch.Tensor) -> Quantized | None:
    """The operand :func:`publish_weight` gave ``weight``, if it still holds (not while
    compiling: Python state a graph should not guard on)."""
    entry = _GATHERED.get(id(weight))
    if entry is None or compiling():
        return None
    ref, version, operand = entry
    if ref() is not weight or weight._version != version:
        return None
    return operand


def _weight_operand(weight: torch.Tensor) -> Quantized:
    operand = gathered_weight(weight)
    return operand if operand is not None else quantize_tensor(weight, transposed=True)


class _Saved(NamedTuple):
    x: Quantized
    weight: Quantized


def _mm(a: Quantized, b_t: Quantized, dtype, *, fast: bool, bias=None, out=None) -> torch.Tensor:
    """``a @ b_t.data.T`` scaled, ``a`` row-major (M, K), ``b_t`` row-major (N, K); into
    ``out`` (row-major (M, N) of ``dtype``) when given."""
    return torch._scaled_mm(
        a.data,
        b_t.data.t(),  # (K, N) column-major, as cuBLASLt wants its second operand
        scale_a=a.scale,
        scale_b=b_t.scale,
        bias=bias,
        out_dtype=dtype,
        use_fast_accum=fast,
        out=out,
    )


class TensorScaledBackend(WgradBackend):
    """Per-tensor FP8 GEMMs through ``torch._scaled_mm``, on any device it supports."""

    name = "fp8-tensor"
    scale_formats = (TensorScale.FP32_PER_TENSOR,)

    def forward(self, x, weight):
        return self.forward_for_backward(x, weight)[0]

    def dgrad(self, grad_out, weight):
        return _mm(
            quantize_tensor(grad_out), _weight_operand(weight).t(), grad_out.dtype, fast=False
        )

    def wgrad(self, grad_out, x):
        g = quantize_tensor(grad_out, transposed=True).t()
        xq = quantize_tensor(x, transposed=True).t()
        return _mm(g, xq, torch.float32, fast=False)

    def forward_for_backward(self, x, weight, bias=None):
        # each operand once, in both layouts: x for forward and (transposed) wgrad, the weight
        # for forward and (transposed) dgrad
        xq, wq = quantize_tensor(x, transposed=True), _weight_operand(weight)
        bias = None if bias is None else bias.to(x.dtype)
        return _mm(xq, wq, x.dtype, fast=True, bias=bias), _Saved(xq, wq)

    def backward_parts(self, saved, grad_out, weight, *, need_dgrad, need_wgrad):
        if not (need_dgrad or need_wgrad):
            return None, None
        g = quantize_tensor(grad_out, transposed=need_wgrad)
        grad_x = _mm(g, saved.weight.t(), grad_out.dtype, fast=False) if need_dgrad else None
        if not need_wgrad:
            return grad_x, None
        g_t, x_t = g.t(), saved.x.t()  # (out, tokens) and (in, tokens), row-major
        return grad_x, (g_t.data, g_t.scale, x_t.data, x_t.scale)

    def wgrad_from_parts(self, parts, target, shape):
        g_t, x_t = Quantized(parts[0], parts[1]), Quantized(parts[2], parts[3])
        if target is None:
            return _mm(g_t, x_t, torch.float32, fast=False)
        self.check_main_grad(target.view, shape=shape, device=g_t.data.device)
        if target.accumulate:
            target.view.add_(_mm(g_t, x_t, torch.float32, fast=False))
        else:  # the GEMM writes the view itself: no zeroing, no add pass
            _mm(g_t, x_t, target.view.dtype, fast=False, out=target.view)
        return None


RECIPE = Recipe(
    name="fp8-tensor",
    runs="per-tensor FP8 GEMMs (torch._scaled_mm: cuBLASLt on CUDA, a CPU kernel otherwise)",
    requirements=(Requirement("FP8 wgrad (cuBLASLt)", start_bytes=16),),
    block=16,  # no quantisation blocks: cuBLASLt's FP8 GEMM wants dims that are multiples of 16
    scale_format=TensorScale.FP32_PER_TENSOR,
    layer_dim_multiple=16,
    gain=GainRule(
        fast_from=(8, 9),
        slow_on="torch._scaled_mm on CPU, or without FP8 tensor cores",
        skip=FP8_TENSOR_SKIP,
        source="measured on H200 in a 1b step at 8192 tokens: gains where in, out >= 2048",
    ),
    backends=(
        BackendRef(
            "fp8-tensor",
            f"{__name__}:TensorScaledBackend",
            devices=("cpu", "cuda"),
        ),
    ),
)
