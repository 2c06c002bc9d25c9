"""Guards for breaks that once passed the whole suite, on paths whose own test files live
elsewhere (issue 16): ``aligndp train`` must exit non-zero when a rank it launched dies, and
``aligndp layout --png`` must draw what the plan says (not just write a PNG header)."""

import contextlib
import io
import json
import os
import re
import time
from unittest import mock

import numpy as np
import pytest

from aligndp.app import cli


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
    with mock.patch("aligndp.app.train_loop.launched_worker", crash_on_rank1):
        start = time.monotonic()
        code = cli.main(["train", "--steps", "2", "--nproc", "2", "--out", str(tmp_path / "run")])
    assert code == 1, code
    err = capsys.readouterr().err
    assert re.search(r"rank(\(s\))? 1\b.*failed", err), err
    assert time.monotonic() - start < 60, "rank 0 must be stopped once rank 1 failed"


TAB_BLUE, TAB_ORANGE = (31, 119, 180), (255, 127, 14)  # matplotlib's tab10 colours of ranks 0 and 1


def layout_with_png(args: list[str], png: str) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["layout", *args, "--json", "--png", png]) == 0
    return json.loads(out.getvalue())


def pixels_of(png: str, rgb: tuple[int, int, int]) -> int:
    import matplotlib.image

    image = (matplotlib.image.imread(png)[..., :3] * 255).round()
    return int((np.abs(image - np.array(rgb)).max(-1) <= 2).sum())


def test_layout_png_draws_each_rank_with_its_share_of_elements(tmp_path):
    """Layer-wise at dp 2, a 64x64 and a 64x16 matrix: rank 0 owns 4096 elements, rank 1 1024
    (from the plan's JSON), so the picture's rank-1 colour covers a quarter of rank 0's area
    (bars are drawn to scale; the legend adds a few pixels of each). Replicated: no rank colours."""
    png = str(tmp_path / "layerwise.png")
    plan = layout_with_png(["--shapes", "64x64,64x16", "--dp", "2", "--mode", "layerwise"], png)
    owned = [0, 0]
    for buffer in plan["buffers"]:
        for p in buffer["params"]:
            owned[p["owner"]] += p["end"] - p["start"]
    assert owned == [4096, 1024]
    blue, orange = pixels_of(png, TAB_BLUE), pixels_of(png, TAB_ORANGE)
    assert blue > 10_000, "rank 0's params are not drawn"
    assert orange / blue == pytest.approx(owned[1] / owned[0], rel=0.05)
    replicated = str(tmp_path / "replicated.png")
    layout_with_png(["--shapes", "64x64,64x16", "--dp", "2", "--mode", "replicated"], replicated)
    assert pixels_of(replicated, TAB_ORANGE) == 0 and pixels_of(replicated, TAB_BLUE) > 10_000
