"""Cases for tests/test_dist_runner.py: each misbehaves in one way the runner must report by name.

Not a test module (no ``test_`` prefix): the runner's own test calls ``run_cases`` on it.
"""

import os

import pytest
import torch
import torch.distributed as dist


def case_passes(rank, ws):
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    assert t.item() == ws * (ws + 1) / 2


def case_raises_that_did_not_raise(rank, ws):
    """pytest's Failed is a BaseException, not an Exception."""
    if rank == 1:
        with pytest.raises(ValueError):
            pass


def case_system_exit(rank, ws):
    if rank == 0:
        raise SystemExit(3)


def case_passes_after_failures(rank, ws):
    case_passes(rank, ws)


def case_rank_dies(rank, ws):
    if rank == 1:
        os._exit(7)
    dist.barrier()


def case_after_the_death(rank, ws):
    case_passes(rank, ws)


def case_hangs_in_a_barrier_on_rank_0(rank, ws):
    """Rank 0 waits in a barrier that rank 1, asleep, never reaches: the runner's per-case
    timeout dumps where each rank waits."""
    if rank == 0:
        dist.barrier()
    else:
        import time

        time.sleep(60)
