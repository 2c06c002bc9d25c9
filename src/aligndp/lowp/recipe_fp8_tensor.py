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

[Note: quantise cost]
What one eager quantise costs the host, per operand. CPU (also the reference of the CUDA path):
6 aten ops (8 with the transpose, one more for a 16-bit input's float32 copy); it allocates
its results (data, transpose, and the scale, which is the amax's own storage) and, for a
float32 input, one float32 intermediate (a 16-bit input's float32 copy is divided in place);
the ``E4M3_MAX`` divisor is made once per device. CUDA: two launches and at most one
allocation, none for ``grad_out``, which the backward quantises into a workspace it uses up
before the next backward (``x`` and the weight are saved for backward or cached, so they get
storage of their own). Each launch skips Triton's per-call binder and cache key
([Note: cheap launches] in triton_launch.py: the bare cached launch, to which the wrapper
adds its key, costs the host about half of ``kernel[grid]``), and a
workspace keeps its views with its buffer (a new allocation adds five view ops). Two launches
are the floor for current scaling: no element can be cast before the whole tensor's amax is
known, a grid-wide reduction, and Triton has no grid-wide barrier (a persistent kernel
spinning on a global counter deadlocks unless every program is resident, which nothing
guarantees). The ways below two change where the amax comes from: the previous op (Inductor
fuses it there under torch.compile) or the previous step (delayed scaling: other numerics, so
not the default). The weight pays its two launches once per step
([Note: weights once per step] in linear.py).
"""

from __future__ import annotations

import enum
import functools
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


_E4M3_MAX_ON: dict[torch.device, torch.Tensor] = {}
"""A 0-d float32 ``E4M3_MAX`` per device, made once (eager only: a compiled graph makes its
own constant)."""


def _e4m3_max(like: torch.Tensor) -> torch.Tensor:
    if compiling():
        return like.new_full((), E4M3_MAX)
    const = _E4M3_MAX_ON.get(like.device)
    if const is None:
        const = _E4M3_MAX_ON[like.device] = like.new_full((), E4M3_MAX)
    return const


@functools.cache
def _cuda_quantize():
    """The Triton quantise, imported (with Triton) on first use: an import statement per call
    costs more host time than this lookup."""
    from aligndp.lowp.fp8_tensor_kernels import quantize_per_tensor

    return quantize_per_tensor


def quantize_tensor(
    t: torch.Tensor, *, transposed: bool = False, workspace: dict | None = None
) -> Quantized:
    """``t`` (2-D) as E4M3 with one scale ``max|t| / 448``; with ``transposed``, its transpose
    too. CUDA, eager: two Triton passes (:mod:`aligndp.lowp.fp8_tensor_kernels`) writing both
    layouts, into ``workspace``'s buffer for the size when given (the result is overwritten by
    the next quantise of that size into it: only for operands used up before then); elsewhere,
    and under torch.compile, torch ops with the same maths. Cost: [Note: quantise cost]."""
    if t.is_cuda and not compiling():
        data, data_t, scale = _cuda_quantize()(
            t.contiguous(), transposed=transposed, workspace=workspace
        )
        return Quantized(data, scale, data_t)
    # torch ops: on CPU, and under torch.compile, where Inductor fuses the amax and the cast
    # with their neighbours ([Note: compiled MX layers] in ops.py)
    amax = torch.linalg.vector_norm(t, float("inf"), dtype=torch.float32)
    # divided by a tensor, not the number: CUDA divides a tensor by a Python number as a
    # multiply by its reciprocal, one bit off the Triton kernel's (and the CPU's) IEEE division
    scale = amax.clamp_(min=AMAX_FLOOR).div_(_e4m3_max(amax))
    data = cast_e4m3(t, scale)
    return Quantized(data, scale, data.t().contiguous() if transposed else None)


def scale_of(amax: torch.Tensor) -> torch.Tensor:
    """The float32 scale(s) ``max(amax, floor) / 448`` of float32 ``amax`` (any shape), as
    :func:`quantize_tensor` takes it: for an FP8 param gather, whose amax is the max of several
    ranks' pieces ([Note: FP8 param gather] in aligndp/runtime/gather_codec.py)."""
    return amax.clamp(min=AMAX_FLOOR).div_(_e4m3_max(amax))


def cast_e4m3(
    t: torch.Tensor, scale: torch.Tensor, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``t / scale`` rounded to E4M3 (saturating at 448): the torch-ops cast of
    :func:`quantize_tensor`, into ``out`` when given (``copy_`` runs the kernel ``.to`` does)."""
    # a 16-bit t's float32 copy is ours to divide in place; a float32 t is the caller's
    wide = t / scale if t.dtype == torch.float32 else t.float().div_(scale)
    wide.clamp_(-E4M3_MAX, E4M3_MAX)
    return wide.to(torch.float8_e4m3fn) if out is None else out.copy_(wide)


class _Saved(NamedTuple):
    x: Quantized
    weight: Quantized


def _mm(a: Quantized, b_t: Quantized, dtype, *, fast: bool, bias=None, out=None) -> torch.Tensor:
    """``a @ b_t.data.T`` scaled, ``a`` row-major (M, K), ``b_t`` row-major (N, K); into
    ``out`` (row-major (M, N) of ``dtype``) when given. With a float32 output the bias is
    added after the GEMM (``_scaled_mm`` refuses a bias there) and the accumulation is the
    exact one. The second was added for a CUBLAS_STATUS_NOT_SUPPORTED on H200 whose cause
    turned out to be a misaligned scale pointer (fixed in fp8_gather.py): ``_scaled_mm`` takes
    float32 outputs with fast accumulation; bringing it back is a numerics change left for a
    measured run."""
    if dtype == torch.float32 and (bias is not None or fast):
        y = _mm(a, b_t, dtype, fast=False, out=out)
        return y if bias is None else y.add_(bias)
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

    def __init__(self, recipe: Recipe, *, name: str | None = None):
        super().__init__(recipe, name=name)
        self._grad_out_buffers: dict = {}
        """CUDA buffers of quantised ``grad_out`` by size, reused by every backward of this
        backend: the dgrad and the wgrad (:meth:`wgrad_from_parts`, right after in the same
        backward) use them up before the next layer's backward writes them again; stream order
        does the rest. Never ``x`` or the weight, which outlive their call."""

    def forward(self, x, weight):
        return self.forward_for_backward(x, weight)[0]

    def dgrad(self, grad_out, weight):
        return _mm(
            quantize_tensor(grad_out), quantize_tensor(weight).t(), grad_out.dtype, fast=False
        )

    def wgrad(self, grad_out, x):
        g = quantize_tensor(grad_out, transposed=True).t()
        xq = quantize_tensor(x, transposed=True).t()
        return _mm(g, xq, torch.float32, fast=False)

    def quantize_weight(self, weight):
        """Both layouts: row-major for forward, transposed for dgrad."""
        return quantize_tensor(weight, transposed=True)

    def forward_for_backward(self, x, weight, bias=None, *, weight_q=None):
        # each operand once, in both layouts: x for forward and (transposed) wgrad, the weight
        # for forward and (transposed) dgrad (or the layer's cached weight, quantised once)
        xq = quantize_tensor(x, transposed=True)
        wq = weight_q if weight_q is not None else self.quantize_weight(weight)
        bias = None if bias is None else bias.to(x.dtype)
        return _mm(xq, wq, x.dtype, fast=True, bias=bias), _Saved(xq, wq)

    def backward_parts(self, saved, grad_out, weight, *, need_dgrad, need_wgrad, weight_q=None):
        if not (need_dgrad or need_wgrad):
            return None, None
        g = quantize_tensor(grad_out, transposed=need_wgrad, workspace=self._grad_out_buffers)
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
