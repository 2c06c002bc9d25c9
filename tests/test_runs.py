"""Runs a user can extend and pick up: ``--resume --steps N``, ``--resume-from``, the final
checkpoint, ``run.toml`` + ``--config``, ``--log-with``, strict JSON. One rank, in this process.

Before: ``--resume --steps 80`` of a 60-step run was refused (steps were part of the run's
identity), ``--resume`` at the same ``--steps`` wrote ``"tokens_per_s": NaN``, the default run
kept no weights, and no option picked a checkpoint other than the newest."""

from __future__ import annotations

import json
import os
import pathlib
import re

import pytest

from aligndp.app import cli
from aligndp.app.run_checkpoints import latest_checkpoint
from aligndp.app.schedule import lr_factor
from aligndp.app.train_report import read_metrics
from aligndp.state.checkpoint_files import META_FILE

QUICK = ["--batch-size", "8", "--eval-every", "0", "--nproc", "1", "--seed", "2"]
SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "aligndp"


def train(*args: str, out) -> int:
    return cli.main(["train", *QUICK, *args, "--out", str(out)])


def strict_json(path) -> dict:
    """Parse as a strict parser does: NaN / Infinity are errors."""

    def refuse(name):
        raise ValueError(f"{path}: {name} is not JSON")

    return json.loads(pathlib.Path(path).read_text(), parse_constant=refuse)


def error_line(capsys) -> str:
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1, err
    return err[0]


@pytest.fixture(scope="module")
def four_steps(tmp_path_factory):
    """A 4-step run with a checkpoint at step 3 (--checkpoint-every) and the final one at step 4
    (saved by default)."""
    out = tmp_path_factory.mktemp("four")
    assert train("--steps", "4", "--checkpoint-every", "3", out=out) == 0
    return out


def test_the_default_run_keeps_its_weights(four_steps, capsys):
    assert sorted(os.listdir(four_steps / "checkpoints")) == [
        "run.json",
        "step-000003",
        "step-000004",
    ]
    assert strict_json(four_steps / "summary.json")["checkpoint"] == str(
        four_steps / "checkpoints" / "step-000004"
    )


def test_resume_extends_a_finished_run(four_steps, tmp_path, capsys):
    """--resume --steps 6: steps 4 and 5 trained at the lr of a 6-step schedule; the steps
    before are kept as they were."""
    os.rmdir(tmp_path)
    import shutil

    shutil.copytree(four_steps, tmp_path)
    assert train("--steps", "6", "--resume", out=tmp_path) == 0
    before, after = (
        read_metrics(four_steps / "metrics.jsonl"),
        read_metrics(tmp_path / "metrics.jsonl"),
    )
    assert [r["step"] for r in after] == list(range(6)) and after[:4] == before
    assert [r["lr"] for r in after[4:]] == pytest.approx(
        [3e-3 * lr_factor(s, 6) for s in (4, 5)], rel=1e-12
    )
    assert latest_checkpoint(str(tmp_path / "checkpoints")).endswith("step-000006")
    summary = strict_json(tmp_path / "summary.json")
    assert (summary["start_step"], summary["steps"]) == (4, 6)
    # nothing left to train: a figure that is undefined is null, not NaN
    capsys.readouterr()
    assert train("--steps", "6", "--resume", out=tmp_path) == 0
    assert "throughput n/a tokens/s" in capsys.readouterr().out
    assert strict_json(tmp_path / "summary.json")["tokens_per_s"] is None


def test_resume_from_an_earlier_checkpoint_retrains_the_same_steps(four_steps, tmp_path):
    assert train("--steps", "4", "--resume-from", str(four_steps / "checkpoints" / "step-000003"),
                 out=tmp_path) == 0  # fmt: skip
    resumed = read_metrics(tmp_path / "metrics.jsonl")
    reference = read_metrics(four_steps / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [3]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in reference[3:]]


def test_resume_takes_the_newest_complete_checkpoint(four_steps, tmp_path, capsys):
    """A save that died leaves step-N.partial; a step-N without aligndp.json is no checkpoint
    either: --resume takes step 4, the newest complete one."""
    os.rmdir(tmp_path)
    import shutil

    shutil.copytree(four_steps, tmp_path)
    partial = tmp_path / "checkpoints" / "step-000006.partial"
    shutil.copytree(tmp_path / "checkpoints" / "step-000004", partial)
    os.remove(partial / META_FILE)  # written last: a save that died has none
    (tmp_path / "checkpoints" / "step-000008").mkdir()
    (tmp_path / "checkpoints" / "step-000008" / "__0_0.distcp").write_bytes(b"half")
    assert train("--steps", "5", "--resume", out=tmp_path) == 0
    assert strict_json(tmp_path / "summary.json")["start_step"] == 4
    capsys.readouterr()
    assert train("--steps", "5", "--resume-from", str(partial), out=tmp_path) == 2
    line = error_line(capsys)
    assert f"--resume-from {partial} is not a complete aligndp checkpoint" in line
    assert "complete ones in" in line and "step-000004" in line


