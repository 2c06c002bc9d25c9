"""The ``bf16`` wgrad recipe: no quantisation, only the fused wgrad into ``main_grad``.

[Note: fused bf16 wgrad]
Under bf16 autocast with float32 params, a plain ``nn.Linear``'s weight gradient costs three
memory passes after its GEMM: the GEMM writes it in bf16, the backward of autocast's weight
cast widens it to a new float32 tensor, and the data-parallel wrapper copies that into the
param's float32 view of the grad buffer. This recipe's layers run the same bf16 GEMMs
(forward, dgrad) but write the wgrad with one GEMM straight into the view, float32 out of the
tensor cores' float32 accumulator (cuBLAS's ``out_dtype``; ``addmm`` onto the view from the
second contribution of a step on: [Note: write, not accumulate] in aligndp/plan/fused.py).
No bf16 wgrad, no cast, no copy; and the wgrad is no longer rounded to bf16 before it is
summed, so it is closer to the float32 value than autocast's. Megatron-LM calls this
gradient-accumulation fusion.

Measured on H200 (benchmarks/results/2026-12-02_bf16_wgrad_recipe.md), the 1b model's wgrad
GEMMs fused are faster than as autocast does them (bf16 GEMM and the float32 cast), and than
that plus the wrapper's copy.

The GEMMs compute in ``x``'s dtype, which :class:`~aligndp.lowp.MXLinear` has cast to the
autocast dtype (bf16 or fp16) when autocast is on, and which is the weight's dtype otherwise
(float32 training then gains the missing copy alone). The weight is cast once per forward, as
autocast does; nothing is cached. CPU, and torch without ``out_dtype``: the operands widened to
the view's float32 and multiplied there, the same products and float32 sums. It can convert
every ``nn.Linear``, the output head too (it lowers no precision, so there is no head to
spare), except those whose weight another module shares (tied embeddings), which plain
autograd keeps; by default only those large enough to gain, on a CUDA GPU
([Note: layers that pay] in layer_rule.py: the saving is per element, the cost per layer).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from aligndp.lowp.backends import WgradBackend, put_wgrad
from aligndp.lowp.layer_rule import FUSED_BF16_SKIP, GainRule
from aligndp.lowp.recipe import BackendRef, Recipe
from aligndp.plan.fused import GradTarget
from aligndp.plan.spec import Requirement

__all__ = ["RECIPE", "FusedBackend", "gemm_into"]


@functools.cache
def _has_out_dtype() -> bool:
    """Whether this torch has ``mm``/``addmm`` with ``out_dtype`` (CUDA kernels only)."""
    return "dtype_out" in torch.ops.aten.addmm.overloads()


def gemm_into(view: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, accumulate: bool) -> None:
    """``view (+)= a @ b`` in one GEMM where the kernels allow: same dtypes, or 16-bit operands
    into a float32 view on CUDA (``out_dtype``); otherwise in the wider of the two dtypes
    (operands widened exactly), then into the view."""
    if a.dtype != view.dtype and view.dtype == torch.float32:
        if a.is_cuda and _has_out_dtype():
            if accumulate:
                torch.addmm(view, a, b, out_dtype=torch.float32, out=view)
            else:
                torch.mm(a, b, out_dtype=torch.float32, out=view)
            return
        a, b = a.float(), b.float()
    if a.dtype == view.dtype:
        if accumulate:
            view.addmm_(a, b)
        else:
            torch.mm(a, b, out=view)
    else:  # float32 operands into a bf16 view: the float32 product, rounded once
        put_wgrad(GradTarget(view, accumulate=accumulate), a @ b)


class FusedBackend(WgradBackend):
    """Unquantised GEMMs in the input's dtype, the wgrad into ``main_grad`` in one GEMM
    ([Note: fused bf16 wgrad])."""

    name = "bf16"
    scale_formats = (None,)

    def forward(self, x, weight):
        return F.linear(x, weight.to(x.dtype))

    def dgrad(self, grad_out, weight):
        return grad_out @ weight.to(grad_out.dtype)

    def wgrad(self, grad_out, x):
        out = torch.empty(grad_out.shape[1], x.shape[1], dtype=torch.float32, device=x.device)
        gemm_into(out, grad_out.t(), x, accumulate=False)
        return out

    def forward_for_backward(self, x, weight, bias=None, *, weight_q=None):
        w = weight.to(x.dtype)  # autocast's cast; saved for dgrad as autocast's mm saves it
        y = F.linear(x, w, None if bias is None else bias.to(x.dtype))
        return y, (x, w)

    def backward_parts(self, saved, grad_out, weight, *, need_dgrad, need_wgrad, weight_q=None):
        x, w = saved
        grad_x = grad_out @ w if need_dgrad else None
        return grad_x, ((grad_out, x) if need_wgrad else None)

    def wgrad_into(self, grad_out, x, target):
        self.check(target.view, grad_out, x)
        gemm_into(target.view, grad_out.t(), x, accumulate=target.accumulate)


RECIPE = Recipe(
    name="bf16",
    runs="the autocast dtype's GEMMs, the wgrad written in float32 into main_grad (cuBLAS)",
    requirements=(Requirement("fused bf16 wgrad (cuBLAS)", start_bytes=16),),
    layer_dim_multiple=1,
    spares_head=False,
    gain=GainRule(
        fast_from=(8, 0),
        slow_on="float32 GEMMs of widened operands (no bf16 GEMM with a float32 output)",
        skip=FUSED_BF16_SKIP,
        source="measured on H200: gains in the 1b step (in, out >= 2048), loses at 768 wide",
    ),
    backends=(BackendRef("bf16", f"{__name__}:FusedBackend", devices=("cpu", "cuda")),),
)
