"""The files of a checkpoint: where it may be written, and what is checked before a load.

The file side of [Note: checkpoint safety] (aligndp/state/checkpoint.py): only an aligndp
checkpoint directory is ever replaced; ``aligndp.json``, DCP's ``.metadata`` and every shard
file are checked before a load reads them; an OSError becomes one line naming the reason
and the file; rank 0's file operations raise on every rank; old ``step-N`` checkpoints are
pruned.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import re
import shutil

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

__all__ = [
    "FORMAT",
    "META_FILE",
    "agreed",
    "check_target",
    "first_os_error",
    "is_checkpoint_dir",
    "on_rank_zero",
    "os_error_line",
    "prune_checkpoints",
    "read_dcp_metadata",
    "read_meta",
]

FORMAT = 1
META_FILE = "aligndp.json"

_DCP_FILE = re.compile(r"^(__\d+_\d+\.distcp|\.metadata)$")


def is_checkpoint_dir(path: str) -> bool:
    """An aligndp checkpoint (or the remains of one being written): safe to replace."""
    if not os.path.isdir(path) or os.path.islink(path):
        return False
    names = os.listdir(path)
    return not names or META_FILE in names or any(_DCP_FILE.match(n) for n in names)


def check_target(path: str) -> None:
    """Refuse to write where a user's file or directory would be renamed or deleted."""
    for where in (path, path + ".partial", path + ".old"):
        if os.path.lexists(where) and not is_checkpoint_dir(where):
            kind = (
                "a file"
                if not os.path.isdir(where) or os.path.islink(where)
                else "a directory that is not an aligndp checkpoint"
            )
            raise ValueError(
                f"aligndp.save({path!r}) would replace {where!r}, which is {kind}; aligndp never "
                "deletes or renames your files: save to a new path (or move that one away)"
            )


def on_rank_zero(fn, group) -> None:
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


def os_error_line(e: BaseException) -> str:
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


def first_os_error(e: CheckpointException) -> BaseException | None:
    for exc, _ in e.failures.values():
        seen = exc
        while seen is not None:
            if isinstance(seen, OSError):
                return seen
            seen = seen.__cause__ or seen.__context__
    return None


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


def read_meta(path: str) -> dict:
    """``aligndp.json`` of the checkpoint at ``path``, or a one-line ValueError naming what is
    wrong."""
    if not os.path.exists(path):
        raise ValueError(
            f"no aligndp checkpoint at {path!r}: the path does not exist; pass the path given "
            "to save()"
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
            f"checkpoint file {meta_path!r} is damaged: it lacks {missing}; load an earlier "
            "checkpoint"
        )
    return meta


def read_dcp_metadata(path: str):
    """DCP's ``.metadata`` of ``path``, and a check that every shard file it names is whole."""
    metadata_path = os.path.join(path, ".metadata")
    if not os.path.isfile(metadata_path):
        raise ValueError(
            f"checkpoint file {metadata_path!r} is missing: the checkpoint is incomplete, load "
            "an earlier one"
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
                f"checkpoint file {shard!r} is missing: the checkpoint is incomplete, load an "
                "earlier one"
            )
        size = os.path.getsize(shard)
        if size < length:
            raise ValueError(
                f"checkpoint file {shard!r} is truncated: {size} bytes, the checkpoint's index "
                f"needs {length}; load an earlier checkpoint"
            )
    return metadata


def agreed(fn, group):
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
