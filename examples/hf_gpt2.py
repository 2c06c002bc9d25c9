"""aligndp on an unmodified Hugging Face model: a small GPT-2 trained on 2 gloo ranks.

    pip install transformers        # or: pip install -e '.[hf]'
    python examples/hf_gpt2.py --steps 30

The model is ``transformers.GPT2LMHeadModel`` built from a ``GPT2Config`` (random weights,
nothing downloaded), with the output head tied to the token embedding, so one parameter is
used twice per step. ``aligndp.parallelize`` wraps it as it is: no change to the model's code.
The data is aligndp's embedded synthetic arithmetic (byte-level, vocab 256).
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F

import aligndp
from aligndp.app.data import BatchSpec, TokenData
from aligndp.app.train import launch_local

SEQ_LEN = 64
BATCH_SIZE = 8
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


def loss_of(model, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy; ``targets`` are ``inputs`` shifted by one
    (aligndp.app.data)."""
    logits = model(input_ids=inputs).logits  # (batch, seq_len, vocab)
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def train_rank(steps: int, seed: int) -> dict:
    """One rank: wrap the HF model, train on this rank's rows of each global batch."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        rank, dp_size = dist.get_rank(), dist.get_world_size()
        model, optimizer = aligndp.parallelize(build_model(seed), optimizer="adamw", lr=LR)
        hf = model.module
        if hf.lm_head.weight is not hf.transformer.wte.weight:
            raise RuntimeError(
                "the head is no longer tied to the token embedding after parallelize()"
            )
        data = TokenData.synthetic()
        spec = BatchSpec(BATCH_SIZE, SEQ_LEN, dp_size=dp_size)
        losses = []
        for step in range(steps):
            inputs, targets = data.batch(step, spec, seed=seed, rank=rank)
            loss = loss_of(model, inputs, targets)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            global_loss = loss.detach().reshape(1)
            dist.all_reduce(global_loss)
            losses.append(global_loss.item() / dp_size)
            if rank == 0 and (step % 10 == 0 or step == steps - 1):
                print(f"step {step:3d}  loss {losses[-1]:.4f}", flush=True)
        numel = sum(p.numel() for p in hf.parameters())
        padding = sum(layout.padding_numel for layout in model.layouts)
        return {"losses": losses, "numel": numel, "padding_numel": padding}
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    result = launch_local(train_rank, args.nproc, args.steps, args.seed)[0]
    print(
        f"GPT2LMHeadModel, {result['numel']:,} params on {args.nproc} ranks "
        f"({result['padding_numel']:,} padding elements in the grad buffers): "
        f"loss {result['losses'][0]:.4f} -> {result['losses'][-1]:.4f}"
    )
    return result


if __name__ == "__main__":
    main()
