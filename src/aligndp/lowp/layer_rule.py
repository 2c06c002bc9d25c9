"""Which ``nn.Linear`` layers a recipe converts by default: only where FP8 pays.

[Note: layers that pay]
Quantising costs a read and a write of every operand per GEMM; the FP8 GEMM saves half the
tensor-core time. A layer gains only when its GEMMs are large enough that the saving outweighs
the casts, and only on a GPU whose tensor cores run the format natively. So each built-in
recipe declares a :class:`GainRule`:

- the lowest CUDA compute capability with the format's fast GEMM (``fast_from``): FP8 E4M3
  tensor cores from sm_89 (Ada, Hopper) for per-tensor FP8 through cuBLASLt; our 1x128 kernels
  are Hopper kernels (sm_90); MXFP8 needs block-scaled tensor cores (sm_100, Blackwell), and on
  Hopper our Triton backend dequantises to bf16 — emulated, a correctness path. No CPU has a
  fast path, so the CPU backends (reference, fp8-tensor) are correctness paths too.
- the layer shapes below which FP8 does not gain (``skip``): a layer with ``in_features <= K``
  and ``out_features <= N`` for any listed ``(K, N)`` stays ``nn.Linear``. The figures are
  torchao 0.18's, measured on H100 at the forward's M = 16384 tokens with ``torch.compile``
  (``torchao.float8.float8_linear_utils._auto_filter_for_tensorwise``: skip K <= 4096 and
  N <= 1024; ``_auto_filter_for_rowwise``: skip N <= 2048, K <= 1024, or N <= 4096 and
  K <= 2048; the torchao float8 README's "Performance" tables). Per-tensor FP8 takes the
  tensorwise rule; the 1x128 and MXFP8 recipes, whose quantise writes a scale per block as
  rowwise scaling does per row, take the rowwise one. ``benchmarks/fp8_step.py`` measures
  whole steps with these defaults on H200.

``convert_to_mxfp8(layers="pays")`` (the default; ``aligndp train --wgrad-layers pays``)
applies the rule; ``layers="all"`` converts every layer the recipe can run (dims multiples of
its block, not the head, no shared weight), e.g. to test a recipe's numerics on CPU; a
``filter`` replaces both. Where the device lacks the fast path the rule converts nothing and
says so once per (recipe, device) in a warning. A recipe without a rule (``gain=None``, e.g.
one a user registers) converts every layer it can run.
"""

from __future__ import annotations

import dataclasses
import math
import re
import warnings

import torch

__all__ = [
    "GainRule",
    "TENSORWISE_SKIP",
    "BLOCKWISE_SKIP",
    "capability_of",
    "slow_reason",
    "describe_plan",
]

TENSORWISE_SKIP = ((4096, 1024),)
"""torchao's tensorwise rule: FP8 does not gain where ``in <= 4096`` and ``out <= 1024``."""
BLOCKWISE_SKIP = ((math.inf, 2048), (1024, math.inf), (2048, 4096))
"""torchao's rowwise rule: not where ``out <= 2048``, ``in <= 1024``, or ``in <= 2048`` and
``out <= 4096``."""

_WARNED: set[tuple[str, str]] = set()


@dataclasses.dataclass(frozen=True)
class GainRule:
    """Where a recipe's FP8 GEMMs are faster than bf16; see [Note: layers that pay]."""

    fast_from: tuple[int, int]
    """Lowest CUDA compute capability whose tensor cores run the format (CPUs: none)."""
    slow_on: str
    """What runs on a device below ``fast_from`` instead, quoted in the warning."""
    skip: tuple[tuple[float, float], ...] = ()
    """``(K, N)`` boxes: a layer with ``in_features <= K`` and ``out_features <= N`` for any box
    does not gain."""
    source: str = ""
    """Where the figures come from."""

    def fast_on(self, capability: tuple[int, int] | None) -> bool:
        """Whether a device of ``capability`` (None: a CPU) has the fast path."""
        return capability is not None and tuple(capability) >= self.fast_from

    def gains(self, in_features: int, out_features: int) -> bool:
        """Whether a layer of these dims is outside every ``skip`` box."""
        return not any(in_features <= k and out_features <= n for k, n in self.skip)


def capability_of(device: torch.device | str) -> tuple[int, int] | None:
    """The CUDA compute capability of ``device``; None for a CPU (and for ``meta``)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_capability(device)


def slow_reason(recipe_name: str, rule: GainRule, capability: tuple[int, int] | None) -> str:
    """Why ``rule`` converts nothing on a device of ``capability``, with the override; warned
    once per (recipe, device) as well."""
    where = "a CPU" if capability is None else "sm_{}{}".format(*capability)
    reason = (
        f"wgrad recipe {recipe_name!r} has no fast path on {where} (it needs sm_"
        f"{rule.fast_from[0]}{rule.fast_from[1]}+; here it runs {rule.slow_on}): converting no "
        "layer. To run it anyway as a correctness path pass layers='all' to convert_to_mxfp8 "
        "(aligndp train --wgrad-layers all)"
    )
    if (recipe_name, where) not in _WARNED:
        _WARNED.add((recipe_name, where))
        warnings.warn(reason, stacklevel=3)
    return reason


def _grouped(names: list[str]) -> str:
    """Layer names with block indices folded (``blocks.*.fc``), in first-seen order."""
    return ", ".join(dict.fromkeys(re.sub(r"(^|\.)\d+(\.|$)", r"\1*\2", n) for n in names))


def describe_plan(recipe_name: str, plan: list[tuple[str, str]]) -> str:
    """One line for ``aligndp train`` / ``layout``: which ``nn.Linear`` layers ``recipe_name``
    converts, and why the rest stay (``plan`` as :func:`aligndp.lowp.linear.conversion_plan`)."""
    done = [n for n, why in plan if not why]
    kept: dict[str, list[str]] = {}
    for name, why in plan:
        if why:
            kept.setdefault(why, []).append(name)
    line = (
        f"wgrad {recipe_name}: converts {len(done)} of {len(plan)} Linear layers"
        f" ({_grouped(done) or 'none'})"
    )
    if kept:
        line += "; keeps " + "; ".join(f"{_grouped(n)}: {why}" for why, n in kept.items())
    return line
