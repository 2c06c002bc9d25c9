"""The ``mxfp8`` wgrad recipe: OCP MXFP8, E4M3 elements in 1x32 blocks with E8M0 scales.

cuBLASLt's block-scaled MXFP8 GEMM (and our Triton kernel) reject an output pointer that is
not 128-byte aligned; for 16-bit grads that is 64 elements, and 64 elements also keep the
32-element scale blocks whole. The requirement is asked in elements, so fp32 grads get 256 B,
never less than the kernel's tile. Layers need whole 32-element blocks along both dims (each
is the contraction dim of one of the layer's GEMMs).
"""

from aligndp.lowp.layer_rule import BLOCKWISE_SKIP, GainRule
from aligndp.lowp.recipe import BackendRef, Recipe, ScaleFormat
from aligndp.plan.spec import Requirement

RECIPE = Recipe(
    name="mxfp8",
    runs="MXFP8 GEMMs (a CPU reference, Triton kernels on a Hopper GPU)",
    requirements=(Requirement("MXFP8 wgrad (cuBLASLt/Triton)", start_elements=64),),
    block=32,
    scale_format=ScaleFormat.E8M0,
    layer_dim_multiple=32,
    gain=GainRule(
        fast_from=(10, 0),
        slow_on=(
            "MXFP8 emulated: operands dequantised to bf16 for a bf16 GEMM (no block-scaled "
            "tensor cores before sm_100), or the CPU reference"
        ),
        skip=BLOCKWISE_SKIP,
        source="torchao rowwise rule: out <= 2048, in <= 1024, or in <= 2048 and out <= 4096",
    ),
    backends=(
        BackendRef("reference", "aligndp.lowp.backends:ReferenceBackend", devices=("cpu",)),
        BackendRef(
            "triton",
            "aligndp.lowp.triton_backend:TritonBackend",
            devices=("cuda",),
            needs_cuda=True,
        ),
    ),
)
