"""DataParallel: gradient hooks, bucket readiness, overlapped bucket collectives.

Timeline of one step (one process; NCCL runs collectives on its own internal stream, gloo
on its own threads, so a launched collective overlaps the rest of backward):

    backward (default stream) ── grads of bucket 0 ready ── grads of bucket 1 ready ── ...
                                   │ launch collective 0        │ launch collective 1
    comm (NCCL stream / gloo)      └──── reduce bucket 0 ─────┘ └──── reduce bucket 1 ──── ...
    finish_grad_sync(): launch what is left, wait for every handle.

[Note: bucket readiness]
A bucket is ready when every param in it has fired its gradient hook as often as it did in
the first synchronised backward after wrapping (a param used twice may fire twice; an
unused one zero times) — so the first step launches everything in ``finish_grad_sync`` and
later steps overlap. Only backward passes outside ``no_sync()`` count. Buckets are launched
strictly in index order (bucket i waits for 0..i-1), so every rank issues the same sequence
of collectives — NCCL needs that — even if hooks fire in a slightly different order.
A param firing after its bucket was launched would change a gradient under a collective in
flight: that raises instead of silently losing the contribution.

[Note: lazy zeroing]
``zero_grad_buffer()`` does not write the buffers; it marks every param's ``main_grad`` stale.
A param's first gradient of the step is *copied* into its view (autograd's own gradient
tensor is stolen by AccumulateGrad, so this is one read and one write), later ones are
added; a view still stale when its bucket is launched — an unused param — is zeroed then,
and so is one handed to a fused wgrad kernel. That saves a memset of every buffer and a
read per element against zero-then-accumulate. Padding is never written, so it stays zero.
"""
from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterable, Iterator, Mapping

import torch
import torch.distributed as dist
import torch.nn as nn

from aligndp.buffer import FlatBuffer
from aligndp.collectives import all_reduce_mean, reduce_scatter_mean
from aligndp.fused import fused_wgrad_modules
from aligndp.layout import DEFAULT_START_ALIGNMENT, BufferLayout, Mode, ParamSpec, Requirement, plan_buffers

__all__ = ["DDPConfig", "DataParallel", "BucketRef"]


@dataclasses.dataclass(frozen=True)
class DDPConfig:
    """Settings of the data-parallel wrapper."""

    bucket_numel: int | None = 40_000_000
    """Target elements per bucket (one collective each); None puts each buffer in one bucket."""
    overlap: bool = True
    """Launch each bucket's collective during backward as soon as it is ready; False waits
    for ``finish_grad_sync()`` and launches everything there."""
    grad_dtype: torch.dtype | None = None
    """dtype of the gradient buffers; None keeps each param's dtype (fp32 for bf16 params
    gives fp32 gradient accumulation and reduction)."""
    start_alignment: int = DEFAULT_START_ALIGNMENT
    """Param start alignment in elements; requirements of active consumers can only raise it."""
    check_finite: bool = False
    """Before each collective, check the bucket's grads for NaN/Inf and raise naming the
    param (one device sync per bucket)."""
    broadcast_at_wrap: bool = True
    """Copy rank 0's params and buffers to every rank when wrapping."""

    def __post_init__(self) -> None:
        if self.bucket_numel is not None and (not isinstance(self.bucket_numel, int) or self.bucket_numel <= 0):
            raise ValueError(
                f"bucket_numel must be a positive number of elements or None (one bucket), got {self.bucket_numel!r}"
            )
        if self.grad_dtype is not None and not (
            isinstance(self.grad_dtype, torch.dtype) and self.grad_dtype.is_floating_point
        ):
            raise TypeError(f"grad_dtype must be a floating torch.dtype or None, got {self.grad_dtype!r}")


@dataclasses.dataclass(frozen=True)
class BucketRef:
    """One bucket of one buffer."""

    buffer: int
    bucket: int


