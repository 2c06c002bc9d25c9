"""The ``fp8-tensor`` recipe's param all-gather codec ([Note: FP8 param gather] in
aligndp/runtime/gather_codec.py): FP8 E4M3 bytes and one float32 scale per weight, the
recipe's own quantisation, and the weights it applies to.

Only the per-tensor recipe can gather its weights in FP8 and use them as they arrive: its
one scale per tensor serves the forward GEMM and, transposed, the dgrad GEMM. A blockwise
recipe (``fp8`` 1x128, ``mxfp8``) scales blocks along the contraction dim of each GEMM,
which differs between the forward and the dgrad, so one gathered payload cannot feed both.
A gathered weight is handed to its layer's quantised-weight cache
(:meth:`~aligndp.lowp.linear.MXLinear.set_quantised_weight`, [Note: weights once per step] in
linear.py), in the form the recipe's own ``quantize_weight`` gives (both layouts), so forwards
take it until the weight changes.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from aligndp.lowp.linear import MXLinear
from aligndp.lowp.recipe_fp8_tensor import RECIPE, Quantized, cast_e4m3, scale_of

__all__ = ["Fp8TensorGatherCodec", "fp8_gathered_weights"]


class Fp8TensorGatherCodec:
    """:class:`~aligndp.runtime.gather_codec.GatherCodec` of the ``fp8-tensor`` recipe for the
    converted layers of ``model``."""

    name = RECIPE.name
    dtype = torch.float8_e4m3fn

    def __init__(self, model: nn.Module) -> None:
        self._layers = {id(m.weight): m for m in _fp8_tensor_layers(model)}
        """id(weight) -> its layer (ids: a pending param's hash would wait for its gather)."""

    def scales(self, amax: torch.Tensor) -> torch.Tensor:
        return scale_of(amax)

    def encode(self, values: torch.Tensor, scale: torch.Tensor, *, out: torch.Tensor) -> None:
        cast_e4m3(values, scale, out=out)

    def decode(self, data: torch.Tensor, scale: torch.Tensor, *, out: torch.Tensor) -> None:
        torch.mul(data.float(), scale, out=out)  # float32 product, rounded once to out's dtype

    def publish(self, param: nn.Parameter, data: torch.Tensor, scale: torch.Tensor) -> None:
        layer = self._layers.get(id(param))
        if layer is not None and layer.cache_weight:
            # the scale gets storage of its own: cuBLASLt refuses (CUBLAS_STATUS_NOT_SUPPORTED,
            # H200) a scale pointer 4 bytes into the bucket's scales, which ``scale`` is
            scale = scale.clone()
            layer.set_quantised_weight(Quantized(data, scale, data.t().contiguous()))


def _fp8_tensor_layers(model: nn.Module) -> list[MXLinear]:
    return [
        m
        for m in model.modules()
        if isinstance(m, MXLinear) and m.backend.recipe.name == RECIPE.name
    ]


def fp8_gathered_weights(model: nn.Module) -> list[str]:
    """Names (as ``named_parameters`` gives them) of the trainable weights of ``model``'s
    layers converted to the ``fp8-tensor`` recipe: what ``fp8_param_gather`` gathers in FP8."""
    converted = {id(m.weight) for m in _fp8_tensor_layers(model)}
    return [n for n, p in model.named_parameters() if p.requires_grad and id(p) in converted]
