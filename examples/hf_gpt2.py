"""aligndp on an unmodified Hugging Face model: a small GPT-2 trained on 2 gloo ranks.

    pip install -e '.[hf]'          # or: pip install transformers
    torchrun --nproc-per-node 2 examples/hf_gpt2.py --steps 30

The model is ``transformers.GPT2LMHeadModel`` built from a ``GPT2Config`` (random weights,
nothing downloaded), with the output head tied to the token embedding, so one parameter is
used twice per step. ``aligndp.parallelize`` wraps it as it is: no change to the model's code.
The data: byte-level sums such as ``12+7=19;``, made here from ``(seed, step)``.
"""

from __future__ import annotations

import argparse
import json
import random

import torch
import torch.distributed as dist
import torch.nn.functional as F

import aligndp

SEQ_LEN = 64
BATCH_SIZE = 8  # global: each rank takes its rows
LR = 3e-3


def build_model(seed: int = 0):
    """A 2-layer GPT-2 with byte vocabulary and tied embeddings; no dropout (ranks stay
    comparable)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=256,
        n_positions=SEQ_LEN,
        n_embd=64,
        n_layer=2,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        tie_word_embeddings=True,
        bos_token_id=ord(";"),
        eos_token_id=ord(";"),
    )
    torch.manual_seed(seed)
    return GPT2LMHeadModel(config)


def global_batch(step: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(inputs, targets)`` of ``step``, each ``(BATCH_SIZE, SEQ_LEN)`` bytes of sums; the
    targets are the inputs shifted by one. The same on every rank."""
    rng = random.Random(seed * 1_000_003 + step)
    rows = []
    for _ in range(BATCH_SIZE):
        text = ""
        while len(text) <= SEQ_LEN:
            a, b = rng.randrange(100), rng.randrange(100)
            text += f"{a}+{b}={a + b};"
        rows.append(list(text[: SEQ_LEN + 1].encode()))
    tokens = torch.tensor(rows)
    return tokens[:, :-1], tokens[:, 1:]


def loss_of(model, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy."""
    logits = model(input_ids=inputs).logits  # (batch, seq_len, vocab)
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def train(steps: int, seed: int) -> list[float]:
    """Wrap the HF model, train on this rank's rows of each global batch; the global losses."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model, optimizer = aligndp.parallelize(build_model(seed), optimizer="adamw", lr=LR)
    hf = model.module
    if hf.lm_head.weight is not hf.transformer.wte.weight:
        raise RuntimeError("the head is no longer tied to the token embedding after parallelize()")
    losses = []
    for step in range(steps):
        inputs, targets = (t.chunk(world_size)[rank] for t in global_batch(step, seed))
        loss = loss_of(model, inputs, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)  # the loss of the whole global batch
        losses.append(mean_loss.item() / world_size)
        if rank == 0 and (step % 10 == 0 or step == steps - 1):
            print(f"step {step:3d}  loss {losses[-1]:.4f}", flush=True)
    if rank == 0:
        numel = sum(p.numel() for p in hf.parameters())
        print(f"GPT2LMHeadModel, {numel:,} params on {world_size} ranks", flush=True)
    return losses


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--losses", help="write the global losses to this JSON file (rank 0)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        losses = train(args.steps, args.seed)
        if args.losses and dist.get_rank() == 0:
            with open(args.losses, "w") as f:
                json.dump(losses, f)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
