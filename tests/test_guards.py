"""Guards for breaks that once passed the whole suite, on paths whose own test files live
elsewhere (issue 16): ``aligndp train`` must exit non-zero when a rank it launched dies."""
import os
import time
from unittest import mock

import pytest

from aligndp import cli


def crash_on_rank1(config):
    """Entry point of the launched ranks (replaces train_loop.launched_worker): rank 1 dies
    at once, by an exception or by a hard exit; rank 0 would wait for it (it is killed by
    the launcher when rank 1 fails)."""
    if int(os.environ["RANK"]) == 1:
        if os.environ.get("ALIGNDP_TEST_CRASH") == "exit":
            os._exit(3)
        raise RuntimeError("injected crash on rank 1")
    time.sleep(120)
    return {}


@pytest.mark.parametrize("how", ["raise", "exit"])
def test_train_exits_non_zero_when_a_launched_rank_crashes(how, tmp_path, capsys, monkeypatch):
    """Regression (issue 16): `aligndp train` exiting 0 after a launched rank crashed passed
    every test. A crash is exit status 1 and one line naming the rank on stderr."""
    monkeypatch.setenv("ALIGNDP_TEST_CRASH", how)
    with mock.patch("aligndp.train_loop.launched_worker", crash_on_rank1):
        start = time.monotonic()
        code = cli.main(["train", "--steps", "2", "--nproc", "2", "--out", str(tmp_path / "run")])
    assert code == 1, code
    assert "rank(s) 1 failed" in capsys.readouterr().err
    assert time.monotonic() - start < 60, "rank 0 must be stopped once rank 1 failed"
