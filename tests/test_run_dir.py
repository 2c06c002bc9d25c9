"""`aligndp train` and its run directory: run.json, --overwrite, --resume of its own run only,
a lock against two runs in one --out, and every failure as one line (exit 2; Ctrl-C 130).

Before: --resume took the highest step-N in --out even from an earlier, different run (the
metrics ended as steps 0,1,2,3,6,7); a fresh run wrote over another run's files; two runs
into one --out both exited 0 with interleaved metrics; --out that is a file and Ctrl-C were
tracebacks; a rank killed by a signal was reported as "their traceback is above".
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from aligndp.app import cli
from aligndp.app.run_checkpoints import latest_checkpoint
from aligndp.app.run_dir import (
    IDENTITY,
    LOCK_FILE,
    MAY_CHANGE_ON_RESUME,
    RunLock,
    check_run_dirs,
    write_run_files,
)
from aligndp.app.train_config import TrainConfig
from aligndp.app.train_report import read_metrics

QUICK = ["--steps", "4", "--batch-size", "8", "--eval-every", "0", "--nproc", "1"]
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def train(*args: str, out) -> int:
    return cli.main(["train", *QUICK, *args, "--out", str(out)])


def error_line(capsys) -> str:
    err = [
        line for line in capsys.readouterr().err.splitlines() if line.strip() and "it/s" not in line
    ]
    assert len(err) == 1, err
    return err[0]


def test_fresh_run_into_another_run_refuses_and_overwrite_keeps_user_files(tmp_path, capsys):
    assert train("--checkpoint-every", "2", out=tmp_path) == 0
    run = json.loads((tmp_path / "run.json").read_text())
    assert run["options"]["steps"] == 4 and len(run["run_id"]) == 12
    (tmp_path / "my-notes.txt").write_text("mine")
    capsys.readouterr()
    assert train(out=tmp_path) == 2
    line = error_line(capsys)
    assert f"--out {tmp_path} holds another run (run {run['run_id']}" in line, line
    assert "pass --resume to continue it, --overwrite to replace it" in line
    assert train("--overwrite", "--lr", "0.01", out=tmp_path) == 0
    assert json.loads((tmp_path / "run.json").read_text())["run_id"] != run["run_id"]
    assert (tmp_path / "my-notes.txt").read_text() == "mine"
    assert not (tmp_path / "checkpoints" / "step-000002").exists(), (
        "the old run's checkpoints must go"
    )


def test_resume_refuses_another_runs_checkpoints(tmp_path, capsys):
    """The earlier run had --lr 0.003; resuming with --lr 0.01 mixed two runs' metrics."""
    assert train("--checkpoint-every", "2", out=tmp_path) == 0
    capsys.readouterr()
    assert (
        train("--checkpoint-every", "2", "--resume", "--lr", "0.01", "--steps", "6", out=tmp_path)
        == 2
    )
    line = error_line(capsys)
    assert "--resume: " in line and "--lr 0.003 there, 0.01 now" in line, line
    assert "--steps" not in line, "--resume --steps N extends a run: steps are no identity"
    os.remove(tmp_path / "checkpoints" / "run.json")
    os.remove(tmp_path / "run.json")
    assert train("--checkpoint-every", "2", "--resume", out=tmp_path) == 2
    assert "has no run.json, so nothing says which run wrote it" in error_line(capsys)


def test_resume_of_its_own_run_continues(tmp_path):
    assert train("--checkpoint-every", "2", out=tmp_path) == 0
    first = read_metrics(tmp_path / "metrics.jsonl")
    run_id = json.loads((tmp_path / "run.json").read_text())["run_id"]
    assert train("--checkpoint-every", "2", "--resume", out=tmp_path) == 0
    assert (
        read_metrics(tmp_path / "metrics.jsonl") == first
    )  # resumed at its last step: nothing left to do
    assert json.loads((tmp_path / "run.json").read_text())["run_id"] == run_id


def test_keep_last_keeps_the_newest_checkpoints(tmp_path):
    assert train("--steps", "8", "--checkpoint-every", "2", "--keep-last", "2", out=tmp_path) == 0
    assert sorted(os.listdir(tmp_path / "checkpoints")) == [
        "run.json",
        "step-000006",
        "step-000008",
    ]


def test_a_second_run_into_a_locked_out_refuses_and_a_stale_lock_is_taken_over(tmp_path, capsys):
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (tmp_path / LOCK_FILE).write_text(f"{holder.pid} {os.uname().nodename}\n")
        assert train(out=tmp_path) == 2
        line = error_line(capsys)
        assert f"another aligndp train (pid {holder.pid} on" in line and "is writing to" in line, (
            line
        )
    finally:
        holder.kill()
        holder.wait()
    assert train(out=tmp_path) == 0, "the lock of a finished process is stale"
    assert not (tmp_path / LOCK_FILE).exists(), "the run releases its lock"


