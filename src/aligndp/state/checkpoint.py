"""Checkpoints through ``torch.distributed.checkpoint`` (DCP) that reshard across dp sizes.

[Note: model-space state] (aligndp/state/model_space.py) names every entry by param name; the
file is a plain DCP checkpoint in torch's layout ([Note: checkpoint format] in DESIGN.md):
``model.<key>`` for every key of the module's ``state_dict()``, ``optim.state.<name>.<key>``,
``optim.param_groups.<i>.<option>``, and the sidecar ``aligndp.json`` (format, step, param
shapes, dp_size of the writer, a CRC-32 per file).

Writes are sharded (aligndp/state/dcp_io.py): each rank writes only the elements it owns, as
chunks of the full-shape tensor, and DCP's load planners read any other cut of them. The file
checks live in aligndp/state/checkpoint_files.py.

Atomicity: everything is written into ``<path>.partial``; after every rank has finished
(barrier) rank 0 moves the old ``path`` aside, renames the new one into place and deletes
the old one. A save that raises part-way leaves ``path`` untouched.

[Note: checkpoint safety]
- save and load are collective: they start with ``agreement.expect_all_ranks`` so a call on
  some ranks only (``if rank == 0: aligndp.save(...)``) fails within the collective timeout
  ([Note: collective timeout] in agreement.py) instead of hanging.
- A user's file is never renamed or deleted: ``path``, ``<path>.partial`` and ``<path>.old``
  are replaced only when they are aligndp checkpoint directories (``aligndp.json`` or DCP
  files inside) or empty directories; anything else is a ``ValueError`` before any write.
- A failed write (disk full, a file-size limit, permissions) removes ``<path>.partial`` and
  raises one ``OSError`` line naming the reason and the file, on every rank.
- Before reading, every rank checks ``aligndp.json``, ``.metadata`` and that every shard file
  exists and is as long as the metadata says, and its share of the files against their
  CRC-32; the ranks share their findings (one ``all_gather_object``) and all raise the same
  one-line ``ValueError`` naming the file.
- Module buffers and frozen params are written by rank 0 only, so the checkpoint holds rank
  0's copy (as wrapping broadcast it), never another rank's.
- ``prune_checkpoints(directory, keep_last)`` deletes all but the newest ``step-N``
  checkpoints of a directory (``aligndp train --keep-last``).
"""

from __future__ import annotations

import json
import math
import os
import shutil
from typing import NoReturn

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from aligndp.runtime.agreement import expect_all_ranks
from aligndp.runtime.ddp import DataParallel
from aligndp.state.checkpoint_files import (
    FORMAT,
    META_FILE,
    Writer,
    agreed,
    check_target,
    file_checksum,
    first_os_error,
    on_rank_zero,
    os_error_line,
    own_checksums,
    prune_checkpoints,
    read_dcp_metadata,
    read_meta,
)
from aligndp.state.dcp_io import Cut, PieceLoadPlanner, PieceSavePlanner
from aligndp.state.model_space import (
    FlatPiece,
    model_space_to_torch_state,
    torch_state_to_model_space,
)

__all__ = [
    "FlatPiece",
    "load",
    "model_space_to_torch_state",
    "prune_checkpoints",
    "save",
    "torch_state_to_model_space",
]


