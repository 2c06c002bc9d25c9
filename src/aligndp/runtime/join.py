"""The bookkeeping of ``DataParallel.join()`` (uneven inputs): one flag all-reduce per forward."""

from __future__ import annotations

from typing import Protocol

import torch

from aligndp.runtime.collectives import Collectives

__all__ = ["Join"]


class _Model(Protocol):
    world_size: int
    device: torch.device
    collectives: Collectives


class Join:
    """The bookkeeping of ``DataParallel.join``: one flag all-reduce per forward."""

    def __init__(self, model: _Model) -> None:
        self.model = model

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
            raise ValueError(self._message(training))

    def leave(self) -> None:
        training = self._still_training(0)
        if training:
            raise ValueError(self._message(training))
