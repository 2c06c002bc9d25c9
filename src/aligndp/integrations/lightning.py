"""``AlignDPStrategy``: PyTorch Lightning's DDP strategy with aligndp's data parallelism.

    trainer = lightning.Trainer(
        strategy=AlignDPStrategy(sharding="zero1"), devices=2, accelerator="cpu"
    )

The LightningModule is wrapped by ``aligndp.parallelize`` instead of torch DDP and stepped by
the optimizer it builds: the one ``configure_optimizers`` returns, rebuilt over aligndp's
buffers with the same class, groups and options, its lr schedulers moved onto it; or, with
``optimizer=`` (``"muon"``, ``"adamw"``, a class), that one at the user's lr unless ``lr=``
([Note: trainer integrations]). Everything else is Lightning's: launching, the loop, logging,
callbacks. ``trainer.save_checkpoint(path)`` (and ``ModelCheckpoint``) writes a directory:
``aligndp/`` (an aligndp checkpoint, written by every rank, reshardable) and
``trainer.ckpt`` (Lightning's own state: loops, callbacks, lr schedulers); ``fit(ckpt_path=)``
resumes from it, ``validate``/``test``/``predict(ckpt_path=)`` load its weights.

Lightning's own gradient clipping reads ``param.grad``, which aligndp keeps in its buffers:
pass ``max_grad_norm=`` here instead (refused on the Trainer, not silently skipped).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Generator, Mapping
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed.checkpoint as dcp
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn

from aligndp.integrations.optimizer import move_scheduler, parallelize_like
from aligndp.runtime.ddp import DataParallel
from aligndp.state.checkpoint import load, save

__all__ = ["AlignDPStrategy", "load_weights"]

MODEL_DIR = "aligndp"
"""The aligndp checkpoint inside a checkpoint directory."""
TRAINER_FILE = "trainer.ckpt"
"""Lightning's own state inside a checkpoint directory."""


