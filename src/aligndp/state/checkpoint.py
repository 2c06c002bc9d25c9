"""Checkpoints through ``torch.distributed.checkpoint`` (DCP) that reshard across dp sizes.

[Note: model-space state] (aligndp/state/model_space.py) names every entry by param name; the
file holds ``model.<name>``, ``optim.state.<name>.<key>``, ``optim.param_groups``,
``buffers.<name>`` and the sidecar ``aligndp.json`` (step, param shapes, dp_size of the writer).

Writes are sharded: a piece that is not the whole tensor becomes one shard of a 1-D
``ShardedTensor`` (global metadata computed from one ``all_gather_object`` of piece extents,
no per-tensor collective), so each rank writes only the elements it owns and DCP's
load planner reads any other cut of them. Whole tensors (replicated params, scalars) are
plain tensors that DCP deduplicates to one writer.

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

import dataclasses
import errno
import json
import os
import pickle
import re
import shutil
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import (
    ShardedTensorMetadata,
    TensorProperties,
)
from torch.distributed.checkpoint.api import CheckpointException

from aligndp.runtime.agreement import expect_all_ranks
from aligndp.runtime.ddp import DataParallel
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

FORMAT = 1
META_FILE = "aligndp.json"


@dataclasses.dataclass
class ParamGroups:
    """Hyper-parameters of the optimizer's groups; one opaque DCP entry (DCP would flatten a bare list)."""

    groups: list[dict]


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
            sd.update(
                torch_state_to_model_space(inner, names, {n: (0, p.numel()) for n, p in self.named})
            )
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
            f"save/load take the model returned by aligndp.parallelize(), got {type(model).__name__}"
        )
    return (
        optimizer
        if hasattr(optimizer, "model_space_state_dict")
        else _ReplicatedView(model, optimizer)
    )


def _to_dcp(entries: dict[str, object], group: dist.ProcessGroup | None) -> dict[str, object]:
    """Turn FlatPieces into plain tensors (whole) or 1-D ShardedTensors (parts); one collective."""
    mine = {
        k: (v.offset, v.tensor.numel(), v.numel, str(v.tensor.dtype), str(v.tensor.device))
        for k, v in entries.items()
        if isinstance(v, FlatPiece)
    }
    everyone: list[dict] = [None] * dist.get_world_size(group)  # type: ignore[list-item]
    dist.all_gather_object(everyone, mine, group=group)
    out = {k: v for k, v in entries.items() if not isinstance(v, FlatPiece)}
    keys = sorted({k for d in everyone for k in d})
    for key in keys:
        shards = [(r, d[key]) for r, d in enumerate(everyone) if key in d and d[key][1] > 0]
        local = entries.get(key)
        if any(length == numel for _, (_, length, numel, _, _) in shards):
            if local is not None and local.tensor.numel() == local.numel:
                out[key] = local.tensor  # whole on every holder: DCP deduplicates
            continue
        out[key] = _sharded_tensor(key, shards, local, group)
    return out


