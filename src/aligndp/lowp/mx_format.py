"""MXFP8 (OCP Microscaling v1.0) quantisation as small pure functions.

[Note: MXFP8 format]
A block of ``block_size`` (32) consecutive elements along one dim shares one E8M0 scale
``X = 2**e`` (a bare biased exponent: byte 127 is 2**0, byte 0 is 2**-127, byte 255 is NaN).
Following the OCP MX v1.0 spec, section 6.3::

    e = floor(log2(amax(|block|))) - emax_elem      (emax_elem: 8 for E4M3, 15 for E5M2)
    e = clamp(e, -127, 127)
    element = saturate(round_to_nearest_even(v / X))  (to +-448 for E4M3, +-57344 for E5M2)

With this FLOOR rule the largest element of a block lands in ``[2**emax, 2**(emax+1))``,
so values above the element type's max (448 for E4M3) saturate; that is the spec's choice.

Reference: torchao 0.18.0 ``torchao.prototype.mx_formats.mx_tensor.to_mx`` (FLOOR mode).
We match it bit for bit on every block whose amax is finite and >= ``2**(emax - 126)``
(2**-118 for E4M3, 2**-111 for E5M2). Deliberate differences, each pinned by a test:

* **Tiny blocks** (scale byte 0, i.e. ``X = 2**-127``): torchao divides the elements by
  ``2**-126`` (it clamps its fp32 scale to the smallest normal) but stores byte 0, which its
  own dequantiser reads as ``2**-127``, so its round trip is off by a factor of two. We divide
  by the ``2**-127`` we store (computed as a multiply by ``2**127``, which is normal).
* **Infinities**: torchao saturates ``+-inf`` to ``+-max`` with a scale of ``2**120``
  (E4M3), silently turning an overflow into a finite gradient. The spec makes the scale NaN
  when ``log2(amax)`` exceeds the scale range, so a block holding an infinity gets scale byte
  255 (NaN) here, exactly as a block holding a NaN does; its elements are encoded as
  ``v * 0`` (0 for finite, NaN for inf/NaN) and dequantise to NaN.

NaN blocks match torchao: scale byte 255, finite elements 0, NaN elements NaN.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

__all__ = [
    "MXTensor",
    "ElementFormat",
    "ELEMENT_FORMATS",
    "MXFormatTypeError",
    "quantize_mxfp8",
    "mx_blocks",
    "dequantize_mxfp8",
    "shared_exponent",
    "padded_length",
]

_E8M0_BIAS = 127
_E8M0_NAN = 255
_F32_MANTISSA_BITS = 23


class ElementFormat(NamedTuple):
    """What the shared-exponent rule needs to know about an MXFP8 element type."""

    dtype: torch.dtype
    emax: int
    """Exponent of the largest power of two the element type can hold (spec's emax_elem)."""
    max: float
    """Largest finite magnitude; larger values saturate to it."""


ELEMENT_FORMATS: dict[torch.dtype, ElementFormat] = {
    torch.float8_e4m3fn: ElementFormat(torch.float8_e4m3fn, 8, 448.0),
    torch.float8_e5m2: ElementFormat(torch.float8_e5m2, 15, 57344.0),
}

_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class MXFormatTypeError(TypeError, ValueError):
    """Input of the wrong type or dtype. A ValueError too, so callers catching either work."""


class MXTensor(NamedTuple):
    """One tensor in MXFP8: ``dequantize_mxfp8`` of it approximates the original.

    ``data`` has the original shape; ``scale`` has it too except along the quantised dim,
    which is ``block_size`` times shorter. Both are contiguous.
    """

    data: torch.Tensor
    """float8_e4m3fn or float8_e5m2 elements."""
    scale: torch.Tensor
    """float8_e8m0fnu shared exponents, one per block."""


def _element_format(elem_dtype: torch.dtype) -> ElementFormat:
    try:
        return ELEMENT_FORMATS[elem_dtype]
    except (KeyError, TypeError):
        choices = ", ".join(str(d) for d in ELEMENT_FORMATS)
        raise MXFormatTypeError(
            f"elem_dtype={elem_dtype!r} is not an MXFP8 element type; use one of {choices}"
        ) from None


def padded_length(length: int, block_size: int = 32) -> int:
    """Smallest multiple of ``block_size`` that is >= ``length`` (what to zero-pad a dim to)."""
    return math.ceil(length / block_size) * block_size


def _check_input(x: torch.Tensor, dim: int, block_size: int) -> int:
    """Validate ``quantize_mxfp8`` arguments; return ``dim`` as a non-negative index."""
    if not isinstance(x, torch.Tensor):
        raise MXFormatTypeError(f"expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _INPUT_DTYPES:
        raise MXFormatTypeError(
            f"cannot quantise a {x.dtype} tensor to MXFP8: expected float32, bfloat16 or float16; "
            "convert it first, e.g. x.float()"
        )
    if x.ndim == 0:
        raise ValueError(
            "cannot quantise a 0-d tensor to MXFP8: blocks need a dim; use x.reshape(1, -1) "
            "padded to 32"
        )
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise ValueError(
            f"block_size must be a positive integer (the OCP MX spec uses 32), got {block_size!r}"
        )
    if not -x.ndim <= dim < x.ndim:
        raise ValueError(
            f"dim={dim} is out of range for a {x.ndim}-d tensor of shape {tuple(x.shape)}"
        )
    dim %= x.ndim
    length = x.shape[dim]
    if length % block_size:
        padded = padded_length(length, block_size)
        raise ValueError(
            f"dim {dim} of shape {tuple(x.shape)} has length {length}, not a multiple of "
            f"block_size={block_size}; pad it with zeros to {padded} (zeros never raise a "
            "block's scale)"
        )
    return dim


def shared_exponent(amax: torch.Tensor, fmt: ElementFormat) -> torch.Tensor:
    """Biased E8M0 scale bytes (uint8) for block maxima ``amax`` (float32, >= 0 or NaN).

    ``floor(log2(amax))`` is read from the float32 exponent field, which is exact for normal
    numbers; zero and subnormal amax read as -127, which the clamp below maps to the smallest
    scale anyway. Non-finite amax (inf or NaN) gives the NaN byte 255.
    """
    exponent = ((amax.view(torch.int32) >> _F32_MANTISSA_BITS) & 0xFF) - _E8M0_BIAS
    unbiased = torch.clamp(exponent - fmt.emax, -_E8M0_BIAS, _E8M0_BIAS)
    biased = (unbiased + _E8M0_BIAS).to(torch.uint8)
    return torch.where(torch.isfinite(amax), biased, torch.full_like(biased, _E8M0_NAN))


def _inverse_scale(biased: torch.Tensor) -> torch.Tensor:
    """``2**-(byte - 127)`` as float32, built from exponent bits so it is exact.

    Bytes 0..254 give 2**127 .. 2**-127; a reachable byte is at most 127 + 127 - emax, so
    the result is always a normal float32. Byte 255 (NaN blocks) gives 0 and is overridden.
    """
    exponent_bits = (2 * _E8M0_BIAS - biased.to(torch.int32)).clamp(min=1, max=254)
    return (exponent_bits << _F32_MANTISSA_BITS).view(torch.float32)


def quantize_mxfp8(
    x: torch.Tensor,
    *,
    dim: int = -1,
    block_size: int = 32,
    elem_dtype: torch.dtype = torch.float8_e4m3fn,
) -> MXTensor:
    """Quantise ``x`` to MXFP8 in blocks of ``block_size`` consecutive elements along ``dim``.

    See [Note: MXFP8 format] for the rule and where it differs from torchao. Quantise along
    the contraction dim of the GEMM that consumes the result (tokens for a wgrad GEMM).
    """
    dim = _check_input(x, dim, block_size)
    data, scale = mx_blocks(x.movedim(dim, -1), block_size, elem_dtype)
    scale = scale.view(torch.float8_e8m0fnu)
    return MXTensor(data.movedim(-1, dim).contiguous(), scale.movedim(-1, dim).contiguous())


def mx_blocks(
    x: torch.Tensor, block_size: int, elem_dtype: torch.dtype = torch.float8_e4m3fn
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule of :func:`quantize_mxfp8` along the last dim of ``x`` (a multiple of
    ``block_size``, unchecked): ``(data, scale_bytes)``, data ``(..., N)`` in ``elem_dtype`` and
    the biased E8M0 exponents ``(..., N / block_size)`` as uint8. Plain torch ops, so a
    compiled graph can fuse them into the kernel producing ``x``."""
    fmt = _element_format(elem_dtype)
    values = x.to(torch.float32)
    blocks = values.reshape(
        *values.shape[:-1], values.shape[-1] // block_size, block_size
    )  # (..., nb, bs)
    amax = blocks.abs().amax(dim=-1, keepdim=True)  # NaN if the block holds a NaN
    biased = shared_exponent(amax, fmt)
    finite = biased != _E8M0_NAN
    scaled = torch.where(finite, blocks * _inverse_scale(biased), blocks * 0.0)
    data = scaled.clamp(-fmt.max, fmt.max).to(fmt.dtype).reshape(values.shape)
    return data, biased.squeeze(-1)


def dequantize_mxfp8(
    mx: MXTensor,
    *,
    dim: int = -1,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The values ``mx`` stands for, ``data * 2**(scale - 127)``, as ``dtype``.

    The block size is read from the shapes; NaN scales give NaN blocks. Computed in float32,
    where every product of an MXFP8 element and scale is exact (bar results below 2**-149).
    """
    data, scale = mx
    if data.dtype not in ELEMENT_FORMATS or scale.dtype != torch.float8_e8m0fnu:
        raise MXFormatTypeError(
            "expected MXFP8 data (float8_e4m3fn/float8_e5m2) and float8_e8m0fnu scales, got "
            f"{data.dtype} and {scale.dtype}; build the pair with quantize_mxfp8"
        )
    if not -data.ndim <= dim < data.ndim:
        raise ValueError(f"dim={dim} is out of range for MXFP8 data of shape {tuple(data.shape)}")
    dim %= data.ndim
    expected = list(data.shape)
    blocks = scale.shape[dim] if scale.ndim == data.ndim else 0
    if blocks:
        expected[dim] = blocks
    if scale.ndim != data.ndim or list(scale.shape) != expected or data.shape[dim] % blocks:
        raise ValueError(
            f"scale shape {tuple(scale.shape)} does not fit data shape {tuple(data.shape)} along "
            f"dim {dim}: expected the data shape with that dim divided by the block size; pass the "
            "dim used to quantise"
        )
    block_size = data.shape[dim] // blocks
    values = data.to(torch.float32) * scale.to(torch.float32).repeat_interleave(block_size, dim=dim)
    return values.to(dtype)
