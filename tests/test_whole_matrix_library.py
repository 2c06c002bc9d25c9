"""A library's whole-matrix optimizer through the seam: pytorch-optimizer's SOAP.

Runs where ``pytorch-optimizer`` is installed (pure Python; needs only torch and numpy) and is
skipped elsewhere; tests/test_whole_matrix.py covers the seam without it. SOAP counts steps
per param group, so it is registered with ``step_per_bucket=False`` (one ``step()`` over every
owned matrix); it keeps its preconditioners in Python lists, which aligndp checkpoints cannot
hold — ``aligndp.save`` says so on every rank instead of dropping them.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import aligndp
from tests._dist import case, make_tests
from tests.models import WHOLE_MATRICES as WHOLE
from tests.models import batch, ckpt, loss_of
from tests.models import make_whole_matrix_net as make_net
from tests.test_whole_matrix import ADAMW_LR

pytorch_optimizer = pytest.importorskip("pytorch_optimizer")

LR, STEPS = 0.01, 3
OPTIONS = {"precondition_frequency": 1, "weight_decay": 0.0}


def soap_cost(shape) -> float:
    """Eigenbases of both Gram matrices: m³ + n³ for an m×n matrix."""
    m, n = shape
    return float(m**3 + n**3)


aligndp.register_whole_matrix(
    "lib-soap",
    aligndp.WholeMatrixSpec(pytorch_optimizer.SOAP, cost=soap_cost, step_per_bucket=False),
)


@case(2)
def case_soap_zero1_equals_replicated_and_refuses_a_lossy_save(rank, ws):
    """SOAP's eigenbases of a Gram matrix built from one or two gradients are ill-conditioned:
    the last-bit difference between an all-reduced and a one-process gradient moves them by
    percents after two steps, so the parity check is against ``sharding="none"`` (every rank
    stepping SOAP itself on the all-reduced gradients): at dp 2 a reduce-scatter adds the
    same two numbers as an all-reduce, so the owners' layer-wise step must agree bit for bit."""
    runs = {}
    for sharding in ("none", "zero1"):
        model, opt = aligndp.parallelize(
            make_net(), optimizer="lib-soap", sharding=sharding, lr=LR, adamw_lr=ADAMW_LR, **OPTIONS
        )
        for step in range(STEPS):
            loss_of(model, *batch(step, rank, ws)).backward()
            opt.step()
            opt.zero_grad()
        opt.gather.wait_all()
        runs[sharding] = dict(model.module.named_parameters())
        moved = [
            n for n, p in runs[sharding].items() if not torch.equal(p, make_net().get_parameter(n))
        ]
        assert set(WHOLE) <= set(moved), f"{sharding}: SOAP did not step {set(WHOLE) - set(moved)}"
        dist.barrier()
        with pytest.raises(ValueError, match=r"SOAP keeps state 'GG' of param .* as a list"):
            aligndp.save(ckpt(f"lib-soap-{sharding}"), model, opt)
    for n, p in runs["zero1"].items():
        assert torch.equal(p, runs["none"][n]), f"{n}: zero1 differs from sharding none"


make_tests(globals())