def _sharded_tensor(key: str, shards: list, local: FlatPiece | None, group) -> ShardedTensor:
    """A 1-D ShardedTensor whose shards are the ranks' pieces, built without communication."""

    def global_rank(r: int) -> int:
        return dist.get_global_rank(group, r) if group is not None else r

    metas = {
        r: ShardMetadata([off], [length], placement=f"rank:{global_rank(r)}/{device}")
        for r, (off, length, _, _, device) in shards
    }
    numel, dtype = shards[0][1][2], getattr(torch, shards[0][1][3].removeprefix("torch."))
    props = TensorProperties(
        dtype=dtype,
        layout=torch.strided,
        requires_grad=False,
        memory_format=torch.contiguous_format,
        pin_memory=False,
    )
    md = ShardedTensorMetadata(list(metas.values()), torch.Size([numel]), props)
    rank = dist.get_rank(group)
    local_shards = [Shard(local.tensor, metas[rank])] if local is not None and rank in metas else []
    with warnings.catch_warnings():
        warnings.simplefilter(
            "ignore"
        )  # ShardedTensor is deprecated in favour of DTensor, which cannot cut at arbitrary offsets
        return ShardedTensor._init_from_local_shards_and_global_metadata(
            local_shards, md, process_group=group
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


_DCP_FILE = re.compile(r"^(__\d+_\d+\.distcp|\.metadata)$")


def _is_checkpoint_dir(path: str) -> bool:
    """An aligndp checkpoint (or the remains of one being written): safe to replace."""
    if not os.path.isdir(path) or os.path.islink(path):
        return False
    names = os.listdir(path)
    return not names or META_FILE in names or any(_DCP_FILE.match(n) for n in names)


def _check_target(path: str) -> None:
    """Refuse to write where a user's file or directory would be renamed or deleted."""
    for where in (path, path + ".partial", path + ".old"):
        if os.path.lexists(where) and not _is_checkpoint_dir(where):
            kind = (
                "a file"
                if not os.path.isdir(where) or os.path.islink(where)
                else "a directory that is not an aligndp checkpoint"
            )
            raise ValueError(
                f"aligndp.save({path!r}) would replace {where!r}, which is {kind}; aligndp never "
                "deletes or renames your files: save to a new path (or move that one away)"
            )


def _one_rank(fn, group) -> None:
    """Run ``fn`` on rank 0 and raise its ValueError/OSError (as one line) on every rank."""
    outcome = None
    if dist.get_rank(group) == 0:
        try:
            fn()
        except (ValueError, OSError) as e:
            outcome = (type(e).__name__, str(e))
    box = [outcome]
    dist.broadcast_object_list(
        box, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group
    )
    if box[0] is not None:
        kind, message = box[0]
        raise (ValueError if kind == "ValueError" else OSError)(message)


def _os_error_line(e: BaseException) -> str:
    """The reason of an OSError in a few words, with the file it was about."""
    reasons = {
        errno.ENOSPC: "no space left on the device",
        errno.EDQUOT: "disk quota exceeded",
        errno.EACCES: "permission denied",
        errno.EPERM: "operation not permitted",
        errno.EROFS: "the file system is read-only",
    }
    words = getattr(e, "strerror", None) or (str(e) or type(e).__name__).splitlines()[0]
    reason = reasons.get(getattr(e, "errno", None), words)
    where = getattr(e, "filename", None)
    return f"{reason} ({where})" if where else reason


def _first_os_error(e: CheckpointException) -> BaseException | None:
    for exc, _ in e.failures.values():
        seen = exc
        while seen is not None:
            if isinstance(seen, OSError):
                return seen
            seen = seen.__cause__ or seen.__context__
    return None


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
        _check_target(path)
        shutil.rmtree(partial, ignore_errors=True)  # left by a save that failed

    _one_rank(clear_partial, group)
    state = _to_dcp(_entries(model, view), group)
    failure = None
    try:
        dcp.save(state, storage_writer=dcp.FileSystemWriter(partial), process_group=group)
    except (
        CheckpointException
    ) as e:  # a BaseException: `except Exception` in user code would miss it
        failure = e
    if failure is not None:
        os_error = _first_os_error(failure)
        dist.barrier(group=group)  # every rank has stopped writing
        if dist.get_rank(group) == 0:
            shutil.rmtree(partial, ignore_errors=True)
        dist.barrier(group=group)
        first = next(iter(failure.failures.values()))[0]
        reason = (
            _os_error_line(os_error) if os_error is not None else f"{type(first).__name__}: {first}"
        )
        error = OSError if os_error is not None else RuntimeError
        raise error(
            f"saving checkpoint {path!r} failed on rank(s) {sorted(failure.failures)}: {reason}; nothing "
            "was left behind and the previous checkpoint there (if any) is intact"
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
                f"saving checkpoint {path!r} failed on rank 0: {_os_error_line(e)}; nothing was left "
                "behind and the previous checkpoint there (if any) is intact"
            ) from None

    _one_rank(finish, group)


def prune_checkpoints(directory: str | os.PathLike, keep_last: int) -> list[str]:
    """Delete all but the ``keep_last`` highest-step ``step-N`` checkpoints in ``directory``.

    Only aligndp checkpoint directories named ``step-N`` are touched; returns the deleted paths.
    Not collective: call it on one rank after :func:`save` returned.
    """
    if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
        raise ValueError(f"keep_last must be an integer >= 1, got {keep_last!r}")
    directory = os.fspath(directory)
    found = []
    for name in os.listdir(directory) if os.path.isdir(directory) else []:
        match = re.fullmatch(r"step-(\d+)", name)
        full = os.path.join(directory, name)
        if match and os.path.isfile(os.path.join(full, META_FILE)):
            found.append((int(match.group(1)), full))
    doomed = [full for _, full in sorted(found)[:-keep_last]]
    for full in doomed:
        shutil.rmtree(full)
    return doomed


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
            f"checkpoint {path!r} does not fit this model: missing (in the model, not the checkpoint) {missing}; "
            f"unexpected (in the checkpoint, not the model) {unexpected}; shape mismatches {mismatched}. "
            "Load it into the model that wrote it"
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


def _read_meta(path: str) -> dict:
    """``aligndp.json`` of the checkpoint at ``path``, or a one-line ValueError naming what is wrong."""
    if not os.path.exists(path):
        raise ValueError(
            f"no aligndp checkpoint at {path!r}: the path does not exist; pass the path given to save()"
        )
    if not os.path.isdir(path):
        raise ValueError(
            f"{path!r} is a file, not an aligndp checkpoint (a directory written by aligndp.save)"
        )
    meta_path = os.path.join(path, META_FILE)
    try:
        with open(meta_path) as f:
            text = f.read()
    except FileNotFoundError:
        raise ValueError(
            f"no aligndp checkpoint at {path!r} ({META_FILE} is missing): pass the path given to "
            "save(); a save that died before finishing leaves no aligndp.json"
        ) from None
    try:
        meta = json.loads(text)
    except json.JSONDecodeError as e:
        what = "empty" if not text.strip() else f"not valid JSON ({e.msg} at line {e.lineno})"
        raise ValueError(
            f"checkpoint file {meta_path!r} is damaged: {what}; the checkpoint cannot be "
            "trusted, load an earlier one"
        ) from None
    missing = [k for k in ("step", "shapes") if not isinstance(meta, dict) or k not in meta]
    if missing:
        raise ValueError(
            f"checkpoint file {meta_path!r} is damaged: it lacks {missing}; load an earlier checkpoint"
        )
    return meta


def _read_dcp_metadata(path: str):
    """DCP's ``.metadata`` of ``path``, and a check that every shard file it names is whole."""
    metadata_path = os.path.join(path, ".metadata")
    if not os.path.isfile(metadata_path):
        raise ValueError(
            f"checkpoint file {metadata_path!r} is missing: the checkpoint is incomplete, load an "
            "earlier one"
        )
    try:
        metadata = dcp.FileSystemReader(path).read_metadata()
    except (
        pickle.UnpicklingError,
        EOFError,
        OSError,
        AttributeError,
        ImportError,
        IndexError,
        KeyError,
        TypeError,
        ValueError,
    ) as e:  # what unpickling a truncated or foreign file raises
        raise ValueError(
            f"checkpoint file {metadata_path!r} is damaged ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else 'truncated'}); load an earlier checkpoint"
        ) from None
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(
            needed.get(info.relative_path, 0), info.offset + info.length
        )
    for name, length in sorted(needed.items()):
        shard = os.path.join(path, name)
        if not os.path.isfile(shard):
            raise ValueError(
                f"checkpoint file {shard!r} is missing: the checkpoint is incomplete, load an earlier one"
            )
        size = os.path.getsize(shard)
        if size < length:
            raise ValueError(
                f"checkpoint file {shard!r} is truncated: {size} bytes, the checkpoint's index needs "
                f"{length}; load an earlier checkpoint"
            )
    return metadata


def _agreed(fn, group):
    """``fn()`` on every rank; if it raised a ValueError anywhere, the same one on every rank."""
    result, error = None, None
    try:
        result = fn()
    except ValueError as e:
        error = str(e)
    errors: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(errors, error, group=group)
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise ValueError(first)
    return result


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
        meta = _read_meta(path)
        _check_shapes(path, meta["shapes"], model)
        return meta, _read_dcp_metadata(path)

    meta, dcp_metadata = _agreed(check, group)
    if hasattr(view, "gather"):
        view.gather.wait_all()
    entries = _templates(model, view, dcp_metadata.state_dict_metadata)
    state = _to_dcp(entries, group)
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