class DataParallel(nn.Module):
    """Wrap an unmodified module; keep its grads in aligned flat buffers reduced by bucket.

    ``modes`` maps param names to a :class:`~aligndp.layout.Mode` (default: every param
    replicated, i.e. plain DDP). Params are grouped into one buffer per (mode, param dtype).
    Sharded and layerwise buffers also hold the params (``param.data`` becomes a view).
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        process_group: dist.ProcessGroup | None = None,
        config: DDPConfig = DDPConfig(),
        modes: Mapping[str, Mode] | None = None,
        requirements: Iterable[Requirement] = (),
    ) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"DataParallel wraps an nn.Module, got {type(module).__name__}")
        if not dist.is_initialized():
            raise ValueError("torch.distributed is not initialised: call dist.init_process_group() first")
        self.module = module
        self.process_group = process_group
        self.config = config
        self.dp_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("the module has no trainable params (requires_grad=True): nothing to data-parallelise")
        devices = {p.device for _, p in named}
        if len(devices) > 1:
            where = {str(d): [n for n, p in named if p.device == d][:3] for d in devices}
            raise ValueError(
                f"the module's params live on {len(devices)} devices ({where}): data parallelism needs one "
                "device per rank; call module.to(device) before wrapping"
            )
        self.device = devices.pop()
        modes = dict(modes or {})
        unknown = set(modes) - {n for n, _ in named}
        if unknown:
            raise ValueError(f"modes name params that are not trainable params of the module: {sorted(unknown)}")
        fused = fused_wgrad_modules(module)
        self.requirements = tuple(requirements) + tuple(r for _, m in fused for r in m.wgrad_requirements())

        if config.broadcast_at_wrap and self.dp_size > 1:
            self._broadcast_from_rank0()

        layouts = plan_buffers(
            [ParamSpec(n, tuple(p.shape), p.dtype) for n, p in named], modes=modes, dp_size=self.dp_size,
            bucket_numel=config.bucket_numel, requirements=self.requirements,
            start_alignment=config.start_alignment, grad_dtype=config.grad_dtype,
        )
        by_name = dict(named)
        self.flat_buffers: list[FlatBuffer] = [
            FlatBuffer(layout, [by_name[s.name] for s in sorted(layout.params, key=lambda s: s.index)],
                       with_param_data=layout.mode is not Mode.REPLICATED)
            for layout in layouts
        ]
        self.param_names: dict[nn.Parameter, str] = {p: n for n, p in named}
        # param -> (buffer index, bucket index, main_grad view)
        self._where: dict[nn.Parameter, tuple[int, int, torch.Tensor]] = {}
        for i, buf in enumerate(self.flat_buffers):
            for p, s, g in zip(buf.params, buf.slots, buf.main_grads):
                self._where[p] = (i, s.bucket, g)
        self._refs = [BucketRef(i, b) for i, buf in enumerate(self.flat_buffers) for b in range(len(buf.layout.buckets))]
        self._bucket_params = {
            ref: [p for p, (i, b, _) in self._where.items() if (i, b) == (ref.buffer, ref.bucket)] for ref in self._refs
        }
        self._expected: dict[nn.Parameter, int] | None = None  # learned on the first synced backward
        self._fired: dict[nn.Parameter, int] = {p: 0 for p in self._where}
        self._stale: set[nn.Parameter] = set()  # [Note: lazy zeroing]
        self._works: dict[BucketRef, dist.Work | None] = {}
        self._next_launch = 0
        self._sync_enabled = True
        self._synced = False
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self._where]
        for _, m in fused:
            m.bind_grad_sink(self)

    # ---- the GradSink protocol ([Note: fused wgrad] in aligndp/fused.py) ----
    def main_grad(self, param: nn.Parameter) -> torch.Tensor | None:
        where = self._where.get(param)
        if where is None:
            return None
        self._take(param)
        return where[2]

    def mark_ready(self, param: nn.Parameter) -> None:
        if self._synced:  # first contribution of a new step
            self._reset_step()
        if self._sync_enabled:
            self._fired[param] += 1
            if self._expected is not None and self.config.overlap:
                self._launch_ready()

    # ---- hooks and readiness ----
    def _on_grad(self, param: nn.Parameter) -> None:
        if param.grad is None:
            return
        view = self._where[param][2]
        if param in self._stale:
            self._stale.discard(param)
            view.copy_(param.grad.view_as(view))
        else:
            view.add_(param.grad.view_as(view))
        param.grad = None
        self.mark_ready(param)

    def _take(self, param: nn.Parameter) -> None:
        """Zero a stale view before something accumulates into or reads it."""
        if param in self._stale:
            self._stale.discard(param)
            self._where[param][2].zero_()

    def _reset_step(self) -> None:
        self._fired = dict.fromkeys(self._fired, 0)
        self._works.clear()
        self._next_launch = 0
        self._synced = False

    def _bucket_ready(self, ref: BucketRef) -> bool:
        assert self._expected is not None
        return all(self._fired[p] >= self._expected[p] for p in self._bucket_params[ref])

    def _launch_ready(self) -> None:
        while self._next_launch < len(self._refs) and self._bucket_ready(self._refs[self._next_launch]):
            self._launch(self._refs[self._next_launch])

    def _launch(self, ref: BucketRef) -> None:
        assert ref == self._refs[self._next_launch], "buckets launch in index order"
        buf = self.flat_buffers[ref.buffer]
        for p in self._bucket_params[ref]:
            self._take(p)
        if self.config.check_finite:
            self._check_finite(ref)
        grad = buf.bucket_grad(ref.bucket)
        if self.dp_size == 1:
            self._works[ref] = None
        elif buf.layout.mode is Mode.REPLICATED:
            self._works[ref] = all_reduce_mean(grad, group=self.process_group)
        else:
            self._works[ref] = reduce_scatter_mean(grad, group=self.process_group)
        self._next_launch += 1

    def _check_finite(self, ref: BucketRef) -> None:
        for p in self._bucket_params[ref]:
            g = self._where[p][2]
            if not torch.isfinite(g).all():
                bad = int((~torch.isfinite(g)).sum())
                raise FloatingPointError(
                    f"param {self.param_names[p]!r} has {bad} non-finite gradient element(s) on rank {self.rank} "
                    "before the gradient collective; lower the learning rate, check the loss for inf/NaN, "
                    "or turn check_finite off to let the optimizer see them"
                )

    def finish_grad_sync(self) -> None:
        """Launch every bucket not yet launched, wait for all; idempotent within a step."""
        if self._synced:
            return
        if self._expected is None:
            self._expected = dict(self._fired)
        for p, n in self._fired.items():
            if n > self._expected[p]:
                raise RuntimeError(
                    f"param {self.param_names[p]!r} received {n} gradient contributions this step but "
                    f"{self._expected[p]} in the first step; aligndp learns each param's uses per step on "
                    "the first step and needs the same graph every step (wrap a new DataParallel if the "
                    "graph changes)"
                )
        while self._next_launch < len(self._refs):
            self._launch(self._refs[self._next_launch])
        for work in self._works.values():
            if work is not None:
                work.wait()
        self._synced = True

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (micro-batches); the next backward outside syncs them."""
        previous = self._sync_enabled
        self._sync_enabled = False
        try:
            yield
        finally:
            self._sync_enabled = previous

    def zero_grad_buffer(self) -> None:
        """Start a new step: every ``main_grad`` counts as zero ([Note: lazy zeroing]), readiness
        is forgotten."""
        self._stale = set(self._where)
        for p in self._where:
            p.grad = None
        self._reset_step()

    # ---- params ----
    def _broadcast_from_rank0(self) -> None:
        src = dist.get_global_rank(self.process_group, 0) if self.process_group is not None else 0
        with torch.no_grad():
            for t in list(self.module.parameters()) + list(self.module.buffers()):
                dist.broadcast(t.data, src=src, group=self.process_group)

    @property
    def layouts(self) -> list[BufferLayout]:
        return [buf.layout for buf in self.flat_buffers]

    def buffers_for(self, mode: Mode) -> list[FlatBuffer]:
        return [b for b in self.flat_buffers if b.layout.mode is mode]

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def remove_hooks(self) -> None:
        """Detach from the module (hooks and fused-wgrad sinks); buffers stay bound."""
        for h in self._hooks:
            h.remove()
        for _, m in fused_wgrad_modules(self.module):
            m.bind_grad_sink(None)
