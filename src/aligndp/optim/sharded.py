"""ZeRO-1: torch's own elementwise optimizer stepping only this rank's slices of sharded buffers.

Rank r owns slice r of every bucket of a sharded buffer; its share of one param is an
:class:`~aligndp.plan.slots.OwnedPiece` (``layout.owned_pieces(rank)``, [Note: owned pieces]
in DESIGN.md). Padding is never stepped — only real elements are in pieces — so over all
ranks the pieces partition the real elements of every buffer exactly once, which is also
what lets a checkpoint write each element once (aligndp/state/checkpoint.py).

Each piece gets a master tensor the torch optimizer steps ([Note: master weights]): for
fp32 params, and for every param with ``master_weights=False``, the master *is* the
``param_data`` view (no copy, no cast back); for 16-bit params with ``master_weights=True``
(the default of ``sharding="zero1"``) it is a view of one fp32 flat tensor per buffer, cast
back into ``param_data`` after every step. Gradients are the reduce-scattered ``grad_data``
views, cast to the master's dtype only where the grad buffer's dtype differs.

[Note: master weights]
``parallelize(master_weights=...)``: True keeps an fp32 master of every 16-bit param on its
owner (ZeRO-1's classic recipe: the update is computed and accumulated in fp32, at the cost
of 4 more bytes per element, fp32 optimizer state and two casts per step); False steps every
param in its own dtype, as ``sharding="none"`` does and as torch DDP + a torch optimizer on a
bf16 model do (state in the param dtype), so switching sharding keeps the numerics. One
predicate, :func:`keeps_fp32_master`, decides it for :class:`ShardedPart` and for
:class:`~aligndp.optim.whole_matrix.WholeMatrixPart` alike. Checkpoints hold fp32 values
either way ([Note: model-space state]), so a run resumes under the other setting. A param
gathered in FP8 ([Note: FP8 param gather] in aligndp/runtime/gather_codec.py) always has a
separate fp32 master, even an fp32 param (``param_data`` receives the decoded gather): the
gather encodes from it, and nothing is cast back.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from aligndp.optim.base import is_elementwise, resolve_optimizer_class
from aligndp.optim.composite import BucketStepped, CompositeOptimizer, OptimizerPart
from aligndp.optim.groups import ParamGroup
from aligndp.plan.slots import OwnedPiece
from aligndp.plan.spec import Mode
from aligndp.runtime.buffer import FlatBuffer
from aligndp.runtime.ddp import DataParallel
from aligndp.runtime.gather_codec import Sources
from aligndp.runtime.grads import ShardedGrad
from aligndp.runtime.step_state import ReducedGrads
from aligndp.state.model_space import (
    FlatPiece,
    model_space_to_torch_state,
    torch_state_to_model_space,
)

__all__ = [
    "check_elementwise",
    "keeps_fp32_master",
    "ShardedPart",
    "ShardedOptimizer",
]


def check_elementwise(opt_class: type[torch.optim.Optimizer], options: dict | None = None) -> None:
    """Refuse optimizers whose update of one element depends on other elements (e.g. Muon).

    ZeRO-1 steps arbitrary slices that cut params apart; only elementwise updates are exact
    there. Decided by :func:`aligndp.optim.base.is_elementwise` (a probe), for any class.
    """
    if isinstance(opt_class, str):
        opt_class = resolve_optimizer_class(opt_class)
    if not is_elementwise(opt_class, dict(options or {})):
        name = getattr(opt_class, "__name__", repr(opt_class))
        raise ValueError(
            "sharding='zero1' steps arbitrary slices of params, which is exact only for "
            "optimizers whose update "
            f"of an element depends on that element alone; {name} with these options is not one "
            "(stepping a 4x6 "
            "tensor whole and cut in two pieces gave different values). For whole-tensor "
            "optimizers such as "
            "Muon use the layer-wise mode: optimizer='muon', or register yours with "
            "aligndp.register_whole_matrix(name, spec) (every matrix whole on one rank); or "
            "sharding='none'"
        )


def keeps_fp32_master(param_dtype: torch.dtype, *, master_weights: bool) -> bool:
    """True when a param of ``param_dtype`` is stepped through a separate fp32 master copy
    ([Note: master weights]); False: the optimizer steps the param's own storage."""
    return master_weights and param_dtype != torch.float32


@dataclasses.dataclass
class _Master:
    """What the optimizer steps for one owned piece: its master, bound to the param it belongs
    to and its buffer (the piece itself is plain data: :class:`~aligndp.plan.slots.OwnedPiece`)."""

    piece: OwnedPiece
    param: torch.nn.Parameter
    buffer: FlatBuffer
    master: torch.Tensor
    cast_back: bool
    """True when the master is a separate fp32 copy (16-bit params with master_weights, and
    FP8-gathered params), False when it is the param_data view."""
    group: int
    coded: bool = False
    """Gathered in FP8: the gather encodes the master and decodes into ``param_data``, so the
    step does not cast it back."""
    sharded_grad: ShardedGrad = dataclasses.field(init=False)
    """The master's ``.grad`` between a reduction and the step (made once: it is immutable)."""
    owned_grad: torch.Tensor | None = None
    """The owned slice of the reduced gradient (a view of the grad buffer, which is never
    reallocated), taken from the first :class:`ReducedGrads` and kept."""

    def __post_init__(self) -> None:
        self.sharded_grad = ShardedGrad(self.master)


