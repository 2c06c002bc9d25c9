"""Low-precision param all-gathers: the codec a recipe implements, and the per-bucket
encode -> gather -> decode that :class:`~aligndp.runtime.param_gather.ParamGather` runs for
buffers planned with a ``gather_dtype``.

[Note: FP8 param gather]
``parallelize(fp8_param_gather=True)`` (Megatron's ``--fp8-param-gather``) gathers the weights
of layers converted to the ``fp8-tensor`` recipe as FP8 bytes plus one float32 scale per
weight, half the bytes of a bf16 gather and a quarter of fp32's. Per-tensor scales make this
exact: the bytes the forward GEMM reads are the bytes the gather moved, and their transpose
serves the dgrad GEMM. Those weights are planned in buffers of their own
(``PlanRequest.gather_dtypes``; the same planner, so [Note: alignment contract] and
``validate()`` hold, in 1-byte items too), with a second, 1-byte buffer ``gather_data`` of the
same geometry; every other param gathers as before. Per bucket, after the optimizer step:

1. each rank takes the amax of its owned piece of every weight of the bucket (0 where it owns
   none), read from the piece's *source*: the fp32 master its optimizer part keeps for it,
   handed to each launch by the optimizer (``Sources``; every such weight has one, even an
   fp32 param, since ``param_data`` is about to hold the decoded value; the model holds no
   reference to the optimizer's tensors);
2. one small all-gather of those amaxes (``dp_size x weights`` float32) and a max over ranks
   give every rank every weight's amax over the whole tensor: a ZeRO-1 piece is quantised
   with the scale of its whole param, and a layer-wise owner's scale reaches every rank;
3. the codec quantises each owned piece with its weight's scale into ``gather_data``, and the
   all-gather moves ``gather_data``'s bucket (uint8: gloo has no float8);
4. once waited for, every rank decodes each weight into ``param_data`` (so every read of the
   param — ``state_dict()``, an EMA, evaluation — sees the same value on every rank: the value
   the GEMM used) and the codec *publishes* the FP8 bytes and scale to the weight's layer,
   which takes them as its forward operand instead of quantising the weight again (the
   layer's quantised-weight cache, [Note: weights once per step] in aligndp/lowp/linear.py,
   keyed on the gathers launched so far: so decoding waits for the wait, even at dp 1).

The runtime knows no recipe: :class:`GatherCodec` is implemented in ``lowp/``
(aligndp/lowp/fp8_gather.py) and handed over by ``parallelize`` (the api layer). Masters stay
fp32 on their owner and checkpoints save them ([Note: master weights] in optim/sharded.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Protocol

import torch
import torch.nn as nn

from aligndp.plan.slots import BufferLayout
from aligndp.runtime.collectives import Collectives, Work
from aligndp.runtime.step_state import BucketRef, ParamIndex

__all__ = ["GatherCodec", "CodedGather", "Sources", "check_codec", "coded_gather"]

Sources = Mapping[int, torch.Tensor]
"""id(param) -> the full-precision values of this rank's piece of it (1-D: its optimizer
part's master), what an FP8 gather encodes; a param without one encodes its ``param_data``."""


class GatherCodec(Protocol):
    """How a low-precision param all-gather encodes an owner's pieces and decodes the result
    ([Note: FP8 param gather]); one scale per param, taken from its amax over the whole param.
    Encode and finish take a whole bucket, so a codec can do each in one launch."""

    name: str
    """Named in errors and reports, e.g. ``"fp8-tensor"``."""
    dtype: torch.dtype
    """The 1-byte element type the gather moves, e.g. ``torch.float8_e4m3fn``."""

    def scales(self, amax: torch.Tensor, *, out: torch.Tensor) -> None:
        """``out`` = float32 scales, one per param, from float32 amaxes over whole params."""
        ...

    def encode(
        self,
        values: list[torch.Tensor],
        scales: torch.Tensor,
        index: list[int],
        outs: list[torch.Tensor],
    ) -> None:
        """Quantise each 1-D ``values[j]`` with the scale ``scales[index[j]]`` into ``outs[j]``
        (same length, :attr:`dtype`)."""
        ...

    def decode(self, data: torch.Tensor, scale: torch.Tensor, *, out: torch.Tensor) -> None:
        """``out`` (1-D, the param dtype) = ``data`` (1-D, :attr:`dtype`) dequantised."""
        ...

    def finish(
        self,
        params: tuple[nn.Parameter, ...],
        datas: list[torch.Tensor],
        scales: torch.Tensor,
        outs: list[torch.Tensor],
    ) -> None:
        """For every ``params[i]``: :meth:`decode` ``datas[i]`` (its gathered bytes, the
        param's shape) with ``scales[i]`` into ``outs[i]`` (its ``param_data`` view, its
        shape), and hand its layer the gathered operand, valid until the param is written
        again."""
        ...


def check_codec(layouts: list[BufferLayout], codec: GatherCodec | None) -> None:
    """A plan that gathers some params in a low-precision dtype needs a codec of that dtype."""
    wanted = {lo.gather_dtype for lo in layouts if lo.gather_dtype is not None}
    if wanted and (codec is None or wanted != {codec.dtype}):
        raise ValueError(
            f"the plan gathers params as {sorted(map(str, wanted))} but the gather codec is "
            f"{'missing' if codec is None else f'{codec.name} ({codec.dtype})'}: build the "
            "model with aligndp.parallelize(fp8_param_gather=True), which brings both"
        )


class _Done:
    """The Work of a gather with nothing to move (``dp_size == 1``)."""

    def wait(self) -> None:
        return None


_DONE = _Done()