def test_two_runs_at_once_one_refuses(tmp_path):
    """Two real runs into one --out: the second one fails at once with the lock message."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            [os.path.join(REPO, "src"), os.environ.get("PYTHONPATH", "")]
        ),
    }
    first = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "aligndp",
            "train",
            *QUICK,
            "--steps",
            "400",
            "--out",
            str(tmp_path),
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "metrics.jsonl").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        second = subprocess.run(
            [sys.executable, "-m", "aligndp", "train", *QUICK, "--out", str(tmp_path)],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert second.returncode == 2, second.stderr
        assert f"is writing to {tmp_path}" in second.stderr and second.stderr.count("\n") == 1, (
            second.stderr
        )
    finally:
        first.kill()
        first.wait()


@pytest.mark.parametrize("flag", ["--out", "--checkpoint-dir"])
def test_out_or_checkpoint_dir_that_is_a_file(tmp_path, capsys, flag):
    target = tmp_path / "file"
    target.write_text("x")
    args = ["--out", str(tmp_path / "run")] if flag == "--checkpoint-dir" else []
    assert cli.main(["train", *QUICK, *args, flag, str(target)]) == 2
    assert f"{flag} {target} is a file; give a directory" in error_line(capsys)
    assert target.read_text() == "x"


def test_data_that_is_a_directory(tmp_path, capsys):
    assert train("--data", str(tmp_path), out=tmp_path / "run") == 2
    assert f"--data {tmp_path} is a directory; give one file" in error_line(capsys)


def test_layout_png_paths(tmp_path, capsys):
    base = ["layout", "--preset", "demo", "--nproc", "2"]
    assert cli.main([*base, "--png", str(tmp_path / "missing" / "x.png")]) == 2
    assert f"the directory {tmp_path / 'missing'} does not exist; create it first" in error_line(
        capsys
    )
    assert cli.main([*base, "--png", str(tmp_path)]) == 2
    assert f"--png {tmp_path} is a directory; give a file name" in error_line(capsys)
    assert cli.main([*base, "--png", str(tmp_path / "picture")]) == 0
    assert f"wrote {tmp_path / 'picture.png'}" in capsys.readouterr().out
    assert (tmp_path / "picture.png").exists()


def test_ctrl_c_is_one_line_and_exit_130(tmp_path):
    """Ctrl-C in a terminal signals the launcher and both ranks: a 40-line traceback before,
    and no checkpoint of the steps trained."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            [os.path.join(REPO, "src"), os.environ.get("PYTHONPATH", "")]
        ),
    }
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "aligndp",
            "train",
            *QUICK,
            "--nproc",
            "2",
            "--steps",
            "2000",
            "--out",
            str(tmp_path),
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "metrics.jsonl").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.5)
        os.killpg(proc.pid, signal.SIGINT)  # what the terminal does: the whole process group
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    lines = [line for line in err.splitlines() if line.strip()]
    assert proc.returncode == 130, err
    assert lines == ["aligndp train: interrupted"], err
    assert not (tmp_path / LOCK_FILE).exists()
    # both ranks finished the step under way and saved it: the run continues from there
    saved = latest_checkpoint(str(tmp_path / "checkpoints"))
    assert saved is not None, "Ctrl-C saves a checkpoint (unless --no-final-checkpoint)"
    logged = read_metrics(tmp_path / "metrics.jsonl")
    assert saved.endswith(f"step-{logged[-1]['step'] + 1:06d}"), (saved, logged[-1])


def test_a_killed_rank_makes_train_exit_non_zero(tmp_path, capsys, monkeypatch):
    """Rank 1 dies by SIGKILL mid-run (a sitecustomize in the ranks' path kills it at step 3)."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import os, signal\n"
        "import aligndp.app.train_loop as loop\n"
        "original = loop._train_step\n"
        "def dying(job, step, *rest):\n"
        "    if step == 3 and job.rank == 1:\n"
        "        os.kill(os.getpid(), signal.SIGKILL)\n"
        "    return original(job, step, *rest)\n"
        "loop._train_step = dying\n"
    )
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(hook), os.environ.get("PYTHONPATH", "")]))
    assert (
        cli.main(
            [
                "train",
                *QUICK,
                "--nproc",
                "2",
                "--steps",
                "6",
                "--timeout",
                "10",
                "--out",
                str(tmp_path / "run"),
            ]
        )
        == 1
    )
    err = capsys.readouterr().err
    assert "aligndp train: error: " in err and "rank 1 (killed by SIGKILL)" in err, err
    assert not (tmp_path / "run" / LOCK_FILE).exists()


def test_a_rank_left_behind_ends_the_run_within_timeout(tmp_path, capsys, monkeypatch):
    """Rank 1 stalls at step 3 (as in a long evaluation): rank 0's next collective gives up
    after --timeout 5 s, not torch's 30 minutes, and the run exits 1 naming the rank."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import time\n"
        "import aligndp.app.train_loop as loop\n"
        "original = loop._train_step\n"
        "def stalling(job, step, *rest):\n"
        "    if step == 3 and job.rank == 1:\n"
        "        time.sleep(120)\n"
        "    return original(job, step, *rest)\n"
        "loop._train_step = stalling\n"
    )
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(hook), os.environ.get("PYTHONPATH", "")]))
    started = time.monotonic()
    assert (
        cli.main(
            [
                "train",
                *QUICK,
                "--nproc",
                "2",
                "--steps",
                "6",
                "--timeout",
                "5",
                "--out",
                str(tmp_path / "run"),
            ]
        )
        == 1
    )
    took = time.monotonic() - started
    assert took < 40, f"took {took:.0f} s with --timeout 5"
    assert "aligndp train: error: rank 0 (exit status 1) failed" in capsys.readouterr().err


