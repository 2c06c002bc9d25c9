"""Checkpoints through ``torch.distributed.checkpoint`` (DCP) that reshard across dp sizes.

[Note: model-space state] (aligndp/state/model_space.py) names every entry by param name; the
file holds ``model.<name>``, ``optim.state.<name>.<key>``, ``optim.param_groups``,
``buffers.<name>`` and the sidecar ``aligndp.json`` (step, param shapes, dp_size of the writer).

Writes are sharded (aligndp/state/dcp_io.py): each rank writes only the elements it owns
and DCP's load planner reads any other cut of them. The file checks live in
aligndp/state/checkpoint_files.py.

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
- A failed write (disk full, permissions) removes ``<path>.partial`` and raises one
  ``OSError`` line naming the reason and the file, on every rank.
- Before reading, every rank checks ``aligndp.json``, ``.metadata`` and that every shard file
  exists and is as long as the metadata says; the ranks share their findings (one
  ``all_gather_object``) and all raise the same one-line ``ValueError`` naming the file.
- Module buffers and frozen params (``buffers.<name>``) are written by rank 0 only, so the
  checkpoint holds rank 0's copy (as wrapping broadcast it), never another rank's.
- ``prune_checkpoints(directory, keep_last)`` deletes all but the newest ``step-N``
  checkpoints of a directory (``aligndp train --keep-last``).
"""

from __future__ import annotations

import json
import os
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from aligndp.runtime.agreement import expect_all_ranks
from aligndp.runtime.ddp import DataParallel
from aligndp.state.checkpoint_files import (
    FORMAT,
    META_FILE,
    agreed,
    check_target,
    first_os_error,
    on_rank_zero,
    os_error_line,
    prune_checkpoints,
    read_dcp_metadata,
    read_meta,
)
from aligndp.state.dcp_io import ParamGroups, to_dcp
from aligndp.state.model_space import (
    FlatPiece,
    model_space_to_torch_state,
    torch_state_to_model_space,
)

__all__ = [
    "FlatPiece",
    "ParamGroups",
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


def _entries(model: DataParallel, view) -> dict[str, object]:
    """The checkpoint's keys ([Note: model-space state]) from an optimizer's model-space dict."""
    out: dict[str, object] = {}
    for key, value in view.model_space_state_dict().items():
        if key == "param_groups":
            out["optim.param_groups"] = ParamGroups(value)
        elif key.startswith("param."):
            out["model." + key.removeprefix("param.")] = value
        else:
            out["optim." + key] = value
    if dist.get_rank(model.process_group) == 0:  # rank 0's copy ([Note: checkpoint safety])
        for name, t in _other_tensors(model).items():
            out[f"buffers.{name}"] = t
    return out


def _other_tensors(model: DataParallel) -> dict[str, torch.Tensor]:
    """The module's state that aligndp does not train (buffers, frozen params), as detached aliases.

    A trained param reachable under a second name (tied weights) is saved once, as ``model.<name>``.
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
    state = to_dcp(agreed(lambda: _entries(model, view), group), group)
    failure = None
    try:
        dcp.save(state, storage_writer=dcp.FileSystemWriter(partial), process_group=group)
    except (
        CheckpointException
    ) as e:  # a BaseException: `except Exception` in user code would miss it
        failure = e
    if failure is not None:
        os_error = first_os_error(failure)
        dist.barrier(group=group)  # every rank has stopped writing
        if dist.get_rank(group) == 0:
            shutil.rmtree(partial, ignore_errors=True)
        dist.barrier(group=group)
        first = next(iter(failure.failures.values()))[0]
        reason = (
            os_error_line(os_error) if os_error is not None else f"{type(first).__name__}: {first}"
        )
        error = OSError if os_error is not None else RuntimeError
        raise error(
            f"saving checkpoint {path!r} failed on rank(s) {sorted(failure.failures)}: "
            f"{reason}; nothing was left behind and the previous checkpoint there (if any) is "
            "intact"
        ) from None

    def finish() -> None:
        meta = {
            "format": FORMAT,
            "step": int(step),
            "dp_size": dist.get_world_size(group),
            "shapes": {n: list(p.shape) for n, p in _named(model)},
        }
        try:
            with open(os.path.join(partial, META_FILE), "w") as f:
                json.dump(meta, f, indent=1)
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


def _templates(model: DataParallel, view, metadata) -> dict[str, object]:
    """Zeroed entries cut to this rank's current ownership, for every saved key we read."""
    numels = {n: p.numel() for n, p in _named(model)}
    out: dict[str, object] = {}
    for key, md in metadata.items():
        if key.startswith("model.") or key.startswith("optim.state."):
            if key.startswith("model."):
                name = key.removeprefix("model.")
            else:
                name = key.removeprefix("optim.state.").rsplit(".", 1)[0]
            lo, hi = view.owned_range(name)
            if hi <= lo:
                continue
            size = tuple(md.size)
            if size == (numels[name],):
                out[key] = FlatPiece(
                    torch.zeros(hi - lo, dtype=md.properties.dtype, device=model.device),
                    lo,
                    size[0],
                )
            else:
                out[key] = torch.zeros(size, dtype=md.properties.dtype)
        elif key == "optim.param_groups":
            out[key] = ParamGroups([])
    for name, t in _other_tensors(model).items():
        if f"buffers.{name}" in metadata:
            out[f"buffers.{name}"] = t
    return out


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
        return meta, read_dcp_metadata(path)

    meta, dcp_metadata = agreed(check, group)
    if hasattr(view, "gather"):
        view.gather.wait_all()
    entries = _templates(model, view, dcp_metadata.state_dict_metadata)
    state = to_dcp(entries, group)
    try:
        dcp.load(state, storage_reader=dcp.FileSystemReader(path), process_group=group)
    except CheckpointException as e:
        exc = next(iter(e.failures.values()))[0]
        raise ValueError(
            f"loading checkpoint {path!r} failed on rank(s) {sorted(e.failures)}: "
            f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        ) from None
    sd: dict[str, object] = {}
    for key, value in entries.items():
        if key.startswith("model."):
            sd["param." + key.removeprefix("model.")] = value
        elif key.startswith("optim."):
            sd[key.removeprefix("optim.")] = (
                state[key].groups if key == "optim.param_groups" else value
            )
    if optimizer is None:
        sd.pop("param_groups", None)
    view.load_model_space_state_dict(sd)
    return int(meta["step"])