class _StepAfterClosure:
    """The optimizer as Lightning's precision plugin drives it: ``step(closure)`` runs the
    closure (forward, backward and Lightning's hooks) and then aligndp's step, which takes no
    closure (its gradients are reduced during backward)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    def step(self, closure=None, **kwargs):
        loss = closure() if closure is not None else None
        self.optimizer.step(**kwargs)
        return loss

    def __getattr__(self, name: str):
        return getattr(self.optimizer, name)


class AlignDPStrategy(DDPStrategy):
    """Lightning's ``DDPStrategy`` with ``aligndp.parallelize`` in place of torch DDP.

    Args:
        sharding: ``"none"`` (replicated) or ``"zero1"`` (sharded optimizer state).
        optimizer: None (default) follows ``configure_optimizers``'s optimizer; a name or
            class that ``parallelize`` takes replaces it, at its lr unless ``lr=`` is given.
        **parallelize_kwargs: any other keyword of ``aligndp.parallelize`` (``lr``,
            ``max_grad_norm``, ``bucket_numel``, ``wgrad``, ...).
    """

    strategy_name = "aligndp"

    def __init__(
        self,
        sharding: str = "none",
        optimizer: str | type[torch.optim.Optimizer] | None = None,
        *,
        cluster_environment=None,
        process_group_backend: str | None = None,
        **parallelize_kwargs,
    ) -> None:
        super().__init__(
            cluster_environment=cluster_environment, process_group_backend=process_group_backend
        )
        self._aligndp = dict(parallelize_kwargs, sharding=sharding, optimizer=optimizer)
        self._resume_from: str | None = None
        self._wrapped: tuple[DataParallel, torch.optim.Optimizer] | None = None
        """The model and optimizer parallelize built; kept after teardown, for a save then."""

    # ---- wrapping and the optimizer ----
    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # an aligndp checkpoint loads into the wrapped model and its optimizer

    def configure_ddp(self) -> None:
        """Nothing here: :meth:`setup_optimizers` wraps the model once it knows the optimizer."""

    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        if trainer.gradient_clip_val is not None:
            raise ValueError(
                f"Trainer(gradient_clip_val={trainer.gradient_clip_val}) clips param.grad, "
                "which aligndp keeps in its buffers: pass "
                f"AlignDPStrategy(max_grad_norm={trainer.gradient_clip_val}) instead"
            )
        super().setup_optimizers(trainer)  # the user's optimizers and lr schedulers
        if len(self.optimizers) > 1:
            raise ValueError(
                f"configure_optimizers returned {len(self.optimizers)} optimizers; "
                "AlignDPStrategy builds one (use param groups, or optimizer='muon' to route "
                "matrices to Muon and the rest to AdamW)"
            )
        user = self.optimizers[0] if self.optimizers else None
        module = self.lightning_module
        self.model, optimizer = parallelize_like(module, user, **self._aligndp)
        self._wrapped = (self.model, optimizer)
        for config in self.lr_scheduler_configs:
            move_scheduler(config.scheduler, user, optimizer)
        self.optimizers = [optimizer]

    def optimizer_step(self, optimizer, closure, model=None, **kwargs: Any) -> Any:
        return super().optimizer_step(_StepAfterClosure(optimizer), closure, model, **kwargs)

    @contextmanager
    def block_backward_sync(self) -> Generator:
        if isinstance(self.model, DataParallel):
            with self.model.no_sync():
                yield None
        else:
            yield None

    def teardown(self) -> None:
        if isinstance(self.model, DataParallel):
            self.model = self.lightning_module
        super().teardown()

    # ---- checkpoints: a directory of an aligndp checkpoint and Lightning's own state ----
    def optimizer_state(self, optimizer) -> dict:
        return {}  # in the aligndp checkpoint, every rank's shard of it

    def save_checkpoint(self, checkpoint: dict, filepath, storage_options=None) -> None:
        path = os.fspath(filepath)
        if self._wrapped is None:
            raise ValueError(
                f"AlignDPStrategy saves the model it trained; {path!r} was asked for before "
                "trainer.fit"
            )
        os.makedirs(path, exist_ok=True)
        step = int(checkpoint.get("global_step", 0))
        save(os.path.join(path, MODEL_DIR), *self._wrapped, step=step)
        if self.is_global_zero:  # the model and optimizer are in MODEL_DIR, not here
            trainer_state = {**checkpoint, "state_dict": {}, "optimizer_states": [{}]}
            self.checkpoint_io.save_checkpoint(
                trainer_state, os.path.join(path, TRAINER_FILE), storage_options=storage_options
            )
        self.barrier("AlignDPStrategy.save_checkpoint")

    def remove_checkpoint(self, filepath) -> None:
        if self.is_global_zero:
            shutil.rmtree(os.fspath(filepath), ignore_errors=True)

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict:
        path = os.fspath(checkpoint_path)
        if not os.path.isfile(os.path.join(path, TRAINER_FILE)):
            raise ValueError(
                f"{path!r} is not an AlignDPStrategy checkpoint (a directory holding "
                f"{MODEL_DIR}/ and {TRAINER_FILE}); pass a path trainer.save_checkpoint wrote"
            )
        self._resume_from = os.path.join(path, MODEL_DIR)
        return self.checkpoint_io.load_checkpoint(
            os.path.join(path, TRAINER_FILE), weights_only=False
        )

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        path, self._resume_from = self._resume_from, None
        assert path is not None, "load_checkpoint runs first"
        if isinstance(self.model, DataParallel):  # fitting: the model and its optimizer
            fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
            load(path, self.model, self.optimizers[0] if fitting and self.optimizers else None)
            return
        load_weights(self.lightning_module, os.path.dirname(path), strict=strict)  # validate...

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Nothing here: :meth:`load_model_state_dict` loaded the optimizer with the model."""


def load_weights(module: torch.nn.Module, checkpoint: str | os.PathLike, strict: bool = True):
    """Load the weights of an AlignDPStrategy checkpoint directory into a plain ``module``
    (no process group needed beyond what DCP reads with): read as plain DCP."""
    state = module.state_dict()
    dcp.load({"model": state}, checkpoint_id=os.path.join(os.fspath(checkpoint), MODEL_DIR))
    return module.load_state_dict(state, strict=strict)
