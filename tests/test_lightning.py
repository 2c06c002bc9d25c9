"""AlignDPStrategy against Lightning's own DDPStrategy, on 2 gloo ranks ([Note: trainer
integrations]): the same LightningModule, data and seed give the same losses, step by step;
a run saved by ``trainer.save_checkpoint`` and resumed by ``fit(ckpt_path=)`` continues as
the uninterrupted run does; the user's optimizer, lr and lr scheduler are the ones stepped.

The ranks are tests/_dist.py's gloo world: Lightning finds the process group initialised and
``LOCAL_RANK`` set (its ``LightningEnvironment``), so it launches nothing itself."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

pytest.importorskip("lightning")

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402

from aligndp.integrations.lightning import AlignDPStrategy, load_weights  # noqa: E402
from tests._dist import case, make_tests  # noqa: E402
from tests.models import ADAMW_GAIN, assert_close, ckpt, order_tolerance  # noqa: E402

STEPS = 4
RESUME = 2  # the step resumed from
BATCH = 6  # per rank


class Regression(pl.LightningModule):
    """A small MLP; AdamW with a step-decay schedule, both given by ``configure_optimizers``."""

    def __init__(self, lr: float = 0.01) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(12, 40), nn.Tanh(), nn.Linear(40, 3))
        self.lr = lr
        self.losses: list[float] = []
        self.lrs: list[float] = []
        self.val_losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.item())
        self.lrs.append(self.trainer.optimizers[0].param_groups[0]["lr"])
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.val_losses.append(nn.functional.mse_loss(self.net(x), y).item())

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr, betas=(0.8, 0.95), weight_decay=0.5)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def loader(ws: int) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH * ws, 12, generator=g)
    y = torch.randn(BATCH * ws, 3, generator=g)
    # one batch per rank and epoch, the same every epoch: Lightning re-enters a resumed epoch
    # at its next batch index but restarts a loader that cannot resume, and its
    # DistributedSampler would reshuffle each epoch
    rank = dist.get_rank()
    data = torch.utils.data.TensorDataset(x[rank::ws], y[rank::ws])
    return torch.utils.data.DataLoader(data, batch_size=BATCH, shuffle=False)


def fit(strategy, ws: int, *, steps: int = STEPS, ckpt_path=None, callbacks=(), module=None):
    os.environ.setdefault("LOCAL_RANK", str(dist.get_rank()))
    module = module or Regression()
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=ws,
        max_steps=steps,
        logger=False,
        enable_checkpointing=bool(callbacks),
        callbacks=list(callbacks),
        use_distributed_sampler=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, loader(ws), ckpt_path=ckpt_path)
    return trainer, module


def tolerance() -> float:
    # a weight's gradient sums the rows of both ranks (12) against DDP's all-reduce of the same
    return order_tolerance(terms=2 * BATCH * 40, steps=STEPS, gain=ADAMW_GAIN)


@case(2)
def case_losses_match_ddp_strategy(rank, ws):
    _, theirs = fit(DDPStrategy(), ws)
    for sharding in ("none", "zero1"):
        _, ours = fit(AlignDPStrategy(sharding=sharding), ws)
        assert len(ours.losses) == STEPS and ours.lrs == theirs.lrs  # the user's schedule
        assert_close(torch.tensor(ours.losses), torch.tensor(theirs.losses), sharding, tolerance())
        for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
            assert_close(p.detach(), q.detach(), f"{sharding} {name}", tolerance())
    assert theirs.lrs == [0.01 * 0.5**i for i in range(STEPS)]


@case(2)
def case_optimizer_replaced_at_the_users_lr(rank, ws):
    trainer, ours = fit(AlignDPStrategy(optimizer="sgd"), ws, steps=2)
    (opt,) = trainer.optimizers
    assert isinstance(opt.inner[0], torch.optim.SGD)
    assert ours.lrs == [0.01, 0.005]  # configure_optimizers's lr and schedule, on SGD


@case(2)
def case_checkpoint_saved_and_resumed_through_lightning(rank, ws):
    root = ckpt("lightning")
    saver = ModelCheckpoint(dirpath=root, every_n_epochs=1, save_top_k=-1)
    _, whole = fit(AlignDPStrategy(sharding="zero1"), ws, callbacks=[saver])
    path = os.path.join(root, f"epoch={RESUME - 1}-step={RESUME}.ckpt")
    assert sorted(os.listdir(path)) == ["aligndp", "trainer.ckpt"]
    second, rest = fit(AlignDPStrategy(sharding="zero1"), ws, ckpt_path=path)
    assert second.global_step == STEPS and len(rest.losses) == STEPS - RESUME
    # bit for bit: the same ranks add the same numbers in the same order
    assert rest.losses == whole.losses[RESUME:]
    assert rest.lrs == whole.lrs[RESUME:]  # the lr scheduler resumed too
    for p, q in zip(rest.parameters(), whole.parameters()):
        assert torch.equal(p, q)
    # the weights alone, read as plain DCP: by hand, and by validate(ckpt_path=)
    last = os.path.join(root, f"epoch={STEPS - 1}-step={STEPS}.ckpt")
    fresh = Regression()
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    load_weights(fresh, last)
    for p, q in zip(fresh.parameters(), whole.parameters()):
        assert torch.equal(p, q)
    checked = Regression()
    trainer = pl.Trainer(
        strategy=AlignDPStrategy(), accelerator="cpu", devices=ws, logger=False,
        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
    )  # fmt: skip
    trainer.validate(checked, loader(ws), ckpt_path=last, verbose=False)
    assert checked.val_losses == [
        nn.functional.mse_loss(whole.net(x), y).item() for x, y in loader(ws)
    ]


@case(2)
def case_lightning_clipping_refused_with_the_alternative(rank, ws):
    os.environ.setdefault("LOCAL_RANK", str(dist.get_rank()))
    trainer = pl.Trainer(
        strategy=AlignDPStrategy(),
        accelerator="cpu",
        devices=ws,
        max_steps=1,
        gradient_clip_val=1.0,
        use_distributed_sampler=False,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with pytest.raises(ValueError, match=r"AlignDPStrategy\(max_grad_norm=1.0\)"):
        trainer.fit(Regression(), loader(ws))


def test_import_aligndp_loads_no_trainer():
    """``import aligndp`` (the CLI's first import too) loads neither Lightning nor transformers;
    only importing an integration module does."""
    code = (
        "import sys, aligndp; "
        "print([m for m in ('lightning', 'transformers', 'accelerate') if m in sys.modules])"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr


make_tests(globals())
