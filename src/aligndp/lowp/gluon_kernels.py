"""Gluon (Triton's explicit-layout dialect) kernels for Hopper, GPU only: the one-pass
row+column quantise (:mod:`aligndp.lowp.gluon_quantize`) and the 1x128 block-scaled FP8 GEMM
that accumulates in place (:mod:`aligndp.lowp.gluon_gemm`). Imported only by
:mod:`aligndp.lowp.triton_common` (and tests, benchmarks), and only when
``triton.experimental.gluon`` with its Hopper module imports (Triton 3.6); otherwise the
plain-Triton kernels run instead.
"""

from aligndp.lowp.gluon_gemm import TILE, fp8_block_gemm
from aligndp.lowp.gluon_quantize import quantize

__all__ = ["TILE", "fp8_block_gemm", "quantize"]
