"""Cases for tests/test_dist_runner.py: each misbehaves in one way the runner must report by name.

Not a test module (no ``test_`` prefix): the runner's own test calls ``run_cases`` on it.
"""

import os
import warnings

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


def case_fails_on_rank_0_while_rank_1_waits_in_a_collective(rank, ws):
    """Rank 0's check fails between two collectives of a group of the case's; rank 1 waits in
    the second for as long as the group's timeout (10 minutes)."""
    import datetime

    group = dist.new_group([0, 1], timeout=datetime.timedelta(minutes=10))
    dist.barrier(group=group)
    assert rank != 0, "rank 0's check failed"
    dist.barrier(group=group)


# ---- kept worlds (tests/_worlds.py): each job sees what a freshly spawned world would ----


def _out(rank, what):
    """A file the pytest test reads back: in the folder it names through SELFTEST_OUT (an
    environment variable set after the world started, so a rank sees it only if each job takes
    the pytest process's environment)."""
    return os.path.join(os.environ["SELFTEST_OUT"], f"{what}{rank}")


def case_writes_its_pid(rank, ws):
    with open(_out(rank, os.environ.get("SELFTEST_TAG", "pid")), "w") as f:
        f.write(str(os.getpid()))


_GRAPHS = []


def _counting_backend(gm, example_inputs):
    _GRAPHS.append(gm)
    return gm.forward


def _double(x):
    return x * 2


def case_changes_process_state(rank, ws):
    """Everything a case may leave changed for the next module, changed."""
    case_writes_its_pid(rank, ws)
    os.environ["SELFTEST_LEFT_OVER"] = "1"
    os.chdir(os.environ["SELFTEST_OUT"])
    torch.set_default_dtype(torch.float64)
    torch.set_grad_enabled(False)
    torch.set_num_threads(2)
    torch.use_deterministic_algorithms(True)
    torch.set_float32_matmul_precision("medium")
    warnings.simplefilter("error")
    torch.manual_seed(0)
    compiled = len(_GRAPHS)
    torch.compile(_double, backend=_counting_backend)(torch.ones(3))
    assert len(_GRAPHS) == compiled + 1


def case_sees_a_fresh_process_state(rank, ws):
    """In the same processes (the pytest test checks the pids), the next job sees none of it."""
    case_writes_its_pid(rank, ws)
    assert "SELFTEST_LEFT_OVER" not in os.environ
    assert os.getcwd() == os.environ["SELFTEST_CWD"], os.getcwd()
    assert torch.get_default_dtype() == torch.float32
    assert torch.is_grad_enabled()
    assert torch.get_num_threads() == int(os.environ.get("ALIGNDP_TEST_THREADS", "1"))
    assert not torch.are_deterministic_algorithms_enabled()
    assert torch.get_float32_matmul_precision() == "highest"
    warnings.warn("a warning is not an error any more", UserWarning, stacklevel=1)
    assert torch.initial_seed() != 0  # reseeded from fresh entropy, as a new process is
    # the other ranks were reseeded too, each on its own (as spawned processes are)
    seeds = [None] * ws
    dist.all_gather_object(seeds, torch.initial_seed())
    assert len(set(seeds)) == ws, seeds
    # Dynamo forgot the compiled code: compiling the same function again calls the backend
    compiled = len(_GRAPHS)
    torch.compile(_double, backend=_counting_backend)(torch.ones(3))
    assert len(_GRAPHS) == compiled + 1