def test_overwrite_deletes_only_aligndps_checkpoints(tmp_path):
    """--overwrite removes the run's step-N checkpoints, never a user's directory whose name
    happens to start with step- (nor what is inside it)."""
    assert train("--steps", "2", out=tmp_path) == 0
    mine = tmp_path / "checkpoints" / "step-000007"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    (tmp_path / "step-plan").mkdir()
    (tmp_path / "step-plan" / "todo.txt").write_text("mine too")
    assert train("--steps", "2", "--overwrite", "--lr", "0.01", out=tmp_path) == 0
    assert (mine / "notes.txt").read_text() == "mine"
    assert (tmp_path / "step-plan" / "todo.txt").read_text() == "mine too"
    assert json.loads((tmp_path / "checkpoints" / "step-000002" / META_FILE).read_text())
    assert strict_json(tmp_path / "run.json")["config"]["lr"] == 0.01


def test_no_final_checkpoint(tmp_path):
    assert train("--steps", "2", "--no-final-checkpoint", out=tmp_path) == 0
    assert latest_checkpoint(str(tmp_path / "checkpoints")) is None
    assert strict_json(tmp_path / "summary.json")["checkpoint"] is None


def test_run_toml_trains_the_same_run_again(four_steps, tmp_path, capsys):
    """The run.toml a run writes, given to --config, gives the same losses and summary; a flag
    beside it overrides it."""
    text = (four_steps / "run.toml").read_text()
    assert "steps = 4" in text and "seed = 2" in text and "resume" not in text
    again = tmp_path / "again"
    assert cli.main(["train", "--config", str(four_steps / "run.toml"), "--out", str(again)]) == 0
    first, second = strict_json(four_steps / "summary.json"), strict_json(again / "summary.json")
    for key in ("train_loss", "eval_loss", "first_loss", "steps", "padded_numel"):
        assert first[key] == second[key], key
    losses = [r["loss"] for r in read_metrics(again / "metrics.jsonl")]
    assert losses == [r["loss"] for r in read_metrics(four_steps / "metrics.jsonl")]
    shorter = tmp_path / "shorter"
    argv = ["train", "--config", str(again / "run.toml"), "--steps", "2", "--out", str(shorter)]
    assert cli.main(argv) == 0
    assert [r["step"] for r in read_metrics(shorter / "metrics.jsonl")] == [0, 1]
    assert "steps = 2" in (shorter / "run.toml").read_text()


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ("stesp = 3\n", r"unknown key 'stesp'; did you mean 'steps'\?"),
        ("steps = '3'\n", r"steps = '3' is a str; write a int, e.g. steps = 500"),
        ("steps = [\n", r"is not valid TOML"),
        ("lr = 0\n", r"--lr must be > 0, got 0.0"),
    ],
)
def test_a_bad_config_file_is_one_line(tmp_path, capsys, toml, message):
    (tmp_path / "run.toml").write_text(toml)
    argv = ["train", "--config", str(tmp_path / "run.toml"), "--out", str(tmp_path / "o")]
    assert cli.main(argv) == 2
    assert re.search(message, error_line(capsys))


def test_log_with_tensorboard_and_wandb_log_the_jsonl_scalars(tmp_path, monkeypatch):
    """TensorBoard's own event reader finds every metrics.jsonl scalar at its step; W&B (offline,
    no network) writes its run under --out."""
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.delenv("WANDB_MODE", raising=False)  # the default: offline
    monkeypatch.setenv("WANDB_SILENT", "true")
    argv = ["--steps", "3", "--eval-every", "2", "--log-with", "tensorboard,wandb"]
    assert train(*argv, out=tmp_path) == 0
    records = read_metrics(tmp_path / "metrics.jsonl")
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    expected = {(k, r["step"]): v for r in records for k, v in r.items() if k != "step"}
    logged = {
        (tag, e.step): e.value for tag in events.Tags()["scalars"] for e in events.Scalars(tag)
    }
    assert set(logged) == set(expected)
    assert logged == pytest.approx(expected, rel=1e-6)  # TensorBoard keeps float32
    (run,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    assert run.stat().st_size > 0


def test_log_with_an_unknown_logger_is_one_line(tmp_path, capsys):
    assert train("--log-with", "tensorboard,mlflow", out=tmp_path) == 2
    assert "'mlflow' is not one of tensorboard, wandb" in error_line(capsys)


def test_every_json_the_package_writes_is_strict():
    """json.dump/dumps in src/ either pass allow_nan=False or go through train_report.dumps,
    which replaces undefined figures by null first."""
    loose = []
    for path in SRC.rglob("*.py"):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"\bjson\.dumps?\(", line) and "allow_nan=False" not in line:
                loose.append(f"{path.relative_to(SRC)}:{number}: {line.strip()}")
    assert not loose, loose


def test_undefined_figures_are_null(tmp_path):
    """A diverged loss (NaN) or a rate over no timed step is written as null: strict JSON."""
    from aligndp.app.train_report import MetricsLog, dumps

    assert dumps({"a": float("nan"), "b": [float("inf"), 1.5]}) == '{"a": null, "b": [null, 1.5]}'
    log = MetricsLog(str(tmp_path / "metrics.jsonl"))
    log.write({"step": 0, "loss": float("nan"), "lr": 0.1})
    assert strict_json_lines(tmp_path / "metrics.jsonl") == [{"step": 0, "loss": None, "lr": 0.1}]


def strict_json_lines(path) -> list[dict]:
    def refuse(name):
        raise ValueError(f"{path}: {name} is not JSON")

    lines = pathlib.Path(path).read_text().splitlines()
    return [json.loads(line, parse_constant=refuse) for line in lines]