class _ReplicatedView:
    """Model-space face of an optimizer whose torch optimizer steps the model's params directly."""

    def __init__(self, model: DataParallel, optimizer: torch.optim.Optimizer | None) -> None:
        self.model, self.optimizer = model, optimizer
        self.named = [(model.param_names[p], p) for p in model.param_names]

    def owned_range(self, name: str) -> tuple[int, int]:
        return 0, dict(self.named)[name].numel()

    def _inner(self):
        inner = getattr(self.optimizer, "inner", [self.optimizer])
        assert len(inner) == 1, "the replicated adapter drives one torch optimizer"
        params = [p for g in inner[0].param_groups for p in g["params"]]
        return inner[0], [self.model.param_names[p] for p in params]

    def model_space_state_dict(self) -> dict[str, object]:
        sd: dict[str, object] = {
            f"param.{n}": FlatPiece(p.detach().float().reshape(-1), 0, p.numel())
            for n, p in self.named
        }
        if self.optimizer is not None:
            inner, names = self._inner()
            extents = {n: (0, p.numel()) for n, p in self.named}
            # a bare torch optimizer next to plain DDP: what DDP users pass (AdamW, SGD) is
            # elementwise; its state shaped like a param is per-element
            sd.update(torch_state_to_model_space(inner, names, extents, elementwise=True))
        return sd

    @torch.no_grad()
    def load_model_space_state_dict(self, sd: dict[str, object]) -> None:
        for n, p in self.named:
            p.copy_(sd[f"param.{n}"].tensor.view(p.shape))
        if self.optimizer is not None:
            model_space_to_torch_state(*self._inner(), sd)


def _view(model: DataParallel, optimizer):
    if not isinstance(model, DataParallel):
        raise TypeError(
            "save/load take the model returned by aligndp.parallelize(), got "
            f"{type(model).__name__}"
        )
    return (
        optimizer
        if hasattr(optimizer, "model_space_state_dict")
        else _ReplicatedView(model, optimizer)
    )


def _state(model: DataParallel, view) -> dict[str, object]:
    """What DCP writes, nested as torch's ``{"model": get_model_state_dict(...), "optim":
    get_optimizer_state_dict(...)}``: the module's own keys at full shape, this rank's pieces
    as :class:`Cut` s ([Note: checkpoint format] in DESIGN.md)."""
    shapes = _shapes(model)
    values: dict[str, FlatPiece] = {}
    state: dict[str, dict[str, object]] = {}
    groups = None
    for key, value in view.model_space_state_dict().items():
        if key == "param_groups":
            groups = value
        elif key.startswith("param."):
            values[key.removeprefix("param.")] = value
        else:
            name, k = key.removeprefix("state.").rsplit(".", 1)
            state.setdefault(name, {})[k] = (
                Cut(value, shapes[name]) if isinstance(value, FlatPiece) else value
            )
    rank0 = dist.get_rank(model.process_group) == 0  # rank 0's copy ([Note: checkpoint safety])
    module: dict[str, object] = {}
    for key, t in model.module.state_dict(keep_vars=True).items():
        name = model.param_names.get(t) if isinstance(t, torch.Tensor) else None
        if name is not None:  # a trained param, under each of its names (tied weights too)
            if name in values:
                module[key] = Cut(values[name], shapes[name])
        elif rank0:
            module[key] = t.detach() if isinstance(t, torch.Tensor) else t
    if groups is None:
        return {"model": module}
    return {"model": module, "optim": {"state": state, "param_groups": groups}}


def _shapes(model: DataParallel) -> dict[str, tuple[int, ...]]:
    return {n: tuple(p.shape) for n, p in _named(model)}


def _other_tensors(model: DataParallel) -> dict[str, torch.Tensor]:
    """The module's state that aligndp does not train (buffers, frozen params), as detached aliases.

    A trained param reachable under a second name (tied weights) is not among them: it is
    saved under each name and read back once, under its first.
    """
    trained = {id(p) for p in model.param_names}
    return {
        n: t.detach()
        for n, t in model.module.state_dict(keep_vars=True).items()
        if isinstance(t, torch.Tensor) and id(t) not in trained
    }


