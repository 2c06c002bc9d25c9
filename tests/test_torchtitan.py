"""torchtitan's own Llama-3 model (tests/_torchtitan.py: its config classes, a tiny size)
trains under ``aligndp.parallelize`` with the losses it has under torch's FSDP2
(``fully_shard`` on each block and the root, as torchtitan's own ``parallelize_llama``
applies it), on 2 gloo ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("torchtitan")

from torch.distributed.fsdp import fully_shard  # noqa: E402

from aligndp import parallelize  # noqa: E402
from tests._dist import case, make_tests  # noqa: E402
from tests._torchtitan import llama3_loss, tiny_llama3  # noqa: E402
from tests.models import ADAMW_GAIN, assert_close, order_tolerance  # noqa: E402

STEPS = 4
ROWS, SEQ, VOCAB, DIM = 2, 16, 256, 64  # rows per rank


def tokens(rank: int, ws: int) -> torch.Tensor:
    """This rank's rows of one global batch, trained on at every step (so the loss falls)."""
    g = torch.Generator().manual_seed(100)
    return torch.randint(0, VOCAB, (ROWS * ws, SEQ + 1), generator=g)[rank::ws]


def train(model, opt, rank, ws) -> list[float]:
    losses = []
    for _ in range(STEPS):
        loss = llama3_loss(model, tokens(rank, ws))
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / ws)
    return losses


@case(2)
def case_llama3_losses_match_fsdp2(rank, ws):
    reference = tiny_llama3(dim=DIM, vocab=VOCAB)
    for block in reference.layers.values():
        fully_shard(block)
    fully_shard(reference)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=3e-3, weight_decay=0.1)
    theirs = train(reference, ref_opt, rank, ws)
    # the longest sum behind one element: the FFN's inner dim (192; a weight gradient sums
    # the 64 tokens of both ranks)
    tol = order_tolerance(terms=192, steps=STEPS, gain=ADAMW_GAIN)
    for sharding in ("none", "zero1"):
        model, opt = parallelize(
            tiny_llama3(dim=DIM, vocab=VOCAB), sharding=sharding, lr=3e-3, weight_decay=0.1
        )
        ours = train(model, opt, rank, ws)
        assert ours[-1] < ours[0]  # it learns
        assert_close(torch.tensor(ours), torch.tensor(theirs), f"llama3 {sharding}", tol)
        full = {n: p.full_tensor() for n, p in reference.named_parameters()}
        for name, p in model.module.named_parameters():
            assert_close(p.detach(), full[name].detach(), f"{sharding} {name}", tol)


make_tests(globals())
