"""The bookkeeping of ``DataParallel.join()`` (uneven inputs): one flag all-reduce per forward."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Protocol

import torch

from aligndp.runtime.collectives import Collectives

__all__ = ["Join", "joining"]


class _Model(Protocol):
    _joined: Join | None
    world_size: int
    device: torch.device
    collectives: Collectives


class Join:
    """The bookkeeping of ``DataParallel.join``: one flag all-reduce per forward."""

    def __init__(self, model: _Model) -> None:
        self.model = model

    @classmethod
    def enter(
        cls, model: _Model, divide_by_initial_world_size, enable, throw_on_early_termination
    ) -> Join | None:
        """``model.join(...)``'s keywords, as torch DDP takes them; None when not enabled.

        Every rank raises the same ``RuntimeError`` when one runs out of batches (torch's
        ``throw_on_early_termination=True``, whatever it is given: aligndp has no shadow
        collectives for a rank that joined early, so it never trains on with fewer ranks, and
        ``divide_by_initial_world_size`` never changes a step)."""
        for name, value in (
            ("divide_by_initial_world_size", divide_by_initial_world_size),
            ("enable", enable),
            ("throw_on_early_termination", throw_on_early_termination),
        ):
            if not isinstance(value, bool):
                raise TypeError(f"join({name}=...) takes a bool, got {value!r}")
        return cls(model) if enable else None

    def _still_training(self, flag: int) -> int:
        t = torch.tensor([flag], dtype=torch.int32, device=self.model.device)
        self.model.collectives.all_reduce_sum(t)
        return int(t.item())

    def _message(self, training: int) -> str:
        ws = self.model.world_size
        return (
            f"uneven inputs: {ws - training} of {ws} rank(s) ran out of batches while "
            f"{training} still train; give every rank the same number of batches (e.g. "
            "DistributedSampler(drop_last=True), or drop the last incomplete batch)"
        )

    def forward(self) -> None:
        training = self._still_training(1)
        if training < self.model.world_size:
            raise RuntimeError(self._message(training))

    def leave(self) -> None:
        training = self._still_training(0)
        if training:
            raise RuntimeError(self._message(training))


@contextlib.contextmanager
def joining(
    model: _Model, divide_by_initial_world_size, enable, throw_on_early_termination
) -> Iterator[None]:
    """``model.join(...)``: the model's :class:`Join` while inside (None: not enabled)."""
    model._joined = joined = Join.enter(
        model, divide_by_initial_world_size, enable, throw_on_early_termination
    )
    try:
        yield
    finally:
        model._joined = None
    if joined is not None:
        joined.leave()  # only after a normal exit: after an error the peers are out of step
