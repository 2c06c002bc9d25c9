"""ZeRO-1: torch's own elementwise optimizer stepping only this rank's slices of sharded buffers.

Rank r owns slice r of every bucket of a sharded buffer; its share of one param is an
:class:`~aligndp.plan.slots.OwnedPiece` (``layout.owned_pieces(rank)``, [Note: owned pieces]
in DESIGN.md). Padding is never stepped — only real elements are in pieces — so over all
ranks the pieces partition the real elements of every buffer exactly once, which is also
what lets a checkpoint write each element once (aligndp/state/checkpoint.py).

Each piece's master (:class:`~aligndp.runtime.masters.Master`) is kept by its bucket
(``bucket.masters``, [Note: masters with the buckets] in aligndp/runtime/masters.py), which
casts it back into ``param_data`` when its gather launches; this part steps them. For fp32
params, and for every param with ``master_weights=False``, the master *is* the
``param_data`` view (no copy, no cast back); for 16-bit params with ``master_weights=True``
(the default of ``sharding="zero1"``) it is a view of one fp32 flat tensor per bucket.
Gradients are the reduce-scattered ``grad_data`` views, cast to the master's dtype only where
the grad buffer's dtype differs.

[Note: one ZeRO-1 step]
The inner torch optimizer steps every bucket's masters in one ``step()``: one multi-tensor
(foreach or fused) update over all of them, after which the composite launches each bucket's
gather (cast back first) in forward order. Stepping bucket by bucket, so that bucket k's
gather overlaps bucket k+1's update, costs one ``step()`` per bucket: its per-call host work
(param groups, state lookups, the foreach grouping by device and dtype, and binding each
bucket's grads alone, as the layer-wise part does) is paid per bucket, for an overlap that an
elementwise update (memory-bound, short next to the gathers) barely needs; the layer-wise
part, whose Newton–Schulz is long, does step per bucket ([Note: layer-wise step]). One
step also keeps one inner optimizer, so ``state_dict`` and checkpoints keep their layout.
benchmarks/zero1_bucket_step.py measures the forms; on a shared 2-core CPU (2026-12-07,
200 k elements in 48 masters per bucket, one thread; benchmarks/results/
2026-12-07_zero1_bucket_step.md) one optimizer stepped per bucket took 1.07-1.31x the host
time of one step at 2-8 buckets in the quieter run, one optimizer per bucket 0.90-1.09x:
within that machine's noise (the same form at 1 bucket read 0.98-2.3x). The CUDA figure
(``--device cuda --numel 62000000 --buckets 1 2 4``) is still to be taken.

[Note: master weights]
``parallelize(master_weights=...)``: True keeps an fp32 master of every 16-bit param on its
owner (ZeRO-1's classic recipe: the update is computed and accumulated in fp32, at the cost
of 4 more bytes per element, fp32 optimizer state and two casts per step); False steps every
param in its own dtype, as ``sharding="none"`` does and as torch DDP + a torch optimizer on a
bf16 model do (state in the param dtype), so switching sharding keeps the numerics. One
predicate, :func:`~aligndp.runtime.masters.keeps_fp32_master`, decides it for every bucket
(the build step ``attach_masters`` in aligndp/build.py), so for :class:`ShardedPart` and
:class:`~aligndp.optim.whole_matrix.WholeMatrixPart` alike. Checkpoints hold fp32 values
either way ([Note: model-space state]), so a run resumes under the other setting. A param
gathered in FP8 ([Note: FP8 param gather] in aligndp/runtime/gather_codec.py) always has a
separate fp32 master, even an fp32 param (``param_data`` receives the decoded gather): the
gather encodes from it, and nothing is cast back.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from aligndp.optim.base import is_elementwise, resolve_optimizer_class
from aligndp.optim.composite import BucketStepped, CompositeOptimizer, OptimizerPart
from aligndp.optim.groups import ParamGroup
from aligndp.plan.spec import Mode
from aligndp.runtime.buffer import FlatBuffer
from aligndp.runtime.ddp import DataParallel
from aligndp.runtime.grads import ShardedGrad
from aligndp.runtime.masters import Master, refresh_master
from aligndp.runtime.step_agreement import ReducedGrads
from aligndp.state.model_space import (
    FlatPiece,
    model_space_to_torch_state,
    torch_state_to_model_space,
)

__all__ = [
    "bucket_masters_of",
    "check_elementwise",
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


class ShardedPart(OptimizerPart):
    """ZeRO-1 over ``buffers`` (sharded :class:`FlatBuffer` s of ``model``): a part of a
    :class:`~aligndp.optim.composite.CompositeOptimizer`.

    The inner torch optimizer steps this rank's masters, those of the buffers' buckets
    (``bucket.masters``, [Note: masters with the buckets] in aligndp/runtime/masters.py), one
    torch param group per :class:`~aligndp.optim.groups.ParamGroup` (a group this rank owns
    nothing of gets a grad-less zero-size placeholder, so ``param_groups`` match on every
    rank).
    """

    elementwise_state = True  # [Note: model-space state]: state shaped like a piece is per-element

    def __init__(
        self,
        model: DataParallel,
        buffers: Sequence[FlatBuffer],
        opt_class: type[torch.optim.Optimizer] = torch.optim.AdamW,
        *,
        groups: Sequence[ParamGroup] | None = None,
        **optimizer_kwargs,
    ) -> None:
        for buf in buffers:
            if buf.layout.mode is not Mode.SHARDED or buf.param_data is None:
                raise ValueError(
                    f"ShardedPart steps sharded buffers only, got a {buf.layout.mode.value} buffer"
                )
        self.model = model
        self.rank, self.dp_size = model.rank, model.dp_size
        self.buffers = list(buffers)
        self.names = [s.name for b in self.buffers for s in sorted(b.slots, key=lambda s: s.index)]
        if groups is None:
            groups = [ParamGroup(tuple(self.names), {})]
        group_of = {n: i for i, g in enumerate(groups) for n in g.names}
        check_elementwise(opt_class, optimizer_kwargs)
        for g in groups:
            check_elementwise(opt_class, optimizer_kwargs | g.options)
        masters = bucket_masters_of(model, self.buffers)
        self.masters: list[Master] = sorted(masters, key=lambda m: group_of[m.piece.name])
        """This rank's masters, group-major (the inner optimizer's param order)."""
        self._shown = [ShardedGrad(m.master) for m in self.masters]
        """Each master's ``.grad`` between a reduction and the step (immutable: made once)."""
        self._piece_names: list[str | None] = []
        torch_groups = []
        for i, g in enumerate(groups):
            mine = [m for m in self.masters if group_of[m.piece.name] == i]
            self._piece_names += [m.piece.name for m in mine] or [None]
            torch_groups.append(
                {"params": [m.master for m in mine] or [torch.zeros(0, device=self._device)]}
                | g.options
            )
        self.inner = [opt_class(torch_groups, **optimizer_kwargs)]
        mine = set(self.names)
        self._group_names = [[n for n in g.names if n in mine] for g in groups]
        self._versions = {id(m.param): m.param._version for m in self.masters if m.cast_back}
        self._prepared: ReducedGrads | None = None

    @property
    def _device(self) -> torch.device:
        return self.buffers[0].device if self.buffers else torch.device("cpu")

    # ---- the part interface (aligndp/optim/composite.py) ----
    def show_grads(self, grads: ReducedGrads) -> None:
        for m, shown in zip(self.masters, self._shown):
            m.master.grad = shown if grads.has_grad(m.param) else None

    @torch.no_grad()
    def _refresh_masters(self) -> None:
        """16-bit params written by the user since our last step (``load_state_dict``,
        ``aligndp.load`` without an optimizer, ``p.copy_`` bump torch's version counter; a
        ``p.data`` access is noted by the DataParallel) give their fp32 masters the new values
        (elements still equal to the master's cast keep the master), so the step does not
        write old weights back."""
        for m in self.masters:
            if m.cast_back and (
                m.param._version != self._versions[id(m.param)]
                or m.param in self.model.data_touched
            ):
                decoded = self.model.param_gather.coded.decoded(m.param) if m.coded else None
                refresh_master(
                    m.master, m.view, None if decoded is None else decoded[m.piece.lo : m.piece.hi]
                )
                self._versions[id(m.param)] = m.param._version

    @torch.no_grad()
    def prepare_grads(self, grads: ReducedGrads) -> None:
        """Bind each master's ``.grad`` to its owned reduced gradient (the ``grad_data`` view,
        cast to the master's dtype where the grad buffer's differs); none where no rank had
        one."""
        if self._prepared is grads:
            grads.check()
            return
        self._refresh_masters()
        has = grads.has  # taken just now by the composite: current
        for m in self.masters:
            if has is None or m.param in has:
                g = m.grad
                m.master.grad = g if g.dtype == m.master.dtype else g.to(m.master.dtype)
            else:
                m.master.grad = None
        self._prepared = grads

    def _grads(self) -> list[torch.Tensor]:
        return [m.master.grad for m in self.masters if m.master.grad is not None]

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
        torch.nn.utils.clip_grads_with_norm_([m.master for m in self.masters], max_norm, total_norm)

    @torch.no_grad()
    def step_owned(self, bucket_stepped: BucketStepped, **step_kwargs) -> None:
        """One inner step over every bucket's masters ([Note: one ZeRO-1 step]); the grads are
        dropped, and each bucket's gather (launched by the composite) casts its masters back."""
        assert self._prepared is not None, "the composite prepares the grads before the step"
        self.inner[0].step(**step_kwargs)
        for m in self.masters:
            m.master.grad = None  # never leave an alias of grad_data behind
        self._prepared = None

    # ---- model-space state ([Note: model-space state] in aligndp/state/model_space.py) ----
    def owned_range(self, name: str) -> tuple[int, int]:
        """``[lo, hi)`` of the flattened param ``name`` this rank steps; ``(0, 0)`` if none."""
        for m in self.masters:
            if m.piece.name == name:
                return m.piece.lo, m.piece.hi
        return 0, 0

    def model_space_state_dict(self) -> dict[str, object]:
        """Owned params (fp32, whatever the master's dtype) and optimizer state keyed by param
        name; see aligndp/state/checkpoint.py."""
        extents = {m.piece.name: (m.piece.offset, m.param.numel()) for m in self.masters}
        sd: dict[str, object] = {
            f"param.{m.piece.name}": FlatPiece(
                m.master.detach().float(), m.piece.offset, m.param.numel()
            )
            for m in self.masters
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
        for m in self.masters:
            m.master.copy_(sd[f"param.{m.piece.name}"].tensor)
            m.view.copy_(m.master)
        model_space_to_torch_state(self.inner[0], self._piece_names, sd)


def bucket_masters_of(model: DataParallel, buffers: Sequence[FlatBuffer]) -> list[Master]:
    """The masters the buckets of ``buffers`` keep (``bucket.masters``), buffer by buffer in
    bucket order; a ValueError if the build step ``attach_masters`` did not run."""
    masters: list[Master] = []
    for buf in buffers:
        buckets = sorted((b for b in model.buckets if b.buffer is buf), key=lambda b: b.ref.bucket)
        for b in buckets:
            if b.masters is None:
                raise ValueError(
                    f"bucket {b.ref} keeps no masters yet: attach them before building an "
                    "optimizer part (aligndp.build.attach_masters, which parallelize() runs)"
                )
            masters += b.masters
    return masters


class ShardedOptimizer(CompositeOptimizer):
    """ZeRO-1: a :class:`CompositeOptimizer` of one :class:`ShardedPart` over every sharded
    buffer (``parallelize(sharding="zero1")`` with an elementwise optimizer builds it)."""

    def __init__(
        self, model: DataParallel, part: ShardedPart, *, max_grad_norm: float | None = None
    ) -> None:
        super().__init__(model, [part], max_grad_norm=max_grad_norm)

    @property
    def masters(self) -> list[Master]:
        return self.parts[0].masters
