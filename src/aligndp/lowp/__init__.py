"""MXFP8 training: the format, a drop-in ``nn.Linear`` and its GEMM backends.

Importing this package never imports Triton; the GPU backends load it on first use.
"""

from aligndp.lowp.backends import WgradBackend, get_backend
from aligndp.lowp.linear import MXLinear, convert_to_mxfp8
from aligndp.lowp.mx_format import MXTensor, dequantize_mxfp8, quantize_mxfp8

__all__ = [
    "MXTensor",
    "quantize_mxfp8",
    "dequantize_mxfp8",
    "MXLinear",
    "convert_to_mxfp8",
    "WgradBackend",
    "get_backend",
]
