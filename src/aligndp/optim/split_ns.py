"""Split Newton–Schulz at run time: one matrix's Muon step shared by a group of ranks.

The plan is [Note: split Newton–Schulz] (plan/split.py): ``ParamSlot.split`` names the ranks,
the owner first, and each part's columns (of the matrix in its wide orientation) and rows of
``B``. One step of a split matrix, every rank of its group calling in the same order:

1. the owner (it holds the reduced gradient, the momentum and the param, as without a split)
   updates the momentum and makes ``X`` = the update in ``NS_DTYPE``, wide, over its norm —
   Muon's algorithm as ``torch.optim.Muon`` runs it (``lerp`` momentum, Nesterov, ``eps``);
2. scatters the column blocks ``X_j`` to the group;
3. ``ns_steps`` times, on every rank: its Gram ``X_j X_jᵀ`` (a GEMM in ``NS_DTYPE``), one
   all-reduce in fp32, cast to ``NS_DTYPE``; its rows of ``B = bA + cA·A``; one all-gather of
   ``B``; ``X_j <- aX_j + B X_j``;
4. gathers the blocks back and applies Muon's update to the param: weight decay
   ``p <- p·(1 - lr·wd)``, then ``p <- p - lr·ratio·X`` with ``adjust_lr_fn``'s ratio.

The pieces are pure functions of tensors (:func:`momentum_update`, :func:`normalised`,
:func:`gram_part`, :func:`b_rows`, :func:`apply_b`, :func:`apply_update`) so that a test can
run the parts in one process against ``torch.optim.Muon``; :class:`SplitMatrix` wires them
with ``torch.distributed`` over a sub-group that :func:`split_groups` makes at wrap time.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from aligndp.plan.split import MatrixSplit, wide
from aligndp.runtime.fake_world import gather_objects

__all__ = [
    "NS_DTYPE",
    "SplitMatrix",
    "apply_b",
    "apply_update",
    "b_rows",
    "global_split_ranks",
    "gram_part",
    "lr_ratio",
    "momentum_update",
    "normalised",
    "split_groups",
]

NS_DTYPE = torch.bfloat16
"""The dtype Newton–Schulz runs in, as torch's Muon (bf16); tests set fp32 on both sides."""

_GROUPS: dict[tuple[int, tuple[int, ...]], tuple[object, dist.ProcessGroup | None]] = {}
"""(id of the default group, global ranks) -> (that default group, the sub-group or None on a
rank outside it): the same keys on every rank of a job, since each of them makes every group."""


def split_groups(
    needed: Sequence[Sequence[int]], job: dist.ProcessGroup | None = None
) -> dict[tuple[int, ...], dist.ProcessGroup]:
    """The sub-groups of this rank's split matrices, keyed by their sorted global ranks.

    A collective of the data-parallel job ``job`` (None: the default group): every rank of it
    calls this once, at wrap time, with the global ranks of the groups it needs in plan order
    (none is fine). The ranks share their lists (one ``all_gather_object``) and then every rank
    takes part in making every group, in one agreed order, so no rank can wait for a group that
    another never makes.

    Why not each group made by its members alone (``use_local_synchronization=True``): torch
    names such a group by its ranks *and by how many groups the calling rank has made*, so two
    members that have made different numbers of groups name it differently and wait forever
    (issue 42: ranks 0, 1, 2 in ``new_group([0, 1, 2])`` after ranks 0, 1 had made
    ``[0, 1, 3]``). So: when the job is every rank of the default group, every rank calls
    ``dist.new_group`` for every group (collective over the default group, named by a shared
    counter). When it is a subgroup (the other ranks may be doing anything), the members of a
    group make it with local synchronisation and every other rank of the job makes a group of
    itself alone at the same turn, so all ranks of the job have made the same number of groups
    at every turn. Groups are cached per default group, identically on every rank of the job.
    """
    world = dist.group.WORLD
    me = dist.get_rank()
    # a rehearsal makes only its own rank's groups ([Note: rehearsal on the fake process group])
    everyone = gather_objects([tuple(sorted(r)) for r in needed], group=job)
    order = list(dict.fromkeys(ranks for mine in everyone for ranks in mine or ()))
    whole = job is None or dist.get_world_size(job) == dist.get_world_size()
    out: dict[tuple[int, ...], dist.ProcessGroup] = {}
    for ranks in order:
        key = (id(world), ranks)
        if key not in _GROUPS or _GROUPS[key][0] is not world:
            if whole:
                group = dist.new_group(list(ranks))
            elif me in ranks:
                group = dist.new_group(list(ranks), use_local_synchronization=True)
            else:  # keeps this rank's count of groups equal to the members'
                group = None
                dist.new_group([me], use_local_synchronization=True)
            _GROUPS[key] = (world, group)
        if me in ranks:
            group = _GROUPS[key][1]
            assert group is not None, f"rank {me} made no group {ranks}"
            out[ranks] = group
    return out


