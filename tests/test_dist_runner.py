"""tests/_dist.py names the failing case, whatever a case raises and even if a rank dies;
tests/_worlds.py keeps a world per world size for the next job, with the process state put back,
and starts a new one where a rank died or a case failed, past the cap, or when asked to."""

import os
import time

import pytest

from tests import _worlds
from tests._dist import run_cases

SELFTEST = "tests._dist_selftest"


def pids(tmp_path, tag, ws=2):
    return [int((tmp_path / f"{tag}{r}").read_text()) for r in range(ws)]


def run_tagged(monkeypatch, tag, names, ws=2):
    monkeypatch.setenv("SELFTEST_TAG", tag)
    return run_cases(SELFTEST, names, ws)


@pytest.fixture
def selftest_out(monkeypatch, tmp_path):
    """Where the ranks write; set after the kept worlds started, as any job's environment may
    change. The kept-worlds tests run in kept worlds whatever the session asked for."""
    monkeypatch.setenv("SELFTEST_OUT", str(tmp_path))
    monkeypatch.setenv("SELFTEST_CWD", os.getcwd())
    monkeypatch.delenv("ALIGNDP_TEST_FRESH_WORLDS", raising=False)
    monkeypatch.delenv("ALIGNDP_TEST_KEPT_RANKS", raising=False)
    return tmp_path


def test_base_exceptions_fail_only_their_own_case(monkeypatch, selftest_out):
    """A case that fails fails alone, whatever it raised; its world is then given up (a rank
    that raised between two collectives may leave the others out of step): the next module
    gets new processes."""
    names = [
        "case_writes_its_pid",
        "case_passes",
        "case_raises_that_did_not_raise",
        "case_system_exit",
        "case_passes_after_failures",
    ]
    results = run_tagged(monkeypatch, "failed", names)
    assert results["case_passes"] is None and results["case_passes_after_failures"] is None, results
    assert "rank 1:" in results["case_raises_that_did_not_raise"]
    assert "DID NOT RAISE" in results["case_raises_that_did_not_raise"]
    assert (
        "rank 0:" in results["case_system_exit"] and "SystemExit: 3" in results["case_system_exit"]
    )
    assert 2 not in _worlds.kept()
    assert run_tagged(monkeypatch, "next", ["case_writes_its_pid"]) == {"case_writes_its_pid": None}
    assert not set(pids(selftest_out, "next")) & set(pids(selftest_out, "failed"))


def test_a_dead_rank_fails_the_case_it_ran_and_names_it(monkeypatch, selftest_out):
    """The cases after it are not run, and the next job starts a new world."""
    names = ["case_writes_its_pid", "case_passes", "case_rank_dies", "case_after_the_death"]
    results = run_tagged(monkeypatch, "died", names)
    assert results["case_passes"] is None, results
    assert (
        "ran this case" in results["case_rank_dies"] and "exit code 7" in results["case_rank_dies"]
    ), results
    assert (
        "not run" in results["case_after_the_death"]
        and "case_rank_dies" in results["case_after_the_death"]
    )
    assert 2 not in _worlds.kept()
    after = run_tagged(monkeypatch, "next", ["case_writes_its_pid", "case_passes"])
    assert after == {"case_writes_its_pid": None, "case_passes": None}, after
    assert not set(pids(selftest_out, "next")) & set(pids(selftest_out, "died"))


def test_a_case_that_hangs_fails_naming_rank_case_and_the_call_it_waits_in(monkeypatch):
    """Issue 42 "no hang": past ALIGNDP_CASE_TIMEOUT each rank dumps its stacks (faulthandler)
    under its rank and case and exits, so the case fails with where every rank waited."""
    monkeypatch.setenv("ALIGNDP_CASE_TIMEOUT", "4")
    results = run_cases(SELFTEST, ["case_passes", "case_hangs_in_a_barrier_on_rank_0"], 2)
    assert results["case_passes"] is None, results
    error = results["case_hangs_in_a_barrier_on_rank_0"]
    assert "rank 0 ran case case_hangs_in_a_barrier_on_rank_0" in error, error
    assert "in barrier" in error and "in case_hangs_in_a_barrier_on_rank_0" in error, error


def test_a_failure_on_one_rank_stops_the_others_waiting_for_it_within_the_grace(monkeypatch):
    """A check that fails on rank 0 only, between two collectives of the case: rank 1 would
    wait in the second for its group's timeout; the world is stopped ALIGNDP_TEST_FAILURE_GRACE
    seconds after the failure instead, and the case fails with rank 0's error and where rank 1
    waits. The cases after it are not run (a new world runs the next job)."""
    monkeypatch.setenv("ALIGNDP_TEST_FAILURE_GRACE", "2")
    names = ["case_passes", "case_fails_on_rank_0_while_rank_1_waits_in_a_collective"]
    names.append("case_passes_after_failures")
    began = time.monotonic()
    results = run_cases(SELFTEST, names, 2)
    seconds = time.monotonic() - began
    assert results["case_passes"] is None, results
    error = results["case_fails_on_rank_0_while_rank_1_waits_in_a_collective"]
    assert "rank 0's check failed" in error and "rank(s) [1] had not finished it" in error, error
    assert "rank 1 had not finished case" in error and "in barrier" in error, error
    assert "not run" in results["case_passes_after_failures"], results
    assert seconds < 60, f"{seconds:.0f} s: the failure was not noticed within the grace"
    assert 2 not in _worlds.kept()


