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
import zlib

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

__all__ = [
    "FORMAT",
    "META_FILE",
    "Writer",
    "file_checksum",
    "own_checksums",
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

FORMAT = 2
"""1: 1-D ShardedTensor pieces; 2: full-shape tensors a plain module loads, per-file checksums."""
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
        errno.EFBIG: "a file would exceed the size limit (ulimit -f / RLIMIT_FSIZE)",
    }
    words = getattr(e, "strerror", None) or (str(e) or type(e).__name__).splitlines()[0]
    reason = reasons.get(getattr(e, "errno", None), words)
    where = getattr(e, "filename", None)
    return f"{reason} ({where})" if where else reason


def _os_error_under(e: BaseException) -> OSError | None:
    seen: BaseException | None = e
    while seen is not None:
        if isinstance(seen, OSError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def first_os_error(e: CheckpointException) -> BaseException | None:
    return next((os_e for exc, _ in e.failures.values() if (os_e := _os_error_under(exc))), None)


class Writer(dcp.FileSystemWriter):
    """DCP's file writer, raising the OSError under a failed write itself.

    torch's zip writer turns a full disk into ``RuntimeError: ... unexpected pos`` with the
    ``OSError`` only as its ``__context__``, which DCP loses when it sends a failure between
    ranks (pickled); lifted here, the rank's failure *is* the OSError."""

    def write_data(self, plan, planner):
        try:
            future = super().write_data(plan, planner)
            future.wait()  # a failure inside the future surfaces here too
        except Exception as e:
            raise _lifted(e, self.path) from e
        return future

    def finish(self, metadata, results) -> None:
        try:
            super().finish(metadata, results)
        except Exception as e:
            raise _lifted(e, self.path) from e


def _lifted(e: Exception, where) -> Exception:
    os_error = _os_error_under(e)
    if os_error is None or os_error is e:
        return e
    return OSError(os_error.errno, os_error.strerror, os_error.filename or os.fspath(where))


def file_checksum(path: str) -> str:
    """CRC-32 of a file's bytes (zlib's, fast enough to check every file), as 8 hex digits."""
    crc, block = 0, bytearray(1 << 23)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(block):
            crc = zlib.crc32(memoryview(block)[:n], crc)
    return f"{crc:08x}"


def own_checksums(partial: str, rank: int) -> tuple[dict[str, str], str | None]:
    """Checksums of the shard files ``rank`` wrote into ``partial`` (DCP names them
    ``__<rank>_<n>.distcp``), or the one-line reason reading them failed."""
    try:
        names = [n for n in os.listdir(partial) if re.fullmatch(rf"__{rank}_\d+\.distcp", n)]
        return {n: file_checksum(os.path.join(partial, n)) for n in names}, None
    except OSError as e:
        return {}, os_error_line(e)


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
    if isinstance(meta, dict) and meta.get("format", FORMAT) != FORMAT:
        raise ValueError(
            f"checkpoint {path!r} is in aligndp checkpoint format {meta.get('format')!r} (1-D "
            f"pieces, before full-shape tensors); this aligndp reads format {FORMAT} only: resume "
            "it with the aligndp version that wrote it"
        )
    missing = [
        k for k in ("step", "shapes", "checksums") if not isinstance(meta, dict) or k not in meta
    ]
    if missing:
        raise ValueError(
            f"checkpoint file {meta_path!r} is damaged: it lacks {missing}; load an earlier "
            "checkpoint"
        )
    return meta


def read_dcp_metadata(path: str, checksums: dict[str, str], *, share: tuple[int, int] = (0, 1)):
    """DCP's ``.metadata`` of ``path``, and a check that every shard file it names is whole:
    present, long enough, and (the ``share = (rank, world size)`` of files this rank reads
    through) with the checksum ``save`` recorded."""
    metadata_path = os.path.join(path, ".metadata")
    if not os.path.isfile(metadata_path):
        raise ValueError(
            f"checkpoint file {metadata_path!r} is missing: the checkpoint is incomplete, load "
            "an earlier one"
        )
    _check_sum(path, ".metadata", checksums)
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
    rank, size = share
    for name in sorted(needed)[rank::size]:
        _check_sum(path, name, checksums)
    return metadata


def _check_sum(path: str, name: str, checksums: dict[str, str]) -> None:
    where = os.path.join(path, name)
    try:
        found = file_checksum(where)
    except OSError as e:
        raise ValueError(f"checkpoint file {where!r} cannot be read: {os_error_line(e)}") from None
    if found != checksums.get(name):
        raise ValueError(
            f"checkpoint file {where!r} is damaged: its CRC-32 is {found}, {META_FILE} recorded "
            f"{checksums.get(name)} when it was saved; load an earlier checkpoint"
        )


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
