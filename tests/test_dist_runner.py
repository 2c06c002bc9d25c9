"""tests/_dist.py names the failing case, whatever a case raises and even if a rank dies."""

from tests._dist import run_cases

SELFTEST = "tests._dist_selftest"


def test_base_exceptions_fail_only_their_own_case():
    names = [
        "case_passes",
        "case_raises_that_did_not_raise",
        "case_system_exit",
        "case_passes_after_failures",
    ]
    results = run_cases(SELFTEST, names, 2)
    assert results["case_passes"] is None and results["case_passes_after_failures"] is None, results
    assert "rank 1:" in results["case_raises_that_did_not_raise"]
    assert "DID NOT RAISE" in results["case_raises_that_did_not_raise"]
    assert (
        "rank 0:" in results["case_system_exit"] and "SystemExit: 3" in results["case_system_exit"]
    )


def test_a_dead_rank_fails_the_case_it_ran_and_names_it():
    results = run_cases(SELFTEST, ["case_passes", "case_rank_dies", "case_after_the_death"], 2)
    assert results["case_passes"] is None, results
    assert (
        "ran this case" in results["case_rank_dies"] and "exit code 7" in results["case_rank_dies"]
    ), results
    assert (
        "not run" in results["case_after_the_death"]
        and "case_rank_dies" in results["case_after_the_death"]
    )


def test_a_case_that_hangs_fails_naming_rank_case_and_the_call_it_waits_in(monkeypatch):
    """Issue 42 "no hang": past ALIGNDP_CASE_TIMEOUT each rank dumps its stacks (faulthandler)
    under its rank and case and exits, so the case fails with where every rank waited."""
    monkeypatch.setenv("ALIGNDP_CASE_TIMEOUT", "4")
    results = run_cases(SELFTEST, ["case_passes", "case_hangs_in_a_barrier_on_rank_0"], 2)
    assert results["case_passes"] is None, results
    error = results["case_hangs_in_a_barrier_on_rank_0"]
    assert "rank 0 ran case case_hangs_in_a_barrier_on_rank_0" in error, error
    assert "in barrier" in error and "in case_hangs_in_a_barrier_on_rank_0" in error, error
