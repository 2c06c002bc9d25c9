"""Layout requirements of the wgrad recipes, in one place.

[Note: alignment contract] says requirements come from the consumers of buffer views. A
fused wgrad GEMM is such a consumer: it writes ``main_grad`` through a raw pointer, so the
view's start must satisfy the kernel's alignment. ``aligndp layout``, :func:`aligndp.parallelize`
and the MX modules all ask this function, so the numbers live once.
"""

from __future__ import annotations

from aligndp.plan.layout import Requirement

__all__ = ["WGRAD_RECIPES", "wgrad_requirements"]

WGRAD_RECIPES = ("none", "fp8", "mxfp8")
"""Recipes a wgrad GEMM may use: ``none`` (plain autograd), ``fp8``, ``mxfp8``."""


def wgrad_requirements(recipe: str) -> list[Requirement]:
    """The requirements a wgrad GEMM of ``recipe`` puts on every param start.

    - ``mxfp8``: cuBLASLt's block-scaled MXFP8 GEMM (and our Triton kernel) reject an output
      pointer that is not 128-byte aligned; for 16-bit grads that is 64 elements, and 64
      elements also keep the 32-element scale blocks whole. Asked in elements so fp32 grads
      get 256 B, never less than the kernel's tile.
    - ``fp8``: cuBLASLt's FP8 GEMM needs 16-byte aligned output pointers.
    - ``none``: plain autograd copies into the buffer; nothing beyond the default.
    """
    if recipe == "mxfp8":
        return [Requirement("MXFP8 wgrad (cuBLASLt/Triton)", start_elements=64)]
    if recipe == "fp8":
        return [Requirement("FP8 wgrad (cuBLASLt)", start_bytes=16)]
    if recipe == "none":
        return []
    raise ValueError(f"unknown wgrad recipe {recipe!r}: choose one of {', '.join(WGRAD_RECIPES)}")
