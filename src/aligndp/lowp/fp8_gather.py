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
take it until the weight changes. Its bytes, transpose and scale live in storage the next
gather rewrites (after the optimizer step, when the step's backwards are done), like the
``gather_data`` the bytes are gathered into.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn as nn

from aligndp.lowp.linear import MXLinear
from aligndp.lowp.recipe_fp8_tensor import RECIPE, Quantized, cast_e4m3, scale_of

__all__ = ["Fp8TensorGatherCodec", "fp8_gathered_weights"]


class _CudaOperands(NamedTuple):
    transposes: list[torch.Tensor]
    """Each weight's transposed FP8 bytes (the dgrad GEMM's operand)."""
    slots: torch.Tensor
    """float32 scales, ``SCALE_STRIDE`` apart (cuBLASLt wants a scale pointer of its own)."""
    scales: list[torch.Tensor]
    """The 0-d view of each weight's slot, as its layer takes it."""


class Fp8TensorGatherCodec:
    """:class:`~aligndp.runtime.gather_codec.GatherCodec` of the ``fp8-tensor`` recipe for the
    converted layers of ``model``. On CUDA a bucket's encode and its finish are one launch
    each ([Note: one launch per bucket] in fp8_gather_kernels.py); elsewhere torch ops, a
    weight at a time, with the same bits."""

    name = RECIPE.name
    dtype = torch.float8_e4m3fn

    def __init__(self, model: nn.Module) -> None:
        self._layers = {id(m.weight): m for m in _fp8_tensor_layers(model)}
        """id(weight) -> its layer (ids: a pending param's hash would wait for its gather)."""
        self._operands: dict[tuple[int, ...], _CudaOperands] = {}
        """CUDA: what a bucket's finish writes besides ``param_data``, by the bucket's gathered
        bytes' addresses: made once, rewritten by every gather."""

    def scales(self, amax: torch.Tensor, *, out: torch.Tensor) -> None:
        out.copy_(scale_of(amax))

    def encode(
        self,
        values: list[torch.Tensor],
        scales: torch.Tensor,
        index: list[int],
        outs: list[torch.Tensor],
    ) -> None:
        if scales.is_cuda and all(v.dtype == torch.float32 for v in values):
            from aligndp.lowp import fp8_gather_kernels

            fp8_gather_kernels.encode(values, scales, index, outs)
            return
        for v, k, out in zip(values, index, outs):
            cast_e4m3(v, scales[k], out=out)

    def decode(self, data: torch.Tensor, scale: torch.Tensor, *, out: torch.Tensor) -> None:
        torch.mul(data.float(), scale, out=out)  # float32 product, rounded once to out's dtype

    def finish(
        self,
        params: tuple[nn.Parameter, ...],
        datas: list[torch.Tensor],
        scales: torch.Tensor,
        outs: list[torch.Tensor],
    ) -> None:
        if scales.is_cuda:
            from aligndp.lowp import fp8_gather_kernels

            made = self._cuda_operands(datas)
            fp8_gather_kernels.decode(datas, scales, outs, made.transposes, made.slots)
            for param, data, scale, data_t in zip(params, datas, made.scales, made.transposes):
                self._publish(param, data, scale, data_t)
            return
        for param, data, scale, out in zip(params, datas, scales, outs):
            self.decode(data, scale, out=out)
            # a scale of its own: cuBLASLt refuses (CUBLAS_STATUS_NOT_SUPPORTED, H200) a scale
            # pointer 4 bytes into an array, which ``scale`` is
            self._publish(param, data, scale.clone(), data.t().contiguous())

    def _publish(self, param, data, scale, data_t) -> None:
        layer = self._layers.get(id(param))
        if layer is not None and layer.cache_weight:
            layer.set_quantised_weight(Quantized(data, scale, data_t))

    def _cuda_operands(self, datas: list[torch.Tensor]) -> _CudaOperands:
        key = tuple(d.data_ptr() for d in datas)
        made = self._operands.get(key)
        if made is None:
            from aligndp.lowp.fp8_gather_kernels import SCALE_STRIDE

            device = datas[0].device
            transposes = [torch.empty(d.shape[::-1], dtype=d.dtype, device=device) for d in datas]
            slots = torch.zeros(len(datas) * SCALE_STRIDE, dtype=torch.float32, device=device)
            scales = [slots[i * SCALE_STRIDE] for i in range(len(datas))]
            made = self._operands[key] = _CudaOperands(transposes, slots, scales)
        return made


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
