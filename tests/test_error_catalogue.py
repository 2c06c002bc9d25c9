"""The catalogue of bad inputs: each one, library or CLI, with the message a user gets.

A table, so the count is visible (``test_the_catalogue_is_large``). Library entries raise the
listed exception type with a message matching the pattern, on one line; CLI entries exit 2
with exactly one line on stderr, ``aligndp <command>: error: ...``. Multi-rank cases (ranks
that disagree, collectives called on some ranks) are in test_reliability.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import types

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import aligndp
from aligndp.app import cli
from aligndp.runtime import agreement
from aligndp.runtime.ddp import DataParallel, DDPConfig
from aligndp.state.checkpoint import prune_checkpoints
from aligndp.user_input import check_parallelize_inputs
from tests.models import zero_middle


@pytest.fixture(scope="module")
def group():
    """A one-rank gloo group for this module only (other modules start their own)."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def saved(group, tmp_path_factory):
    """A good checkpoint of a small model, copied per case before the damage."""
    torch.manual_seed(0)
    model, opt = aligndp.parallelize(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)), lr=0.1)
    path = tmp_path_factory.mktemp("catalogue") / "good"
    aligndp.save(path, model, opt, step=7)
    return path


def net() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))


def write(path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def truncate(path) -> None:
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def load_damaged(damage):
    """Load a copy of the good checkpoint after ``damage(path)``."""

    def run(ctx):
        path = ctx.tmp / "damaged"
        shutil.copytree(ctx.saved, path)
        damage(path)
        model, opt = aligndp.parallelize(net(), lr=0.1)
        aligndp.load(path, model, opt)

    return run


def save_onto(make):
    def run(ctx):
        target = ctx.tmp / "target"
        make(target)
        model, opt = aligndp.parallelize(net(), lr=0.1)
        aligndp.save(target, model, opt)

    return run


def adamw_instance() -> torch.optim.Optimizer:
    return torch.optim.AdamW(nn.Linear(2, 2).parameters(), lr=1e-3)


def frozen() -> nn.Module:
    module = net()
    module.requires_grad_(False)
    return module


class Wide(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 9)


# (id, fn(ctx), exception type, message pattern)
LIBRARY = [
    (
        "parallelize a tensor",
        lambda ctx: check_parallelize_inputs(torch.zeros(4, 4), "adamw"),
        TypeError,
        r"wraps an nn.Module \(the model, not one of its tensors\), got a Tensor of shape \(4, 4\)",
    ),
    (
        "parallelize a wrapped model",
        lambda ctx: check_parallelize_inputs(aligndp.parallelize(net())[0], "adamw"),
        TypeError,
        "got a model it already wrapped",
    ),
    (
        "optimizer instance",
        lambda ctx: check_parallelize_inputs(net(), adamw_instance()),
        TypeError,
        r"got an instance of AdamW.*optimizer=torch.optim.AdamW.*lr=0.001",
    ),
    (
        "optimizer of another type",
        lambda ctx: check_parallelize_inputs(net(), 3),
        TypeError,
        "optimizer= takes a name .* got a builtins.int",
    ),
    (
        "unknown optimizer",
        lambda ctx: aligndp.parallelize(net(), optimizer="lion"),
        ValueError,
        "unknown optimizer 'lion'",
    ),
    (
        "unknown sharding",
        lambda ctx: aligndp.parallelize(net(), sharding="zero3"),
        ValueError,
        "unknown sharding 'zero3': choose one of none, zero1",
    ),
    (
        "unknown wgrad",
        lambda ctx: aligndp.parallelize(net(), wgrad="fp4"),
        ValueError,
        "unknown wgrad recipe 'fp4'",
    ),
    (
        "max_grad_norm 0",
        lambda ctx: aligndp.parallelize(net(), max_grad_norm=0),
        ValueError,
        "max_grad_norm must be > 0 or None, got 0",
    ),
    (
        "bucket_numel 0",
        lambda ctx: aligndp.parallelize(net(), bucket_numel=0),
        ValueError,
        "bucket_numel must be a positive number of elements",
    ),
    (
        "integer grad_dtype",
        lambda ctx: DDPConfig(grad_dtype=torch.int32),
        TypeError,
        "grad_dtype must be a floating torch.dtype",
    ),
    (
        "no trainable params",
        lambda ctx: aligndp.parallelize(frozen()),
        RuntimeError,
        "no trainable params",
    ),
    (
        "DataParallel of a tensor",
        lambda ctx: DataParallel(torch.zeros(3)),
        TypeError,
        "DataParallel wraps an nn.Module, got Tensor",
    ),
    (
        "save a plain module",
        lambda ctx: aligndp.save(ctx.tmp / "x", net()),
        TypeError,
        r"take the model returned by aligndp.parallelize\(\), got Sequential",
    ),
    (
        "save onto a file",
        save_onto(lambda p: write(p, "notes")),
        ValueError,
        "which is a file; aligndp never deletes or renames your files",
    ),
    (
        "save onto a user directory",
        save_onto(lambda p: (p.mkdir(), write(p / "cat.jpg", ""))),
        ValueError,
        "a directory that is not an aligndp checkpoint",
    ),
    (
        "save onto a user's <path>.old",
        save_onto(lambda p: write(str(p) + ".old", "keep")),
        ValueError,
        r"target.old'.*which is a file",
    ),
    (
        "load a missing directory",
        load_damaged(shutil.rmtree),
        ValueError,
        "the path does not exist",
    ),
    (
        "load a file",
        load_damaged(lambda p: (shutil.rmtree(p), write(p, ""))),
        ValueError,
        "is a file, not an aligndp checkpoint",
    ),
    (
        "load without aligndp.json",
        load_damaged(lambda p: os.remove(p / "aligndp.json")),
        ValueError,
        r"aligndp.json is missing",
    ),
    (
        "load an empty aligndp.json",
        load_damaged(lambda p: write(p / "aligndp.json", "")),
        ValueError,
        "aligndp.json' is damaged: empty",
    ),
    (
        "load a corrupt aligndp.json",
        load_damaged(lambda p: write(p / "aligndp.json", "{")),
        ValueError,
        "aligndp.json' is damaged: not valid JSON",
    ),
    (
        "load an aligndp.json without shapes",
        load_damaged(lambda p: write(p / "aligndp.json", '{"step": 1}')),
        ValueError,
        r"lacks \['shapes', 'checksums'\]",
    ),
    (
        "load without .metadata",
        load_damaged(lambda p: os.remove(p / ".metadata")),
        ValueError,
        r"\.metadata' is missing",
    ),
    (
        "load a truncated .metadata",
        load_damaged(lambda p: truncate(p / ".metadata")),
        ValueError,
        r"\.metadata' is damaged",
    ),
    (
        "load without a shard",
        load_damaged(lambda p: os.remove(p / "__0_0.distcp")),
        ValueError,
        "__0_0.distcp' is missing",
    ),
    (
        "load a truncated shard",
        load_damaged(lambda p: truncate(p / "__0_0.distcp")),
        ValueError,
        r"__0_0.distcp' is truncated: \d+ bytes, the checkpoint's index needs \d+",
    ),
    (
        "load a shard with 4 KiB zeroed inside, size unchanged",
        load_damaged(lambda p: zero_middle(p / "__0_0.distcp")),
        ValueError,
        r"__0_0.distcp' is damaged: its CRC-32 is [0-9a-f]{8}, aligndp.json recorded [0-9a-f]{8}",
    ),
    (
        "load a checkpoint of aligndp's format 1",
        load_damaged(lambda p: write(p / "aligndp.json", '{"format": 1, "step": 1}')),
        ValueError,
        r"is in aligndp checkpoint format 1 .*reads format 2 only",
    ),
    (
        "load into another model",
        lambda ctx: aligndp.load(ctx.saved, *aligndp.parallelize(Wide(), lr=0.1)),
        ValueError,
        "does not fit this model: missing .*'fc.weight'",
    ),
    (
        "timeout 0",
        lambda ctx: agreement.collective_timeout(0),
        ValueError,
        "positive number of seconds",
    ),
    (
        "timeout env not a number",
        lambda ctx: ctx.setenv(agreement.TIMEOUT_ENV, "soon"),
        ValueError,
        "ALIGNDP_COLLECTIVE_TIMEOUT='soon' is not a number",
    ),
    (
        "keep_last 0",
        lambda ctx: prune_checkpoints(ctx.tmp, keep_last=0),
        ValueError,
        "keep_last must be an integer >= 1, got 0",
    ),
]


def fake_run(out, *, lr=0.003, checkpoint=False) -> None:
    """What an earlier aligndp train leaves in ``out`` (without training)."""
    from aligndp.app.run_dir import IDENTITY
    from aligndp.app.train import TrainConfig

    config = dataclasses.replace(TrainConfig(), lr=lr)
    run = {
        "run_id": "0123456789ab",
        "created": "2026-11-30T09:00:00",
        "config": {k: getattr(config, k) for k in IDENTITY},
    }
    os.makedirs(out / "checkpoints" / "step-000002", exist_ok=True)
    write(out / "run.json", json.dumps(run))
    write(out / "metrics.jsonl", "")
    if checkpoint:
        write(out / "checkpoints" / "run.json", json.dumps(run))
        write(out / "checkpoints" / "step-000002" / "aligndp.json", "{}")


def text_file(tmp, size: int, name: str = "data.txt"):
    write(tmp / name, "a" * size)
    return str(tmp / name)


# (id, fn(tmp) -> argv, message pattern): every one exits 2 with one line on stderr
CLI = [
    ("train --preset unknown", lambda t: ["train", "--preset", "gpt5"], "unknown preset 'gpt5'"),
    (
        "train --steps 0",
        lambda t: ["train", "--steps", "0"],
        "--steps must be an integer >= 1, got 0",
    ),
    (
        "train --batch-size not splitting",
        lambda t: ["train", "--batch-size", "6", "--micro-batches", "4"],
        "--batch-size 6 does not split into --nproc 2 ranks x --micro-batches 4",
    ),
    ("train --lr 0", lambda t: ["train", "--lr", "0"], "--lr must be > 0, got 0.0"),
    ("train --timeout 0", lambda t: ["train", "--timeout", "0"], "--timeout must be > 0 seconds"),
    (
        "train --keep-last -1",
        lambda t: ["train", "--keep-last", "-1"],
        "--keep-last must be an integer >= 0",
    ),
    (
        "train --resume --overwrite",
        lambda t: ["train", "--resume", "--overwrite"],
        "pass one of them",
    ),
    (
        "train --resume without checkpoints",
        lambda t: ["train", "--resume"],
        "holds no complete checkpoint",
    ),
    (
        "train --wgrad fp8 on CPU",
        lambda t: ["train", "--wgrad", "fp8"],
        "--wgrad fp8 runs blockwise FP8 kernels",
    ),
    (
        "train --out a file",
        lambda t: (write(t / "f", ""), ["train", "--out", str(t / "f")])[1],
        "--out .*/f is a file; give a directory",
    ),
    (
        "train --checkpoint-dir a file",
        lambda t: (write(t / "f", ""), ["train", "--checkpoint-dir", str(t / "f")])[1],
        "--checkpoint-dir .*/f is a file; give a directory",
    ),
    (
        "train --data missing",
        lambda t: ["train", "--data", str(t / "nope.txt")],
        "nope.txt: no such file",
    ),
    (
        "train --data a directory",
        lambda t: ["train", "--data", str(t)],
        "is a directory; give one file",
    ),
    ("train --data empty", lambda t: ["train", "--data", text_file(t, 0)], "the file is empty"),
    (
        "train --data odd .bin",
        lambda t: ["train", "--data", text_file(t, 3, "x.bin")],
        "3 bytes is not a whole number of uint16 tokens",
    ),
    ("train --data too small", lambda t: ["train", "--data", text_file(t, 10)], "sequence"),
    (
        "train into another run",
        lambda t: (fake_run(t / "run"), ["train"])[1],
        "holds another run .run 0123456789ab",
    ),
    (
        "train --resume of another run",
        lambda t: (fake_run(t / "run", lr=0.5, checkpoint=True), ["train", "--resume"])[1],
        "--lr 0.5 there, 0.003 now",
    ),
    (
        "train into a locked --out",
        lambda t: (
            os.makedirs(t / "run"),
            write(t / "run" / ".lock", f"{os.getpid()} {os.uname().nodename}"),
            ["train"],
        )[2],
        f"another aligndp train .pid {os.getpid()} on",
    ),
    (
        "layout --png into a missing directory",
        lambda t: ["layout", "--preset", "demo", "--png", str(t / "a" / "b.png")],
        "does not exist; create it first",
    ),
    (
        "layout --png a directory",
        lambda t: ["layout", "--preset", "demo", "--png", str(t)],
        "is a directory",
    ),
    (
        "layout --nproc 0",
        lambda t: ["layout", "--preset", "demo", "--nproc", "0"],
        "--nproc must be >= 1, got 0",
    ),
    (
        "layout with two models",
        lambda t: ["layout", "--preset", "demo", "--shapes", "4"],
        r"give one of --preset or --shapes \(both given\)",
    ),
    ("layout unknown preset", lambda t: ["layout", "--preset", "gpt5"], "unknown preset 'gpt5'"),
]


def test_catalogue_ids_are_unique():
    """Each entry is its own pytest id: a duplicate would hide one entry behind another's."""
    ids = [entry[0] for entry in LIBRARY + CLI]
    assert len(set(ids)) == len(ids), sorted(i for i in ids if ids.count(i) > 1)


@pytest.mark.parametrize("label, fn, kind, pattern", LIBRARY, ids=[entry[0] for entry in LIBRARY])
def test_library(label, fn, kind, pattern, group, saved, tmp_path, monkeypatch):
    def setenv(name, value):
        monkeypatch.setenv(name, value)
        return agreement.collective_timeout()

    ctx = types.SimpleNamespace(tmp=tmp_path, saved=saved, setenv=setenv)
    with pytest.raises(kind, match=pattern) as info:
        fn(ctx)
    assert "\n" not in str(info.value), f"{label}: not one line: {info.value}"


@pytest.mark.parametrize("label, argv, pattern", CLI, ids=[entry[0] for entry in CLI])
def test_cli(label, argv, pattern, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = argv(tmp_path)
    if args[0] == "train" and "--out" not in args:
        args += ["--out", str(tmp_path / "run")]
    assert cli.main(args) == 2, label
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1, err
    assert err[0].startswith(f"aligndp {args[0]}: error: "), err[0]
    assert re.search(pattern, err[0]), err[0]


def test_parallelize_runs_the_input_checks(group):
    """Through the public door: needs check_parallelize_inputs called in parallelize (the lead's
    line)."""
    import inspect

    from aligndp import parallelize as module

    if "check_parallelize_inputs" not in inspect.getsource(module):
        pytest.skip(
            "aligndp.parallelize does not call aligndp.user_input.check_parallelize_inputs yet"
        )
    with pytest.raises(TypeError, match=r"got a Tensor of shape \(2, 2\)"):
        aligndp.parallelize(torch.zeros(2, 2))
    with pytest.raises(TypeError, match="got an instance of AdamW"):
        aligndp.parallelize(net(), optimizer=adamw_instance())