def global_split_ranks(split: MatrixSplit, process_group: dist.ProcessGroup | None) -> list[int]:
    """The global ranks of ``split``'s group, owner first (the plan names ranks of the
    data-parallel ``process_group``; None: the default group)."""
    parent = process_group if process_group is not None else dist.group.WORLD
    return [dist.get_global_rank(parent, r) for r in split.ranks]


def momentum_update(grad: torch.Tensor, state: dict, momentum: float, nesterov: bool):
    """Muon's momentum (an exponential average, ``buf <- buf + (1-μ)(g - buf)``) and the
    update that is orthogonalised: ``g + μ(buf - g)`` with Nesterov, else ``buf``."""
    if "momentum_buffer" not in state:
        state["momentum_buffer"] = torch.zeros_like(grad)
    buf = state["momentum_buffer"]
    buf.lerp_(grad, 1 - momentum)
    return grad.lerp(buf, momentum) if nesterov else buf


def normalised(update: torch.Tensor, eps: float) -> torch.Tensor:
    """``update`` in ``NS_DTYPE``, wide (m <= n), divided by its Frobenius norm (at least eps)."""
    x = update.to(NS_DTYPE)
    if x.shape[0] > x.shape[1]:
        x = x.T
    return x / x.norm().clamp(min=eps)


def gram_part(x: torch.Tensor) -> torch.Tensor:
    """This part's share of ``A = X Xᵀ`` as fp32 (the parts are summed in fp32): the GEMM runs
    in ``x``'s dtype, as torch's (bf16 tensor cores on a GPU), so one part is torch's Gram."""
    return (x @ x.T).float()


def b_rows(gram: torch.Tensor, lo: int, hi: int, b: float, c: float) -> torch.Tensor:
    """Rows ``[lo, hi)`` of ``B = bA + cA·A``."""
    return torch.addmm(gram[lo:hi], gram[lo:hi], gram, beta=b, alpha=c)


def apply_b(x: torch.Tensor, full_b: torch.Tensor, a: float) -> torch.Tensor:
    """One iteration's new columns: ``aX_j + B X_j``."""
    return torch.addmm(x, full_b, x, beta=a)