def save(
    path: str | os.PathLike,
    model: DataParallel,
    optimizer=None,
    *,
    step: int = 0,
    timeout: float | None = None,
) -> None:
    """Write a reshardable checkpoint of ``model`` (and ``optimizer``) at ``path``, atomically.

    Collective: every rank calls it ([Note: checkpoint safety]); ``timeout`` (seconds) bounds
    the wait for the other ranks (default ``$ALIGNDP_COLLECTIVE_TIMEOUT`` or 60 s).
    """
    path = os.fspath(path)
    view = _view(model, optimizer)
    group = model.process_group
    expect_all_ranks(f"aligndp.save({path!r})", group, timeout=timeout)
    partial = path + ".partial"

    def clear_partial() -> None:
        check_target(path)
        shutil.rmtree(partial, ignore_errors=True)  # left by a save that failed

    on_rank_zero(clear_partial, group)
    # every rank raises the same error if one cannot express its state ([Note: checkpoint safety])
    state = agreed(lambda: _state(model, view), group)
    try:
        dcp.save(
            state,
            storage_writer=Writer(partial),
            planner=PieceSavePlanner(),
            process_group=group,
        )
    except CheckpointException as e:  # a BaseException: `except Exception` in user code misses it
        os_error, first = first_os_error(e), next(iter(e.failures.values()))[0]
        reason = os_error_line(os_error) if os_error else f"{type(first).__name__}: {first}"
        _discard(path, group, sorted(e.failures), reason, os_error=os_error is not None)
    # each rank sums the files it wrote (hot in the page cache); rank 0 records them
    sums: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(sums, own_checksums(partial, dist.get_rank(group)), group=group)
    failed = [r for r, (_, error) in enumerate(sums) if error is not None]
    if failed:
        _discard(path, group, failed, sums[failed[0]][1], os_error=True)

    def finish() -> None:
        meta = {
            "format": FORMAT,
            "step": int(step),
            "dp_size": dist.get_world_size(group),
            "shapes": {n: list(p.shape) for n, p in _named(model)},
            "checksums": {k: v for files, _ in sums for k, v in files.items()},
        }
        try:
            meta["checksums"][".metadata"] = file_checksum(os.path.join(partial, ".metadata"))
            with open(os.path.join(partial, META_FILE), "w") as f:
                json.dump(meta, f, indent=1, allow_nan=False)
            old = path + ".old"
            if os.path.exists(path):
                shutil.rmtree(
                    old, ignore_errors=True
                )  # only a save that died between the renames leaves one
                os.replace(path, old)
            os.replace(partial, path)
            shutil.rmtree(old, ignore_errors=True)
        except OSError as e:
            shutil.rmtree(partial, ignore_errors=True)
            raise OSError(
                f"saving checkpoint {path!r} failed on rank 0: {os_error_line(e)}; nothing was "
                "left behind and the previous checkpoint there (if any) is intact"
            ) from None

    on_rank_zero(finish, group)


def _discard(path: str, group, ranks: list[int], reason: str, *, os_error: bool) -> NoReturn:
    """Remove ``<path>.partial`` once every rank stopped writing, then raise the same line on
    every rank: an ``OSError`` when the reason was one, else a ``RuntimeError``."""
    dist.barrier(group=group)  # every rank has stopped writing
    if dist.get_rank(group) == 0:
        shutil.rmtree(path + ".partial", ignore_errors=True)
    dist.barrier(group=group)
    raise (OSError if os_error else RuntimeError)(
        f"saving checkpoint {path!r} failed on rank(s) {ranks}: {reason}; nothing was left "
        "behind and the previous checkpoint there (if any) is intact"
    ) from None


def _named(model: DataParallel) -> list[tuple[str, torch.nn.Parameter]]:
    return [(model.param_names[p], p) for p in model.param_names]


def _check_shapes(path: str, saved: dict[str, list[int]], model: DataParallel) -> None:
    have = {n: list(p.shape) for n, p in _named(model)}
    missing = sorted(set(have) - set(saved))
    unexpected = sorted(set(saved) - set(have))
    mismatched = [
        f"{n}: checkpoint {saved[n]} vs model {have[n]}"
        for n in sorted(set(have) & set(saved))
        if saved[n] != have[n]
    ]
    if missing or unexpected or mismatched:
        raise ValueError(
            f"checkpoint {path!r} does not fit this model: missing (in the model, not the "
            f"checkpoint) {missing}; unexpected (in the checkpoint, not the model) "
            f"{unexpected}; shape mismatches {mismatched}. Load it into the model that wrote it"
        )