@dataclasses.dataclass
class _Bucket:
    params: tuple[nn.Parameter, ...]
    amax: torch.Tensor
    """``(dp_size * len(params),)`` float32: rank r's amaxes in shard r."""
    scales: torch.Tensor
    """``(len(params),)`` float32: the scales of the last gather, rewritten by the next."""
    mine: list[int]
    """Indices of the params this rank owns a piece of."""
    mine_index: torch.Tensor
    """The same on the bucket's device (a list index would copy from the host, and wait)."""
    encoded: list[torch.Tensor]
    """Those pieces' places in ``gather_data`` (the codec's dtype)."""
    datas: list[torch.Tensor]
    """Every param's gathered bytes (its shape, the codec's dtype)."""
    values: list[torch.Tensor]
    """Every param's ``param_data`` view (its shape)."""
    gathered: bool = False
    """Whether a gather has set ``scales``."""


class CodedGather:
    """Steps 1-4 of [Note: FP8 param gather] for every bucket of ``index`` whose buffer has a
    ``gather_data``, through ``codec``."""

    def __init__(self, index: ParamIndex, *, codec: GatherCodec, collectives: Collectives):
        self.index, self.codec, self.collectives = index, codec, collectives
        self.rank, self.dp_size = collectives.rank, collectives.dp_size
        self._slot = index.by_id
        self.buckets: dict[BucketRef, _Bucket] = {}
        for ref in index.refs:
            buf = index.buffer(ref)
            if buf.gather_data is not None:
                self.buckets[ref] = self._bucket(ref, index.members[ref])

    def _bucket(self, ref: BucketRef, params: tuple[nn.Parameter, ...]) -> _Bucket:
        buf = self.index.buffer(ref)
        data = buf.gather_data.view(self.codec.dtype)
        slots = [self._slot[id(p)] for p in params]
        mine = [i for i, s in enumerate(slots) if s.owned.numel]
        amax = self.collectives.allocate(
            self.dp_size * len(params), dtype=torch.float32, device=buf.device, align_bytes=16
        ).zero_()
        return _Bucket(
            params,
            amax,
            scales=torch.zeros(len(params), dtype=torch.float32, device=buf.device),
            mine=mine,
            mine_index=torch.tensor(mine, dtype=torch.int64).to(buf.device),
            encoded=[data[slots[i].owned.start : slots[i].owned.end] for i in mine],
            datas=[data[s.slot.start : s.slot.end].view(s.slot.shape) for s in slots],
            values=[buf.param_data[s.slot.start : s.slot.end].view(s.slot.shape) for s in slots],
        )

    def handles(self, param: nn.Parameter) -> bool:
        """Whether ``param`` is gathered through the codec."""
        slot = self._slot.get(id(param))
        return slot is not None and slot.ref in self.buckets

    def _piece(self, param: nn.Parameter, sources: Sources) -> torch.Tensor:
        slot = self._slot[id(param)]
        source = sources.get(id(param))
        if source is not None:
            assert source.numel() == slot.owned.numel, "a source is the owned piece"
            return source
        return self.index.buffer(slot.ref).param_data[slot.owned.start : slot.owned.end]

    def launch(self, ref: BucketRef, sources: Sources) -> Work:
        """Encode this rank's pieces of bucket ``ref`` from ``sources`` and start its
        all-gather (none at ``dp_size == 1``); the Work to wait for, then :meth:`finish`."""
        bucket, buf = self.buckets[ref], self.index.buffer(ref)
        local = bucket.amax.view(self.dp_size, -1)[self.rank]
        pieces = [self._piece(bucket.params[i], sources) for i in bucket.mine]
        local.zero_()
        if pieces:
            norms = torch.stack(torch._foreach_norm(pieces, float("inf")))
            local.index_copy_(0, bucket.mine_index, norms.float())
        if self.dp_size > 1:  # every weight's amax over every rank's piece
            self.collectives.all_gather_shards(bucket.amax).wait()
        self.codec.scales(bucket.amax.view(self.dp_size, -1).amax(0), out=bucket.scales)
        bucket.gathered = True
        if pieces:
            self.codec.encode(pieces, bucket.scales, bucket.mine, bucket.encoded)
        if self.dp_size > 1:
            return self.collectives.all_gather_shards(buf.bucket_gather(ref.bucket))
        return _DONE

    def finish(self, ref: BucketRef) -> None:
        """After the gather: decode every param of ``ref`` into ``param_data`` and hand its
        layer the gathered bytes and scale."""
        bucket = self.buckets[ref]
        self.codec.finish(bucket.params, bucket.datas, bucket.scales, bucket.values)

    def decoded(self, param: nn.Parameter) -> torch.Tensor | None:
        """The flat value the last gather wrote into ``param`` (None: not coded, or no gather
        yet); what an optimizer compares the param with to see whether the user wrote it."""
        slot = self._slot.get(id(param))
        bucket = self.buckets.get(slot.ref) if slot is not None else None
        if bucket is None or not bucket.gathered:
            return None
        i = next(k for k, p in enumerate(bucket.params) if p is param)
        buf = self.index.buffer(slot.ref)
        s = slot.slot
        out = torch.empty(s.numel, dtype=buf.layout.param_dtype, device=buf.device)
        data = buf.gather_data[s.start : s.end].view(self.codec.dtype)
        self.codec.decode(data, bucket.scales[i], out=out)
        return out


def coded_gather(
    index: ParamIndex, codec: GatherCodec | None, *, collectives: Collectives
) -> CodedGather | None:
    """The :class:`CodedGather` of ``index``'s buffers planned with a ``gather_dtype`` (None
    without a codec), after :func:`check_codec`."""
    check_codec([buf.layout for buf in index.buffers], codec)
    return None if codec is None else CodedGather(index, codec=codec, collectives=collectives)
