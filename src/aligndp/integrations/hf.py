"""``AlignDPTrainer``: Hugging Face's ``transformers.Trainer`` with aligndp's data parallelism.

    trainer = AlignDPTrainer(model=model, args=args, train_dataset=data, sharding="zero1")
    trainer.train()            # launched as usual: torchrun --nproc-per-node 2 train.py

The Trainer builds its optimizer as always (``args.learning_rate``, ``args.weight_decay`` and
its no-decay groups, or ``optimizers=(opt, None)``); aligndp rebuilds that optimizer over its
buffers in place of wrapping the model in torch DDP, and the Trainer's lr scheduler is made on
it ([Note: trainer integrations]). ``optimizer="muon"`` (or any name ``parallelize`` takes)
replaces the class at ``args.learning_rate``. Gradient clipping (``args.max_grad_norm``) and
the logged ``grad_norm`` are aligndp's, over the reduced gradients of every rank.
Checkpoints are the Trainer's own (``save_steps``, ``train(resume_from_checkpoint=)``): the
model's weights where the Trainer writes them, the optimizer as an aligndp (DCP) checkpoint
in ``aligndp/`` inside the checkpoint folder, written by every rank (ZeRO-1 shards included).
"""

from __future__ import annotations

import os

import torch
import torch.nn as nn
import transformers

from aligndp.integrations.optimizer import parallelize_like
from aligndp.runtime.ddp import DataParallel
from aligndp.state.checkpoint import load, save

__all__ = ["AlignDPTrainer"]

OPTIMIZER_DIR = "aligndp"
"""The aligndp checkpoint inside a Trainer checkpoint folder."""
SCHEDULER_FILE = "scheduler.pt"
"""The lr scheduler's state, where the Trainer keeps it."""


class AlignDPTrainer(transformers.Trainer):
    """``transformers.Trainer`` with ``aligndp.parallelize`` in place of torch DDP.

    Args:
        sharding: ``"none"`` (replicated) or ``"zero1"`` (sharded optimizer state).
        optimizer: None (default) rebuilds the Trainer's optimizer; a name or class that
            ``parallelize`` takes replaces it, at ``args.learning_rate``.
        parallelize_kwargs: other keywords of ``aligndp.parallelize`` (``bucket_numel``,
            ``wgrad``, ...); clipping comes from ``args.max_grad_norm``.
        *args, **kwargs: as ``transformers.Trainer``.
    """

    def __init__(
        self,
        *args,
        sharding: str = "none",
        optimizer: str | type[torch.optim.Optimizer] | None = None,
        parallelize_kwargs: dict | None = None,
        **kwargs,
    ) -> None:
        self._aligndp = dict(parallelize_kwargs or {}, sharding=sharding, optimizer=optimizer)
        if "max_grad_norm" in self._aligndp:
            raise ValueError(
                "parallelize_kwargs={'max_grad_norm': ...}: AlignDPTrainer clips by "
                "TrainingArguments(max_grad_norm=...)"
            )
        self._wrapped: tuple[DataParallel, torch.optim.Optimizer] | None = None
        """The model and optimizer parallelize built."""
        super().__init__(*args, **kwargs)

    # ---- wrapping and the optimizer ----
    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader=None) -> nn.Module:
        if not training or isinstance(model, DataParallel):
            return model
        if self._wrapped is not None:
            return self._wrapped[0]
        user = self.optimizer  # made by create_optimizer() just before
        kwargs = dict(self._aligndp)
        if kwargs["optimizer"] is not None:
            kwargs.setdefault("lr", self.args.learning_rate)
        wrapped, optimizer = parallelize_like(model, user, **kwargs)
        self._wrapped = (wrapped, optimizer)
        self.optimizer = optimizer
        return wrapped

    def _clip_grad_norm(self, model: nn.Module) -> torch.Tensor:
        return self._wrapped[1].clip_grad_norm_(self.args.max_grad_norm)

    def _get_grad_norm(self, model: nn.Module, grad_norm=None):
        return self._wrapped[1].grad_norm() if grad_norm is None else grad_norm

    # ---- checkpoints: the Trainer's folders, the optimizer as an aligndp checkpoint ----
    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        model, optimizer = self._wrapped
        save(os.path.join(output_dir, OPTIMIZER_DIR), model, optimizer, step=self.state.global_step)
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_FILE))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        path = os.path.join(checkpoint, OPTIMIZER_DIR)
        if not os.path.isdir(path):
            raise ValueError(
                f"{checkpoint!r} holds no {OPTIMIZER_DIR}/ optimizer checkpoint: resume "
                "AlignDPTrainer from a checkpoint an AlignDPTrainer saved"
            )
        load(path, *self._wrapped)
        state = torch.load(os.path.join(checkpoint, SCHEDULER_FILE), weights_only=True)
        self.lr_scheduler.load_state_dict(state)