def _templates(
    model: DataParallel, view, metadata: dict, with_optim: bool
) -> tuple[dict[str, object], dict[str, Cut]]:
    """What this rank reads: plain entries (module buffers in place, whole optimizer state,
    param-group values) and zeroed :class:`Cut` s of its current ownership."""
    shapes, others = _shapes(model), _other_tensors(model)
    plain: dict[str, object] = {}
    cuts: dict[str, Cut] = {}

    def cut(key: str, name: str, md) -> None:
        lo, hi = view.owned_range(name)
        if hi > lo:
            flat = torch.zeros(hi - lo, dtype=md.properties.dtype, device=model.device)
            cuts[key] = Cut(FlatPiece(flat, lo, math.prod(shapes[name])), shapes[name])

    for key, md in metadata.items():
        if key.startswith("model."):
            name = key.removeprefix("model.")
            if name in shapes:
                cut(key, name, md)
            elif name in others:  # a tied param's second name is read once, as its first
                plain[key] = others[name]
        elif not with_optim:
            continue
        elif key.startswith("optim.state."):
            name = key.removeprefix("optim.state.").rsplit(".", 1)[0]
            if tuple(md.size) == shapes[name]:  # per-element, or whole on its one owner
                cut(key, name, md)
            elif view.owned_range(name)[1] > 0:
                plain[key] = torch.zeros(tuple(md.size), dtype=md.properties.dtype)
        elif key.startswith("optim.param_groups."):
            is_tensor = isinstance(md, TensorStorageMetadata)
            plain[key] = torch.empty(md.size, dtype=md.properties.dtype) if is_tensor else None
    return plain, cuts


def load(
    path: str | os.PathLike, model: DataParallel, optimizer=None, *, timeout: float | None = None
) -> int:
    """Load a checkpoint written by :func:`save` at any dp size and bucket size; returns its step.

    Collective, like :func:`save`; a damaged checkpoint is one ValueError naming the file.
    """
    path = os.fspath(path)
    view = _view(model, optimizer)
    group = model.process_group
    expect_all_ranks(f"aligndp.load({path!r})", group, timeout=timeout)
    if not os.path.exists(os.path.join(path, META_FILE)) and os.path.exists(
        os.path.join(path + ".old", META_FILE)
    ):
        path += ".old"  # a save died between its two renames

    def check() -> tuple[dict, object]:
        meta = read_meta(path)
        _check_shapes(path, meta["shapes"], model)
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        return meta, read_dcp_metadata(path, meta["checksums"], share=(rank, size))

    meta, dcp_metadata = agreed(check, group)
    if hasattr(view, "gather"):
        view.gather.wait_all()
    plain, cuts = _templates(model, view, dcp_metadata.state_dict_metadata, optimizer is not None)
    try:
        dcp.load(
            plain,
            storage_reader=dcp.FileSystemReader(path),
            planner=PieceLoadPlanner(cuts),
            process_group=group,
        )
    except CheckpointException as e:
        exc = next(iter(e.failures.values()))[0]
        raise ValueError(
            f"loading checkpoint {path!r} failed on rank(s) {sorted(e.failures)}: "
            f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        ) from None
    sd: dict[str, object] = {}
    for key, c in cuts.items():
        if key.startswith("model."):
            sd["param." + key.removeprefix("model.")] = c.piece
        else:
            sd[key.removeprefix("optim.")] = c.piece
    groups: dict[int, dict] = {}
    for key, value in plain.items():
        if key.startswith("optim.param_groups."):
            i, k = key.removeprefix("optim.param_groups.").split(".", 1)
            groups.setdefault(int(i), {})[k] = value
        elif key.startswith("optim.state."):
            sd[key.removeprefix("optim.")] = value
    if optimizer is not None:
        sd["param_groups"] = [groups[i] for i in sorted(groups)]
    view.load_model_space_state_dict(sd)
    return int(meta["step"])
