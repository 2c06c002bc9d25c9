"""The ``fp8-tensor`` recipe's param all-gather codec ([Note: FP8 param gather] in
aligndp/runtime/gather_codec.py): FP8 E4M3 bytes and one float32 scale per weight, the
recipe's own quantisation, and the weights it applies to.

Only the per-tensor recipe can gather its weights in FP8 and use them as they arrive: its
one scale per tensor serves the forward GEMM and, transposed, the dgrad GEMM. A blockwise
recipe (``fp8`` 1x128, ``mxfp8``) scales blocks along the contraction dim of each GEMM,
which differs between the forward and the dgrad, so one gathered payload cannot feed both.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from aligndp.lowp.linear import MXLinear
from aligndp.lowp.recipe_fp8_tensor import RECIPE, cast_e4m3, publish_weight, scale_of

__all__ = ["Fp8TensorGatherCodec", "fp8_gathered_weights"]


class Fp8TensorGatherCodec:
    """:class:`~aligndp.runtime.gather_codec.GatherCodec` of the ``fp8-tensor`` recipe."""

    name = RECIPE.name
    dtype = torch.float8_e4m3fn

    def scales(self, amax: torch.Tensor) -> torch.Tensor:
        return scale_of(amax)

    def encode(self, values: torch.Tensor, scale: torch.Tensor, *, out: torch.Tensor) -> None:
        cast_e4m3(values, scale, out=out)

    def decode(self, data: torch.Tensor, scale: torch.Tensor, *, out: torch.Tensor) -> None:
        torch.mul(data.float(), scale, out=out)  # float32 product, rounded once to out's dtype

    def publish(self, param: nn.Parameter, data: torch.Tensor, scale: torch.Tensor) -> None:
        publish_weight(param, data, scale)


def fp8_gathered_weights(model: nn.Module) -> list[str]:
    """Names (as ``named_parameters`` gives them) of the trainable weights of ``model``'s
    layers converted to the ``fp8-tensor`` recipe: what ``fp8_param_gather`` gathers in FP8."""
    converted = {
        id(m.weight)
        for m in model.modules()
        if isinstance(m, MXLinear) and m.backend.recipe.name == RECIPE.name
    }
    return [n for n, p in model.named_parameters() if p.requires_grad and id(p) in converted]
