"""Train your own model with aligndp: a complete data-parallel script, launched by torchrun.

    torchrun --nproc-per-node 2 examples/train_own_model.py                  # 2 CPU ranks, gloo
    torchrun --nproc-per-node 2 examples/train_own_model.py --stop-at 30     # stopped early...
    torchrun --nproc-per-node 2 examples/train_own_model.py --resume         # ...and continued
    torchrun --nproc-per-node 8 examples/train_own_model.py --device cuda    # 8 GPUs, NCCL

Copy this file and replace ``build_model`` and ``global_batch`` with your own; the loop is a
torch DDP loop. It uses only ``import aligndp`` names (``parallelize``, ``save``, ``load``).
The task: a small MLP learns the labels a fixed random "teacher" gives to random inputs.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import aligndp

DIM, HIDDEN, CLASSES = 32, 128, 8
BATCH_SIZE = 64  # global: each rank takes its rows
WARMUP = 10


def build_model(seed: int) -> nn.Module:
    """Your model: any ``nn.Module``, unmodified (aligndp wraps it from outside)."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(DIM, HIDDEN), nn.GELU(), nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, CLASSES)
    )


def global_batch(step: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole batch of ``step``, the same on every rank: a function of ``(seed, step)``, so a
    resumed run sees the batches the uninterrupted run would have."""
    teacher = torch.randn(DIM, CLASSES, generator=torch.Generator().manual_seed(seed))
    inputs = torch.randn(BATCH_SIZE, DIM, generator=torch.Generator().manual_seed(seed + step + 1))
    return inputs, (inputs @ teacher).argmax(dim=1)


def param_groups(module: nn.Module) -> list[dict]:
    """Weight decay on matrices only, the usual split."""
    decay = [p for p in module.parameters() if p.ndim >= 2]
    no_decay = [p for p in module.parameters() if p.ndim < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]


def lr_schedule(optimizer, total_steps: int) -> torch.optim.lr_scheduler.LRScheduler:
    """Linear warm-up, then cosine decay to 0 at ``total_steps``: torch's own schedulers."""
    sched = torch.optim.lr_scheduler
    warmup = sched.LinearLR(optimizer, start_factor=0.1, total_iters=WARMUP)
    cosine = sched.CosineAnnealingLR(optimizer, T_max=max(1, total_steps - WARMUP))
    return sched.SequentialLR(optimizer, [warmup, cosine], milestones=[WARMUP])


def train(args: argparse.Namespace) -> list[float]:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if BATCH_SIZE % world_size:
        raise ValueError(f"batch {BATCH_SIZE} does not split into {world_size} ranks")
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    module = build_model(args.seed).to(device)
    groups = param_groups(module)
    model, optimizer = aligndp.parallelize(
        module, optimizer="adamw", sharding=args.sharding, lr=args.lr, param_groups=groups
    )
    scheduler = lr_schedule(optimizer, args.steps)
    out = pathlib.Path(args.out)
    checkpoint = out / "checkpoint"
    start = 0
    if args.resume:
        start = aligndp.load(checkpoint, model, optimizer)  # collective: every rank calls it
        scheduler.load_state_dict(torch.load(out / "scheduler.pt"))
    end = args.steps if args.stop_at is None else min(args.stop_at, args.steps)
    losses = []
    for step in range(start, end):
        inputs, labels = (
            t.chunk(world_size)[rank].to(device) for t in global_batch(step, args.seed)
        )
        loss = F.cross_entropy(model(inputs), labels)
        loss.backward()  # gradients are averaged over the ranks when backward returns
        if args.sharding == "none":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # p.grad: the reduced grad
        else:
            optimizer.clip_grad_norm_(1.0)  # sharded: each rank holds a shard of the gradient
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)  # the loss of the whole global batch
        losses.append(mean_loss.item() / world_size)
        if rank == 0 and (step % 20 == 0 or step == end - 1):
            print(f"step {step:4d}  loss {losses[-1]:.4f}  lr {scheduler.get_last_lr()[0]:.2e}")
    aligndp.save(checkpoint, model, optimizer, step=end)  # collective: each rank writes its part
    if rank == 0:
        torch.save(scheduler.state_dict(), out / "scheduler.pt")
        log = out / "losses.jsonl"
        with log.open("a" if args.resume else "w") as f:
            f.writelines(
                json.dumps({"step": start + i, "loss": v}) + "\n" for i, v in enumerate(losses)
            )
        print(f"saved {checkpoint} at step {end}; losses in {log}")
    return losses


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="train up to this step")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--sharding", choices=["none", "zero1"], default="none")
    parser.add_argument("--device", default="cpu", help="cpu (gloo) or cuda (NCCL)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="runs/own_model", help="checkpoint and loss log")
    parser.add_argument("--resume", action="store_true", help="continue from --out's checkpoint")
    parser.add_argument(
        "--stop-at", type=int, help="checkpoint and stop at this step (a job cut short)"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("nccl" if args.device.startswith("cuda") else "gloo")
    try:
        os.makedirs(args.out, exist_ok=True)
        train(args)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