# ---- kept worlds (tests/_worlds.py) ----


def test_the_next_job_runs_in_the_same_processes_with_their_state_put_back(
    monkeypatch, selftest_out
):
    """Environment, working directory, default dtype, grad mode, threads, deterministic mode,
    matmul precision, warning filters, RNG seeds and Dynamo's compiled code, as
    case_changes_process_state left them, are back as a fresh world has them."""
    times = selftest_out / "case_times.tsv"
    monkeypatch.setenv("ALIGNDP_TEST_CASE_TIMES", str(times))
    first = run_tagged(monkeypatch, "dirty", ["case_changes_process_state"])
    assert first == {"case_changes_process_state": None}, first
    assert sorted(_worlds.kept()[2]) == sorted(pids(selftest_out, "dirty"))
    second = run_tagged(monkeypatch, "clean", ["case_sees_a_fresh_process_state"])
    assert second == {"case_sees_a_fresh_process_state": None}, second
    assert pids(selftest_out, "clean") == pids(selftest_out, "dirty")
    logged = [line.split("\t")[1] for line in times.read_text().splitlines()]
    assert logged == [
        "tests._dist_selftest[2]::(import)",
        "tests._dist_selftest[2]::case_changes_process_state",
        "tests._dist_selftest[2]::(import)",
        "tests._dist_selftest[2]::case_sees_a_fresh_process_state",
    ], logged


def test_fresh_worlds_switch_starts_a_world_per_job_and_leaves_kept_ones(monkeypatch, selftest_out):
    run_tagged(monkeypatch, "kept", ["case_writes_its_pid"], ws=1)
    kept = _worlds.kept()[1]
    monkeypatch.setenv("ALIGNDP_TEST_FRESH_WORLDS", "1")
    run_tagged(monkeypatch, "fresh1", ["case_writes_its_pid"], ws=1)
    run_tagged(monkeypatch, "fresh2", ["case_writes_its_pid"], ws=1)
    fresh1, fresh2 = pids(selftest_out, "fresh1", 1), pids(selftest_out, "fresh2", 1)
    assert fresh1 != fresh2 and kept not in (fresh1, fresh2)
    assert _worlds.kept()[1] == kept
    monkeypatch.delenv("ALIGNDP_TEST_FRESH_WORLDS")
    run_tagged(monkeypatch, "kept_again", ["case_writes_its_pid"], ws=1)
    assert pids(selftest_out, "kept_again", 1) == kept


def test_kept_ranks_stay_within_the_cap(monkeypatch, selftest_out):
    """ALIGNDP_TEST_KEPT_RANKS=3 keeps a world of 2 and one of 1; at 2, the least recently
    used world stops to make room; past the cap a world runs its job and stops."""
    monkeypatch.setenv("ALIGNDP_TEST_KEPT_RANKS", "3")
    run_tagged(monkeypatch, "two", ["case_writes_its_pid"])
    run_tagged(monkeypatch, "one", ["case_writes_its_pid"], ws=1)
    run_tagged(monkeypatch, "two_again", ["case_writes_its_pid"])
    assert list(_worlds.kept()) == [1, 2]  # least recently used first
    assert pids(selftest_out, "two_again") == pids(selftest_out, "two")
    monkeypatch.setenv("ALIGNDP_TEST_KEPT_RANKS", "2")
    run_tagged(monkeypatch, "one_again", ["case_writes_its_pid"], ws=1)
    assert pids(selftest_out, "one_again", 1) == pids(selftest_out, "one", 1)
    assert list(_worlds.kept()) == [1]
    monkeypatch.setenv("ALIGNDP_TEST_KEPT_RANKS", "1")
    run_tagged(monkeypatch, "two_past_the_cap", ["case_writes_its_pid"])
    assert _worlds.kept() == {}
    assert not set(pids(selftest_out, "two_past_the_cap")) & set(pids(selftest_out, "two"))


def test_the_cap_must_be_a_whole_number(monkeypatch):
    monkeypatch.setenv("ALIGNDP_TEST_KEPT_RANKS", "eight")
    with pytest.raises(ValueError, match="ALIGNDP_TEST_KEPT_RANKS='eight' is not a whole number"):
        run_cases(SELFTEST, ["case_passes"], 2)