def refresh_master(
    master: torch.Tensor, param: torch.Tensor, written: torch.Tensor | None = None
) -> None:
    """``master`` (fp32) takes ``param``'s value wherever the param differs from what the step
    last wrote into it: ``written`` (an FP8 gather's decoded value) or the master's cast."""
    written = master.to(param.dtype) if written is None else written
    master.copy_(torch.where(param == written, master, param.float()))


class ShardedPart(OptimizerPart):
    """ZeRO-1 over ``buffers`` (sharded :class:`FlatBuffer` s of ``model``): a part of a
    :class:`~aligndp.optim.composite.CompositeOptimizer`.

    The inner torch optimizer steps this rank's masters, one torch param group per
    :class:`~aligndp.optim.groups.ParamGroup` (a group this rank owns nothing of gets a
    grad-less zero-size placeholder, so ``param_groups`` match on every rank).
    ``master_weights``: fp32 masters for 16-bit params (True) or each param stepped in its own
    dtype (False) ([Note: master weights]).
    """

    elementwise_state = True  # [Note: model-space state]: state shaped like a piece is per-element

    def __init__(
        self,
        model: DataParallel,
        buffers: Sequence[FlatBuffer],
        opt_class: type[torch.optim.Optimizer] = torch.optim.AdamW,
        *,
        groups: Sequence[ParamGroup] | None = None,
        master_weights: bool = True,
        **optimizer_kwargs,
    ) -> None:
        for buf in buffers:
            if buf.layout.mode is not Mode.SHARDED or buf.param_data is None:
                raise ValueError(
                    f"ShardedPart steps sharded buffers only, got a {buf.layout.mode.value} buffer"
                )
        self.model = model
        self.rank, self.dp_size = model.rank, model.dp_size
        self.master_weights = master_weights
        self.buffers = list(buffers)
        self.names = [s.name for b in self.buffers for s in sorted(b.slots, key=lambda s: s.index)]
        if groups is None:
            groups = [ParamGroup(tuple(self.names), {})]
        group_of = {n: i for i, g in enumerate(groups) for n in g.names}
        check_elementwise(opt_class, optimizer_kwargs)
        for g in groups:
            check_elementwise(opt_class, optimizer_kwargs | g.options)
        masters = [m for buf in self.buffers for m in self._bind(buf, group_of)]
        self.masters = sorted(masters, key=lambda m: m.group)  # group-major: inner param order
        self._piece_names: list[str | None] = []
        torch_groups = []
        for i, g in enumerate(groups):
            masters = [p.master for p in self.masters if p.group == i]
            self._piece_names += [p.piece.name for p in self.masters if p.group == i] or [None]
            torch_groups.append(
                {"params": masters or [torch.zeros(0, device=self._device)], **g.options}
            )
        self.inner = [opt_class(torch_groups, **optimizer_kwargs)]
        mine = set(self.names)
        self._group_names = [[n for n in g.names if n in mine] for g in groups]
        self._versions = {id(p.param): p.param._version for p in self.masters if p.cast_back}
        self._prepared: ReducedGrads | None = None

    @property
    def _device(self) -> torch.device:
        return self.buffers[0].device if self.buffers else torch.device("cpu")

    def _bind(self, buf: FlatBuffer, group_of: dict[str, int]) -> list[_Master]:
        owned = buf.layout.owned_pieces(self.rank)
        params = {s.index: p for p, s in zip(buf.params, buf.slots)}
        coded = buf.gather_data is not None  # [Note: FP8 param gather]: masters always
        if not coded and not keeps_fp32_master(
            buf.layout.param_dtype, master_weights=self.master_weights
        ):
            flat, cursor = None, None  # masters are the param_data views themselves
        else:
            flat = torch.empty(sum(s.numel for s in owned), dtype=torch.float32, device=buf.device)
            cursor = 0
        masters = []
        for s in owned:
            if flat is None:
                master = buf.param_data[s.start : s.end]
            else:
                master = flat[cursor : cursor + s.numel]
                master.copy_(buf.param_data[s.start : s.end])
                cursor += s.numel
            masters.append(
                _Master(
                    s,
                    params[s.index],
                    buf,
                    master,
                    cast_back=flat is not None,
                    group=group_of[s.name],
                    coded=coded,
                )
            )
        return masters

    def gather_sources(self) -> Sources:
        return {id(p.param): p.master for p in self.masters if p.coded}

    # ---- the part interface (aligndp/optim/composite.py) ----
    def show_grads(self, grads: ReducedGrads) -> None:
        for p in self.masters:
            p.master.grad = p.sharded_grad if grads.has_grad(p.param) else None

    @torch.no_grad()
    def _refresh_masters(self) -> None:
        """16-bit params written by the user since our last step (``load_state_dict``,
        ``aligndp.load`` without an optimizer, ``p.copy_`` bump torch's version counter; a
        ``p.data`` access is noted by the DataParallel) give their fp32 masters the new values
        (elements still equal to the master's cast keep the master), so the step does not
        write old weights back."""
        for p in self.masters:
            if p.cast_back and (
                p.param._version != self._versions[id(p.param)]
                or p.param in self.model.data_touched
            ):
                decoded = self.model.param_gather.coded.decoded(p.param) if p.coded else None
                refresh_master(
                    p.master,
                    p.buffer.param_data[p.piece.start : p.piece.end],
                    None if decoded is None else decoded[p.piece.lo : p.piece.hi],
                )
                self._versions[id(p.param)] = p.param._version

    @torch.no_grad()
    def prepare_grads(self, grads: ReducedGrads) -> None:
        """Bind each master's ``.grad`` to its owned reduced gradient (the ``grad_data`` view,
        cast to the master's dtype where the grad buffer's differs); none where no rank had
        one."""
        if self._prepared is grads:
            grads.check()
            return
        self._refresh_masters()
        for p in self.masters:
            if grads.has_grad(p.param):
                g = p.owned_grad
                if g is None:
                    g = p.owned_grad = grads.owned(p.param)
                p.master.grad = g if g.dtype == p.master.dtype else g.to(p.master.dtype)
            else:
                p.master.grad = None
        self._prepared = grads

    def _grads(self) -> list[torch.Tensor]:
        return [p.master.grad for p in self.masters if p.master.grad is not None]

    @torch.no_grad()
    def local_grad_sq_sum(self) -> torch.Tensor:
        """Sum of squares of this rank's owned gradient elements (after :meth:`prepare_grads`),
        in fp32 whatever the gradients' dtype."""
        grads = self._grads()
        if not grads:
            return torch.zeros((), dtype=torch.float32, device=self._device)
        return torch.stack(torch._foreach_norm(grads, dtype=torch.float32)).square().sum()

    @torch.no_grad()
    def scale_grads(self, max_norm: float, total_norm: torch.Tensor) -> None:
        torch.nn.utils.clip_grads_with_norm_([p.master for p in self.masters], max_norm, total_norm)

    @torch.no_grad()
    def step_owned(self, bucket_stepped: BucketStepped, **step_kwargs) -> None:
        """Inner optimizer step on the masters, cast back into ``param_data``, drop the grads
        (one step over every bucket: the composite gathers them all afterwards)."""
        assert self._prepared is not None, "the composite prepares the grads before the step"
        self.inner[0].step(**step_kwargs)
        low = [p for p in self.masters if p.cast_back and not p.coded]
        if low:
            torch._foreach_copy_(
                [p.buffer.param_data[p.piece.start : p.piece.end] for p in low],
                [p.master for p in low],
            )
        for p in self.masters:
            p.master.grad = None  # never leave an alias of grad_data behind
        self._prepared = None

    # ---- model-space state ([Note: model-space state] in aligndp/state/model_space.py) ----
    def owned_range(self, name: str) -> tuple[int, int]:
        """``[lo, hi)`` of the flattened param ``name`` this rank steps; ``(0, 0)`` if none."""
        for p in self.masters:
            if p.piece.name == name:
                return p.piece.lo, p.piece.hi
        return 0, 0

    def model_space_state_dict(self) -> dict[str, object]:
        """Owned params (fp32, whatever the master's dtype) and optimizer state keyed by param
        name; see aligndp/state/checkpoint.py."""
        extents = {p.piece.name: (p.piece.offset, p.param.numel()) for p in self.masters}
        sd: dict[str, object] = {
            f"param.{p.piece.name}": FlatPiece(
                p.master.detach().float(), p.piece.offset, p.param.numel()
            )
            for p in self.masters
        }
        return sd | torch_state_to_model_space(
            self.inner[0],
            self._piece_names,
            extents,
            elementwise=self.elementwise_state,
            group_names=self._group_names,
        )

    @torch.no_grad()
    def load_model_space_state_dict(self, sd: dict[str, object]) -> None:
        """Inverse of :meth:`model_space_state_dict` for this rank's (possibly different) ownership;
        the composite all-gathers afterwards."""
        for p in self.masters:
            piece = sd[f"param.{p.piece.name}"]
            p.master.copy_(piece.tensor)
            p.buffer.param_data[p.piece.start : p.piece.end].copy_(p.master)
        model_space_to_torch_state(self.inner[0], self._piece_names, sd)


class ShardedOptimizer(CompositeOptimizer):
    """ZeRO-1: a :class:`CompositeOptimizer` of one :class:`ShardedPart` over every sharded
    buffer (``parallelize(sharding="zero1")`` with an elementwise optimizer builds it)."""

    def __init__(
        self, model: DataParallel, part: ShardedPart, *, max_grad_norm: float | None = None
    ) -> None:
        super().__init__(model, [part], max_grad_norm=max_grad_norm)

    @property
    def masters(self) -> list[_Master]:
        return self.parts[0].masters
