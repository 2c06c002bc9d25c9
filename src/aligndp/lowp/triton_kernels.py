"""Triton kernels for Hopper, GPU only: one-pass row+column quantisation
(:mod:`aligndp.lowp.triton_quantize`) and block-scaled GEMMs that accumulate in place
(:mod:`aligndp.lowp.triton_gemm`), on the operands of :mod:`aligndp.lowp.triton_common`.
Imported only by :mod:`aligndp.lowp.triton_backend`, tests and benchmarks; this module names
the kernels' public entry points in one place.
"""

from aligndp.lowp.triton_common import QuantizedOperand
from aligndp.lowp.triton_gemm import dequantize_operand, scaled_gemm
from aligndp.lowp.triton_quantize import quantize_rows_and_columns

__all__ = ["QuantizedOperand", "dequantize_operand", "quantize_rows_and_columns", "scaled_gemm"]