def lr_ratio(adjust_lr_fn: str | None, shape: Sequence[int]) -> float:
    """How Muon scales lr for a matrix of ``shape`` (A x B): ``"original"`` or None:
    ``sqrt(max(1, A/B))``; ``"match_rms_adamw"``: ``0.2·sqrt(max(A, B))``; otherwise 1."""
    rows, cols = shape[0], shape[1]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return math.sqrt(max(1, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    return 1.0


def apply_update(param: torch.Tensor, ortho: torch.Tensor, options: dict) -> None:
    """Decoupled weight decay, then the orthogonalised step scaled by ``lr_ratio``."""
    lr = options["lr"]
    lr = lr.item() if isinstance(lr, torch.Tensor) else lr
    param.mul_(1 - lr * options["weight_decay"])
    param.add_(ortho, alpha=-lr * lr_ratio(options["adjust_lr_fn"], param.shape))


class SplitMatrix:
    """This rank's side of one split matrix of shape ``shape``; ``rank`` is its rank in the
    data-parallel ``process_group`` (None: the default group), whose ranks ``split`` names;
    ``group`` is their sub-group, from :func:`split_groups`."""

    def __init__(
        self,
        shape: Sequence[int],
        split: MatrixSplit,
        rank: int,
        process_group: dist.ProcessGroup | None,
        device: torch.device,
        group: dist.ProcessGroup,
    ) -> None:
        part = split.part_of(rank)
        assert part is not None, f"rank {rank} has no part of {split}"
        global_ranks = global_split_ranks(split, process_group)
        self.group = group
        self.src = dist.get_group_rank(self.group, global_ranks[0])  # the owner
        # gather/scatter lists are in group-rank order; part j sits at group rank order[j]
        self.order = [dist.get_group_rank(self.group, g) for g in global_ranks]
        self.shape, self.split, self.part, self.device = tuple(shape), split, part, device
        self.m, self.n = wide(shape)
        self.width = max(b - a for a, b in zip(split.cols, split.cols[1:]))
        self.height = max(b - a for a, b in zip(split.rows, split.rows[1:]))

    def _by_group_rank(self, per_part: list[torch.Tensor]) -> list[torch.Tensor]:
        out: list[torch.Tensor] = [per_part[0]] * len(per_part)
        for j, g in enumerate(self.order):
            out[g] = per_part[j]
        return out

    @torch.no_grad()
    def step(self, options: dict, param: torch.Tensor | None, state: dict | None) -> None:
        """One Muon step of the matrix; the owner passes its param (``.grad`` set) and its
        optimizer state, the other ranks None."""
        cols, rows = self.split.cols, self.split.rows
        a, b, c = options["ns_coefficients"]
        owner = self.part == 0
        blocks = None
        if owner:
            assert param is not None and param.grad is not None and state is not None
            update = momentum_update(param.grad, state, options["momentum"], options["nesterov"])
            x = normalised(update, options["eps"])
            blocks = self._by_group_rank(
                [
                    F.pad(x[:, lo:hi], (0, self.width - (hi - lo))).contiguous()
                    for lo, hi in zip(cols, cols[1:])
                ]
            )
        mine = torch.empty(self.m, self.width, dtype=NS_DTYPE, device=self.device)
        dist.scatter(mine, blocks, group=self.group, group_src=self.src)
        lo, hi = cols[self.part], cols[self.part + 1]
        x = mine[:, : hi - lo].contiguous()
        r0, r1 = rows[self.part], rows[self.part + 1]
        for _ in range(options["ns_steps"]):
            gram = gram_part(x)
            dist.all_reduce(gram, group=self.group)
            gram = gram.to(NS_DTYPE)
            mine_b = F.pad(b_rows(gram, r0, r1, b, c), (0, 0, 0, self.height - (r1 - r0)))
            every = [torch.empty_like(mine_b) for _ in self.order]
            dist.all_gather(every, mine_b.contiguous(), group=self.group)
            parts = [every[g] for g in self.order]
            full_b = torch.cat([p[: e - s] for p, s, e in zip(parts, rows, rows[1:])])
            x = apply_b(x, full_b, a)
        out = F.pad(x, (0, self.width - (hi - lo))).contiguous()
        gathered = [torch.empty_like(out) for _ in self.order] if owner else None
        dist.gather(out, gathered, group=self.group, group_dst=self.src)
        if owner:
            assert gathered is not None and param is not None
            parts = [gathered[g] for g in self.order]
            ortho = torch.cat([p[:, : e - s] for p, s, e in zip(parts, cols, cols[1:])], dim=1)
            apply_update(param, ortho.T if self.shape[0] > self.shape[1] else ortho, options)
