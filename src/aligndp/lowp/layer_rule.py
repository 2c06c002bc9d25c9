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
  ``out_features <= N`` for any listed ``(K, N)`` stays ``nn.Linear``. The boxes are measured
  on H200 in a *whole training step* (``benchmarks/fp8_step.py``, bf16 autocast, fp32 params,
  batch 8 x 1024; benchmarks/results/fp8_step_2026-12-01.md), because a Linear timed alone
  misleads: ``benchmarks/fp8_layer_sweep.py`` issues one layer's fwd+bwd back to back, which
  is host-bound at these sizes (per-tensor "lost" there at 1b's 2048x6144), while in a compiled
  step the host runs ahead and the GPU time decides: per-kernel GPU time of that layer,
  compiled, is lower per-tensor than bf16 and torchao float8, and so is the 1b step with every
  block Linear per-tensor, below the step with only the 8192->2048 ones converted (figures in
  docs/performance.md). So per-tensor converts where ``in >= 2048`` and ``out >= 2048``
  (``FP8_TENSOR_SKIP``: all four of 1b's block Linears); gpt2-small's 768-wide ones stay
  (per-tensor slower than bf16 per layer and in the whole step, and torchao float8 + compile
  slower than bf16 + compile there); widths between 768 and 2048 are not measured. 1x128
  converts the same layers (``FP8_BLOCK_SKIP``). When the rule was first measured it converted
  nothing up to 8192 x 8192 (slower than bf16 per layer, and in the compiled 1b step); then the
  kernels and their host cost came down (benchmarks/results/2026-12-02_fp8_launch_host_cost.md),
  and the same step with every block Linear got faster than bf16 + compile, and eager than bf16
  eager. MXFP8 keeps torchao 0.18's rowwise rule (``_auto_filter_for_rowwise``:
  skip out <= 2048, in <= 1024, or in <= 2048 and out <= 4096), unmeasured: Hopper has no
  MXFP8 fast path. The measured token count is 8192; fewer tokens per step gain less.

The ``bf16`` recipe quantises nothing ([Note: fused bf16 wgrad] in recipe_bf16.py); what it
saves per layer is two memory passes over the weight gradient, what it costs is a Python
autograd.Function per layer, and under ``torch.compile`` the fused-wgrad custom op's dispatch
(host time per layer and step, measured on H200 while the op went through torch's
``custom_op`` wrapper; ops.py now registers it directly, a fraction of that per call).
So it gains where the GEMMs are large: in the 1b step (every Linear ``in, out >= 2048``, head
included) eager it beats plain torch, where the unconverted wrapper trails it; at gpt2-small
(768 wide) it loses, eager and, host-bound, compiled (docs/performance.md).
``FUSED_BF16_SKIP`` keeps the same box as per-tensor FP8; it needs a CUDA GPU (sm_80+: a
CPU has no GEMM with a float32 output of bf16 operands, so the operands are widened first).

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
    "FUSED_BF16_SKIP",
    "capability_of",
    "slow_reason",
    "describe_plan",
]

BLOCKWISE_SKIP = ((math.inf, 2048), (1024, math.inf), (2048, 4096))
"""torchao's rowwise rule: not where ``out <= 2048``, ``in <= 1024``, or ``in <= 2048`` and
``out <= 4096``."""
FP8_TENSOR_SKIP = ((2047, math.inf), (math.inf, 2047))
"""Per-tensor FP8, measured on H200 in the 1b step: gains where ``in, out >= 2048``."""
FUSED_BF16_SKIP = FP8_TENSOR_SKIP
"""The ``bf16`` recipe (no quantisation, the wgrad into main_grad), measured on H200: gains in
the 1b step (every Linear ``in, out >= 2048``), loses at gpt2-small's 768 wide ones; the same
box as per-tensor FP8's."""
FP8_BLOCK_SKIP = FP8_TENSOR_SKIP
"""1x128 FP8, measured on H200 in the 1b step: gains where ``in, out >= 2048``, the same box
as per-tensor FP8's."""

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
