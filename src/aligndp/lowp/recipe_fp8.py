"""The ``fp8`` wgrad recipe: 1x128 blockwise FP8 E4M3 with float32 scales ``amax / 448``
(``amax`` floored at 1e-30 as fp8-tensor's, so a block of tiny values cannot turn its zeros
into NaN through an infinite inverse scale; an all-zero block gets scale 1).

cuBLASLt's FP8 GEMM needs 16-byte aligned output pointers. Layers need dims that are multiples
of 32, as MXLinear has always asked; the GPU backend zero-pads feature dims to its 128 block
(exact for a GEMM). There is no CPU backend.
"""

from aligndp.lowp.layer_rule import FP8_BLOCK_SKIP, GainRule
from aligndp.lowp.recipe import BackendRef, Recipe, ScaleFormat
from aligndp.plan.spec import Requirement

RECIPE = Recipe(
    name="fp8",
    runs="blockwise FP8 kernels on a Hopper GPU",
    requirements=(Requirement("FP8 wgrad (cuBLASLt)", start_bytes=16),),
    block=128,
    scale_format=ScaleFormat.FP32,
    layer_dim_multiple=32,
    gain=GainRule(
        fast_from=(9, 0),
        slow_on="nothing (the 1x128 kernels are Hopper kernels)",
        skip=FP8_BLOCK_SKIP,
        source="measured on H200 in the 1b step at 8192 tokens: gains where in, out >= 2048",
    ),
    backends=(
        BackendRef(
            "fp8", "aligndp.lowp.triton_backend:TritonBackend", devices=("cuda",), needs_cuda=True
        ),
    ),
)
