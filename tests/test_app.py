"""`aligndp train` leaves the caller's process state alone: pyplot and the launcher's loggers."""

import logging
import subprocess
import sys
import textwrap

import pytest

from aligndp.app.train import _quiet_launcher

# A fresh interpreter: matplotlib.use() is process-wide, so the check must not leak into (or
# depend on) what other tests did. "svg" is a non-interactive backend other than the Agg canvas
# the plots draw on, so a plot that switched the backend would show.
_PLOTS_LEAVE_PYPLOT_ALONE = textwrap.dedent(
    """
    import sys
    import matplotlib
    matplotlib.use("svg")
    import matplotlib.pyplot as plt

    from aligndp.app.plot import draw_layout
    from aligndp.app.train_report import plot_loss
    from aligndp.plan.layout import plan_layout
    from aligndp.plan.spec import ParamSpec

    mine = plt.figure()
    before = (matplotlib.get_backend(), plt.get_fignums())
    layouts = [
        plan_layout([ParamSpec("w", (8, 8)), ParamSpec("b", (8,))], dp_size=2, mode=m)
        for m in ("replicated", "sharded")
    ]
    draw_layout(layouts, sys.argv[1])
    records = [{"step": 0, "loss": 5.5}, {"step": 1, "loss": 5.0, "eval_loss": 5.2}]
    plot_loss(records, sys.argv[2])
    after = (matplotlib.get_backend(), plt.get_fignums())
    assert after == before, (before, after)
    assert plt.gcf() is mine, "the caller's current figure changed"
    print(after)
    """
)


def test_plots_leave_pyplot_backend_and_figures_alone(tmp_path):
    layout_png, loss_png = tmp_path / "layout.png", tmp_path / "loss.png"
    proc = subprocess.run(
        [sys.executable, "-c", _PLOTS_LEAVE_PYPLOT_ALONE, str(layout_png), str(loss_png)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "('svg', [1])"
    for png in (layout_png, loss_png):
        data = png.read_bytes()
        assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 1000, png


def test_quiet_launcher_restores_every_elastic_logger_level():
    import torch.distributed.launcher.api  # noqa: F401  (creates the elastic loggers)

    names = [
        n for n in logging.root.manager.loggerDict if n.startswith("torch.distributed.elastic")
    ]
    assert len(names) >= 2, names
    loggers = [logging.getLogger(n) for n in names]
    mine = loggers[0]
    saved = [lg.level for lg in loggers]
    try:
        mine.setLevel(logging.DEBUG)
        before = [lg.level for lg in loggers]
        with _quiet_launcher():
            assert [lg.level for lg in loggers] == [logging.ERROR] * len(loggers)
        assert [lg.level for lg in loggers] == before
        assert mine.level == logging.DEBUG
        # an error inside the launch (a rank failed) restores them too
        with pytest.raises(RuntimeError, match="rank failed"), _quiet_launcher():
            assert mine.level == logging.ERROR
            raise RuntimeError("rank failed")
        assert [lg.level for lg in loggers] == before
    finally:
        for lg, level in zip(loggers, saved):
            lg.setLevel(level)


def test_replicas_build_r_replicas_of_world_over_r_shards(monkeypatch):
    """Issue 42, planted bug: ``--replicas R`` on a world of W ranks builds the (R, W / R) mesh,
    dims ("replicate", "shard"), also where R != W / R (2 replicas of 4 shards on 8 ranks,
    4 of 2), never its transpose; one replica builds no mesh (the flat path)."""
    import torch
    import torch.distributed.device_mesh as device_mesh

    import aligndp.runtime.mesh as mesh_module
    from aligndp.app.train_loop import replica_mesh

    built = []

    def fake_mesh(device_type, shape, mesh_dim_names):
        built.append((device_type, tuple(shape), tuple(mesh_dim_names)))
        return built[-1]

    monkeypatch.setattr(device_mesh, "init_device_mesh", fake_mesh)
    monkeypatch.setattr(mesh_module.dist, "get_world_size", lambda *a: 8)
    for replicas, shape in ((2, (2, 4)), (4, (4, 2)), (8, (8, 1))):
        got = replica_mesh(replicas, torch.device("cpu"))
        assert got == ("cpu", shape, ("replicate", "shard")), (replicas, got)
    assert replica_mesh(1, torch.device("cpu")) is None
