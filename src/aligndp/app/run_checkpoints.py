"""Which checkpoint a run resumes from, and a Ctrl-C that stops a run at a checkpoint.

A complete checkpoint is a ``step-N`` directory holding ``aligndp.json``, which
:func:`aligndp.save` writes last, into ``step-N.partial``, before renaming it into place: a
``step-N.partial`` left by a save that died, or a user's own ``step-...`` directory, is never
taken for one.
"""

from __future__ import annotations

import os
import re
import signal
import threading

from aligndp.state.checkpoint_files import META_FILE

__all__ = [
    "StopRequest",
    "check_resume_from",
    "checkpoint_dir",
    "is_complete",
    "latest_checkpoint",
    "resume_point",
]

_CHECKPOINT_NAME = re.compile(r"^step-(\d+)$")


def checkpoint_dir(directory: str, step: int) -> str:
    return os.path.join(directory, f"step-{step:06d}")


def is_complete(path: str) -> bool:
    """``path`` is a checkpoint :func:`aligndp.save` finished writing."""
    return os.path.isfile(os.path.join(path, META_FILE))


def latest_checkpoint(directory: str) -> str | None:
    """The complete ``step-N`` checkpoint with the highest step in ``directory``, if any."""
    if not os.path.isdir(directory):
        return None
    steps = [
        (int(m.group(1)), name)
        for name in os.listdir(directory)
        if (m := _CHECKPOINT_NAME.match(name)) and is_complete(os.path.join(directory, name))
    ]
    return os.path.join(directory, max(steps)[1]) if steps else None


def resume_point(config) -> str | None:
    """The checkpoint a ``--resume`` run loads: ``--resume-from``, else the newest complete one
    in the checkpoint directory (None: there is none)."""
    if config.resume_from is not None:
        return config.resume_from
    return latest_checkpoint(config.checkpoint_path)


def check_resume_from(path: str) -> None:
    """Refuse (one line) a ``--resume-from`` that is no complete checkpoint, naming those
    beside it."""
    if is_complete(path):
        return
    parent = os.path.dirname(os.path.normpath(path)) or "."
    found = sorted(
        name
        for name in (os.listdir(parent) if os.path.isdir(parent) else [])
        if _CHECKPOINT_NAME.match(name) and is_complete(os.path.join(parent, name))
    )
    beside = f"; complete ones in {parent}: {', '.join(found)}" if found else ""
    raise ValueError(
        f"--resume-from {path} is not a complete aligndp checkpoint (no {META_FILE} in it)" + beside
    )


class StopRequest:
    """Ctrl-C (SIGINT) while training asks the run to stop after the step under way.

    Inside ``with``, SIGINT only sets :attr:`requested`; the training loop sums it over the
    ranks with the step's loss, so every rank stops after the same step, saves one checkpoint
    and raises KeyboardInterrupt. A terminal's Ctrl-C reaches every rank (and the launcher,
    which forwards it again and waits for the ranks before killing them).
    """

    def __init__(self) -> None:
        self.requested = False
        self._previous = None

    def _handle(self, signum, frame) -> None:
        self.requested = True

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
