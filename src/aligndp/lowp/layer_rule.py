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
- the layer shapes where FP8 does not gain (``skip``): a layer with ``in_features <= K`` and
  ``out_features <= N`` for any listed ``(K, N)`` stays ``nn.Linear``. The per-tensor and
  1x128 boxes are measured on H200 (``benchmarks/fp8_layer_sweep.py``: one Linear's fwd+bwd
  at M = 8192 tokens, bf16 autocast, fp32 weight, each recipe's time over bf16's in the same
  mode; benchmarks/results/fp8_step_2026-12-01.md). A shape converts only where the ratio
  clearly pays (<= 0.9). Measured, per-tensor (eager / compiled): 768x2304 2.63 / 1.35,
  768x768 2.22 / 1.21, 768x3072 2.65 / 1.08, 3072x768 2.79 / 1.32, 2048x6144 1.76 / 1.40,
  2048x2048 2.58 / 1.56, 2048x8192 1.09 / 1.11, 8192x2048 1.02 / **0.80**; 1x128 eager
  1.13-3.87 at the same shapes, compiled 2.17-2.68 at gpt2-small's. So per-tensor converts
  only ``in >= 8192`` with ``out >= 2048`` (``FP8_TENSOR_SKIP``; at 1b that is ``blocks.*.out``,
  about break-even eager), and 1x128 nothing up to 8192 x 8192 (``FP8_BLOCK_SKIP``; beyond,
  torchao's rowwise rule, unmeasured here). At these sizes the quantise passes and the host's
  launches cost more than the FP8 GEMM saves; torchao's own tensorwise rule (skip ``in <= 4096``
  and ``out <= 1024``, H100, M = 16384) converts gpt2-small's qkv and fc, which lose here.
  MXFP8 keeps torchao 0.18's rowwise rule (``_auto_filter_for_rowwise``: skip out <= 2048,
  in <= 1024, or in <= 2048 and out <= 4096), unmeasured: Hopper has no MXFP8 fast path.
  The measured token count is 8192; fewer tokens per step gain less.

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
    "BLOCKWISE_SKIP",
    "FP8_BLOCK_SKIP",
    "FP8_TENSOR_SKIP",
    "capability_of",
    "slow_reason",
    "describe_plan",
]

BLOCKWISE_SKIP = ((math.inf, 2048), (1024, math.inf), (2048, 4096))
"""torchao's rowwise rule: not where ``out <= 2048``, ``in <= 1024``, or ``in <= 2048`` and
``out <= 4096``."""
FP8_TENSOR_SKIP = ((8191, math.inf), (math.inf, 2047))
"""Per-tensor FP8, measured on H200: gains only where ``in >= 8192`` and ``out >= 2048``."""
FP8_BLOCK_SKIP = BLOCKWISE_SKIP + ((8192, 8192),)
"""1x128 FP8, measured on H200: no gain up to ``in, out <= 8192``; torchao's rowwise beyond."""

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