def test_a_full_disk_at_a_checkpoint_is_one_line(tmp_path, capsys, monkeypatch):
    import errno

    import torch.distributed.checkpoint as dcp

    def full(self, plan, planner):
        raise OSError(errno.ENOSPC, "No space left on device", "__0_0.distcp")

    monkeypatch.setattr(dcp.FileSystemWriter, "write_data", full)
    assert train("--checkpoint-every", "2", out=tmp_path) == 2
    line = error_line(capsys)
    assert (
        "step-000002' failed on rank(s) [0]: no space left on the device (__0_0.distcp)" in line
    ), line
    assert not (tmp_path / "checkpoints" / "step-000002.partial").exists()


def test_lock_release_leaves_another_process_lock(tmp_path):
    lock = RunLock(str(tmp_path)).acquire()
    (tmp_path / LOCK_FILE).write_text("1 elsewhere\n")  # replaced by someone else meanwhile
    lock.release()
    assert (tmp_path / LOCK_FILE).exists()


def _a_finished_pid() -> int:
    """The pid of a process that has exited (a local lookup finds no such process)."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    return gone.pid


def test_a_lock_from_another_host_is_never_taken_over(tmp_path):
    """Regression (issue 25): the lock's pid means nothing on this machine when another host
    wrote it (a shared filesystem); a local pid lookup that finds no such process must not
    make it stale. Same pid, this host: taken over (the lookup is right here)."""
    pid = _a_finished_pid()
    lock_text = f"{pid} another-host.example\n"
    (tmp_path / LOCK_FILE).write_text(lock_text)
    with pytest.raises(ValueError, match=f"pid {pid} on another-host.example"):
        RunLock(str(tmp_path)).acquire()
    assert (tmp_path / LOCK_FILE).read_text() == lock_text, "another host's lock was touched"
    (tmp_path / LOCK_FILE).write_text(f"{pid} {os.uname().nodename}\n")
    RunLock(str(tmp_path)).acquire().release()


def test_every_option_is_in_the_identity_or_may_change_on_resume():
    """A new TrainConfig field must be classified: part of the run's identity (a resume with
    another value is refused) or one a resumed run may change. Unclassified, it would resume
    silently with whatever value it is given."""
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    assert not set(IDENTITY) & set(MAY_CHANGE_ON_RESUME)
    assert set(IDENTITY) | set(MAY_CHANGE_ON_RESUME) == fields, (
        f"unclassified: {sorted(fields - set(IDENTITY) - set(MAY_CHANGE_ON_RESUME))}"
    )


def _another(name: str, value):
    """A valid value of TrainConfig field ``name`` other than ``value``."""
    from aligndp.models.gpt import PRESETS

    others = {
        "preset": next(p for p in PRESETS if p != value),
        "optimizer": "muon" if value != "muon" else "adamw",
        "wgrad": "mxfp8" if value != "mxfp8" else "none",
        "wgrad_layers": "all" if value != "all" else "pays",
        "dtype": "bf16" if value != "bf16" else "fp32",
        "data": "other.txt",
    }
    if name in others:
        return others[name]
    return value * 2 if isinstance(value, float) else value + 8


@pytest.mark.parametrize("name", IDENTITY)
def test_resume_with_another_identity_option_is_refused(tmp_path, name):
    """Regression (issue 25): ``--resume`` with another ``--seed`` (or any other option of the
    run's identity) is refused, naming the option and both values."""
    config = TrainConfig(out=str(tmp_path), batch_size=8)
    write_run_files(config, [config.out, config.checkpoint_path])
    changed = dataclasses.replace(
        config, resume=True, **{name: _another(name, getattr(config, name))}
    )
    check_run_dirs(dataclasses.replace(config, resume=True))  # the same identity resumes
    flag = "--" + name.replace("_", "-")
    with pytest.raises(ValueError, match=f"{flag} {getattr(config, name)!r} there"):
        check_run_dirs(changed)
