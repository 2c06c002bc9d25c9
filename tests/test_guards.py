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

import pytest

from aligndp.app import cli


def crash_on_rank1(config, recipe=None):
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


def layout_and_bars(args: list[str], png: str, monkeypatch) -> tuple[dict, list[dict]]:
    """``aligndp layout ARGS --json --png PNG``: the plan's JSON, and every param bar of the
    figure that was saved (``left``, ``width``, ``colour``), read from its artists."""
    from matplotlib.colors import to_rgba
    from matplotlib.figure import Figure

    saved = []
    savefig = Figure.savefig

    def keep(fig, *a, **kw):
        saved.append(fig)
        return savefig(fig, *a, **kw)

    monkeypatch.setattr(Figure, "savefig", keep)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["layout", *args, "--json", "--png", png]) == 0
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n", "no PNG written"
    (fig,) = saved
    padding = to_rgba("0.85")
    bars = [
        {"left": r.get_x(), "width": r.get_width(), "colour": r.get_facecolor()}
        for ax in fig.axes
        for r in ax.patches
        if r.get_facecolor() != padding  # the buffer's padding, drawn under the params
    ]
    return json.loads(out.getvalue()), bars


def test_layout_png_draws_each_param_where_the_plan_puts_it_in_its_owners_colour(
    tmp_path, monkeypatch
):
    """Regression (issue 16): ``--png`` once wrote a picture that did not follow the plan. The
    plan's JSON is the contract; the figure must draw each param's bar at its start, to scale,
    in its owner rank's colour (layer-wise) — read from the figure's artists, not its pixels.
    Replicated: no param in a rank's colour but rank 0's (blue/cyan by param)."""
    from matplotlib import colormaps

    tab10 = colormaps["tab10"]
    shapes = ["--shapes", "64x64,64x16", "--nproc", "2"]
    plan, bars = layout_and_bars(
        [*shapes, "--sharding", "zero1", "--optimizer", "muon"],
        str(tmp_path / "lw.png"),
        monkeypatch,
    )
    params = [p for buffer in plan["buffers"] for p in buffer["params"]]
    assert [p["owner"] for p in params] == [0, 1], "the test needs a param on each rank"
    expected = [
        {"left": p["start"], "width": p["end"] - p["start"], "colour": tab10(p["owner"])}
        for p in params
    ]
    assert sorted(bars, key=lambda b: b["left"]) == expected
    monkeypatch.undo()
    plan, bars = layout_and_bars(
        [*shapes, "--sharding", "none"], str(tmp_path / "r.png"), monkeypatch
    )
    params = [p for buffer in plan["buffers"] for p in buffer["params"]]
    assert sorted((b["left"], b["width"]) for b in bars) == sorted(
        (p["start"], p["end"] - p["start"]) for p in params
    )
    assert tab10(1) not in [b["colour"] for b in bars], "a replicated param drawn as rank 1's"
