"""`aligndp train` end to end: the 2-rank launch, parity with one process, outputs, bad input.

The 2-rank runs go through the real path (`cli.main` -> elastic launcher -> 2 gloo processes);
each costs a few seconds, so a module-scoped fixture runs the main one once. 1-rank runs train
in this process.
"""

import argparse
import json
import math
import os
import re
import shutil

import pytest
import torch

from aligndp.app import cli
from aligndp.app.run_checkpoints import latest_checkpoint
from aligndp.app.schedule import lr_factor
from aligndp.app.train import TrainConfig, add_arguments, config_from_args
from aligndp.app.train_report import MetricsLog, read_metrics
from aligndp.state.checkpoint_files import META_FILE
from tests.models import ADAMW_GAIN, MUON_GAIN, interrupted_copy, order_tolerance

STEPS = 20
COMMON = ["--steps", str(STEPS), "--batch-size", "8", "--eval-every", "10", "--seed", "3"]
LOSS_REL = order_tolerance(terms=8 * 64, steps=STEPS, gain=ADAMW_GAIN, cancelling=False)
"""Loss curves that differ only in fp32 summation order (tests/models.py [Tolerances]): the
longest sums are the weight gradients' 8 rows x 64 tokens; a loss weighs each param by its
gradient, so the cancelling elements barely move it."""
MUON_LOSS_REL = order_tolerance(terms=8 * 64, steps=STEPS, gain=MUON_GAIN, cancelling=False)


def _train(args, out):
    return cli.main(["train", *args, "--out", str(out)])


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """2 launched gloo ranks, each reading 2 micro-batches of 2 sequences of the global batch of
    8."""
    out = tmp_path_factory.mktemp("two_ranks")
    assert (
        cli.main(
            [
                "train",
                *COMMON,
                "--nproc",
                "2",
                "--micro-batches",
                "2",
                "--checkpoint-every",
                "10",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    return out


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """The same global batches in this one process, no micro-batches."""
    out = tmp_path_factory.mktemp("one_rank")
    assert cli.main(["train", *COMMON, "--nproc", "1", "--out", str(out)]) == 0
    return out


def test_two_ranks_loss_falls_and_outputs_parse(two_ranks):
    """torchtitan's integration flavours "default" and "DDP" (tests/integration_tests/
    features.py: the debug model trains under data parallelism and logs; here ``aligndp train
    --nproc 2``, replicated): the loss falls, metrics, summary and pictures parse."""
    records = read_metrics(two_ranks / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(STEPS))
    assert all({"step", "loss", "lr", "tokens_per_s"} <= r.keys() for r in records)
    first, last = records[0]["loss"], records[-1]["loss"]
    # a fresh model predicts ~uniform bytes: ln 256 = 5.545
    assert abs(first - math.log(256)) < 0.1
    # 20 steps learn the alphabet and grammar of the synthetic language: > 2 nats down
    assert last < first - 2.0, (first, last)
    assert [r["step"] for r in records if "eval_loss" in r] == [9, 19]
    summary = json.loads((two_ranks / "summary.json").read_text())
    assert summary["dp_size"] == 2 and summary["replicas_in_sync"] is True
    assert summary["eval_loss"] == records[-1]["eval_loss"]
    assert summary["padded_numel"] >= 136_960  # the demo preset's params
    for picture in ("loss.png", "layout.png"):
        assert (two_ranks / picture).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_one_rank_and_two_ranks_see_the_same_loss_curve(one_rank, two_ranks):
    """Same global batch: 2 ranks x 2 micro-batches of 2 rows, or 1 process with all 8 rows
    (torchtitan's "DDP" flavour, held to one process's losses).

    The reduced gradient is the mean over the same 8 rows either way, so the losses agree up to
    fp32 summation order."""
    one = [r["loss"] for r in read_metrics(one_rank / "metrics.jsonl")]
    two = [r["loss"] for r in read_metrics(two_ranks / "metrics.jsonl")]
    assert one == pytest.approx(two, rel=LOSS_REL)
    assert read_metrics(one_rank / "metrics.jsonl")[-1]["eval_loss"] == pytest.approx(
        read_metrics(two_ranks / "metrics.jsonl")[-1]["eval_loss"], rel=LOSS_REL
    )


@pytest.mark.parametrize("nproc", [2, 1])
def test_resume_continues_with_the_same_losses(two_ranks, tmp_path, nproc):
    """torchtitan's "Checkpoint Integration Test - Save Load Full Checkpoint" (train with
    checkpoints, then run again from the last one): killed at step 13 with its last
    checkpoint at step 10, the run resumes at step 10 and
    logs the losses of the uninterrupted run: identical at the same dp size, and equal to fp32
    summation order when resumed on 1 rank (the checkpoint is resharded)."""
    assert sorted(os.listdir(two_ranks / "checkpoints")) == [
        "run.json",
        "step-000010",
        "step-000020",
    ]
    interrupted_copy(two_ranks, tmp_path, checkpoint_step=10, last_logged_step=13)
    micro = ["--micro-batches", "2"] if nproc == 2 else []
    assert _train([*COMMON, *micro, "--nproc", str(nproc), "--resume"], tmp_path) == 0
    expected = read_metrics(two_ranks / "metrics.jsonl")
    resumed = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in resumed] == list(range(STEPS))
    assert resumed[:10] == expected[:10]  # kept from before the checkpoint
    losses, reference = [r["loss"] for r in resumed[10:]], [r["loss"] for r in expected[10:]]
    if nproc == 2:
        assert losses == reference
    else:
        assert losses == pytest.approx(reference, rel=LOSS_REL)
    assert json.loads((tmp_path / "summary.json").read_text())["start_step"] == 10


def test_resume_on_a_replicated_mesh(two_ranks, tmp_path, capfd):
    """torchtitan's "HSDP" flavour with its checkpoint flavour: the flat 2-rank run resumes on
    4 ranks as 2 replicas x 2 shards with zero1 (the
    checkpoint resharded onto a mesh): the losses of the uninterrupted run up to fp32
    summation order."""
    interrupted_copy(two_ranks, tmp_path, checkpoint_step=10, last_logged_step=13)
    mesh = ["--nproc", "4", "--replicas", "2", "--sharding", "zero1"]
    assert _train([*COMMON, *mesh, "--resume"], tmp_path) == 0
    assert "on 4 gloo rank(s) (2 replicas x 2 shards)" in capfd.readouterr().out
    losses = [r["loss"] for r in read_metrics(tmp_path / "metrics.jsonl")[10:]]
    reference = [r["loss"] for r in read_metrics(two_ranks / "metrics.jsonl")[10:]]
    assert losses == pytest.approx(reference, rel=LOSS_REL)


def _error_line(capsys):
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--preset", "gpt5"], "unknown preset 'gpt5': choose one of demo, tiny-odd"),
        (
            ["--batch-size", "6", "--micro-batches", "4"],
            r"--batch-size 6 does not split into --nproc 2 ranks x --micro-batches 4 = 8 "
            r"equal parts.*--batch-size 8",
        ),
        (["--steps", "0"], "--steps must be an integer >= 1, got 0"),
        (
            ["--nproc", "4", "--replicas", "3"],
            r"--replicas 3 does not split the 4 ranks .* into equal replicas; use one of 1, 2, 4",
        ),
        (["--replicas", "0"], "--replicas must be an integer >= 1, got 0"),
        (["--resume"], "holds no complete checkpoint; a run saves one when it ends"),
        (
            ["--wgrad", "fp8"],
            "--wgrad fp8 runs blockwise FP8 kernels on a Hopper GPU; use --device cuda",
        ),
    ],
)
def test_bad_options_are_one_line_and_exit_2(tmp_path, capsys, args, message):
    assert _train(args, tmp_path) == 2
    line = _error_line(capsys)
    assert line.startswith("aligndp train: error: ")
    assert re.search(message, line), line


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the message on a machine without CUDA"
)
def test_cuda_without_a_gpu(tmp_path, capsys):
    assert _train(["--device", "cuda"], tmp_path) == 2
    assert "--device cuda but torch sees no CUDA device; use --device cpu" in _error_line(capsys)


def test_compile_without_a_compiler_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda _name: None)
    assert _train(["--compile", "--device", "cpu"], tmp_path) == 2
    line = _error_line(capsys)
    assert line.startswith("aligndp train: error: --compile: "), line
    assert "needs a C++ compiler (c++, g++ or clang++) on PATH" in line, line


def test_data_file_too_small_for_one_batch(tmp_path, capsys):
    path = tmp_path / "tiny.txt"
    path.write_text("hello world\n" * 10)
    assert _train(["--data", str(path)], tmp_path / "out") == 2
    assert "the eval split has 12 tokens but one sequence needs seq_len + 1 = 65" in _error_line(
        capsys
    )


def test_text_file_trains_in_one_process(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_bytes(b"the quick brown fox jumps over the lazy dog. " * 200)
    assert (
        _train(
            ["--data", str(path), "--nproc", "1", "--steps", "3", "--batch-size", "2"],
            tmp_path / "out",
        )
        == 0
    )
    assert len(read_metrics(tmp_path / "out" / "metrics.jsonl")) == 3


def _losses(out):
    return [r["loss"] for r in read_metrics(out / "metrics.jsonl")]


def test_zero1_with_one_rank_matches_the_replicated_run(one_rank, tmp_path):
    """ZeRO-1 steps the same AdamW on owned slices; with 1 rank the shard is the whole buffer."""
    assert _train([*COMMON, "--sharding", "zero1", "--nproc", "1"], tmp_path) == 0
    assert _losses(tmp_path) == pytest.approx(_losses(one_rank), rel=LOSS_REL)


def test_compile_trains_through_the_compiled_wrapper(one_rank, tmp_path, monkeypatch):
    """--compile compiles the wrapped model (TrainConfig.compile) and trains the same curve as
    eager; aot_eager here (Inductor's C++ build would cost the CPU suite a minute), so the
    graphs are the same ops: fp32 summation order at most. On CPU the default stays eager."""
    import torch

    compiled = []
    real = torch.compile

    def aot_eager(model, **kwargs):
        compiled.append(model)
        return real(model, backend="aot_eager")

    monkeypatch.setattr(torch, "compile", aot_eager)
    assert _train([*COMMON, "--nproc", "1", "--compile"], tmp_path) == 0
    assert [type(m).__name__ for m in compiled] == ["DataParallel"]
    assert _losses(tmp_path) == pytest.approx(_losses(one_rank), rel=LOSS_REL)
    assert _train([*COMMON, "--nproc", "1", "--steps", "1"], tmp_path / "eager") == 0
    assert len(compiled) == 1  # neither flag on CPU: not compiled


def test_sharded_muon_on_two_ranks_matches_one_process(tmp_path):
    """Layer-wise Muon with ZeRO-1 AdamW for the rest, 2 micro-batches, evaluation between
    steps (a forward while the param all-gather may be pending), against replicated Muon in
    one process, within :data:`MUON_LOSS_REL` (Newton-Schulz amplifies the fp32 rounding
    differences of the reduced gradient: tests/models.py MUON_GAIN)."""
    muon = [*COMMON, "--optimizer", "muon"]  # the default lr serves Muon and AdamW
    assert _train([*muon, "--nproc", "1"], tmp_path / "one") == 0
    assert (
        _train(
            [*muon, "--sharding", "zero1", "--micro-batches", "2", "--nproc", "2"], tmp_path / "two"
        )
        == 0
    )
    one, two = _losses(tmp_path / "one"), _losses(tmp_path / "two")
    assert two == pytest.approx(one, rel=MUON_LOSS_REL)
    assert two[-1] < two[0] - 2.0
    assert json.loads((tmp_path / "two" / "summary.json").read_text())["replicas_in_sync"] is True


def test_mxfp8_wgrad_stays_close_to_fp32(one_rank, tmp_path, capsys):
    """--wgrad mxfp8 --wgrad-layers all swaps the hidden Linears for MXLinear (CPU reference
    backend; demo preset: 2 blocks x qkv, proj, fc, out, then the head) and says so: the curve
    must differ from fp32 (the MX GEMMs are really used) but stay close (seen: 0.005 nats)."""
    args = [*COMMON, "--wgrad", "mxfp8", "--wgrad-layers", "all", "--nproc", "1"]
    assert _train(args, tmp_path) == 0
    assert "wgrad mxfp8: converts 8 of 9 Linear layers (blocks.*.qkv," in capsys.readouterr().out
    gaps = [abs(a - b) for a, b in zip(_losses(tmp_path), _losses(one_rank))]
    assert 1e-4 < max(gaps) < 0.03, gaps


def test_fp8_param_gather_trains_as_the_full_precision_gather(tmp_path, capsys):
    """--fp8-param-gather moves the converted layers' weights as FP8 bytes plus a scale
    ([Note: FP8 param gather]). With fp32 params the forward GEMM quantises the same fp32 master
    either way (one scale per whole tensor), so the two runs' losses agree to the bit; the
    flag without --sharding zero1 is a one-line error. One rank, in this process (the gathers
    at dp 2 and 3 are tests/test_fp8_param_gather.py's)."""
    args = ["--steps", "4", "--batch-size", "8", "--eval-every", "0", "--seed", "3"]
    args += ["--wgrad", "fp8-tensor", "--wgrad-layers", "all", "--nproc", "1"]
    assert _train([*args, "--sharding", "zero1"], tmp_path / "plain") == 0
    assert _train([*args, "--sharding", "zero1", "--fp8-param-gather"], tmp_path / "fp8") == 0
    assert _losses(tmp_path / "fp8") == _losses(tmp_path / "plain")
    capsys.readouterr()
    assert _train([*args, "--fp8-param-gather"], tmp_path / "refused") == 2
    assert "fp8_param_gather=True gathers sharded params" in _error_line(capsys)


def test_recipe_registered_at_runtime_trains_on_launched_ranks(two_ranks, tmp_path):
    """Regression (issue 25): ``--wgrad`` took only the recipes registered when the CLI module
    was imported, and the launched ranks (fresh interpreters) would not know one registered by
    the caller. A copy of mxfp8 under another name, registered here, must parse, reach both
    ranks and move the curve as mxfp8 does (MX GEMMs used: above fp32 noise; still training)."""
    import dataclasses

    from aligndp.lowp import BackendRef, get_recipe, registered_recipe

    mine = dataclasses.replace(
        get_recipe("mxfp8"),
        name="runtime-mx",
        backends=(
            BackendRef("runtime-mx-reference", "aligndp.lowp.backends:ReferenceBackend", ("cpu",)),
        ),
    )
    with registered_recipe(mine):
        assert TrainConfig(wgrad="runtime-mx").wgrad == "runtime-mx"
        args = [*COMMON, "--wgrad", "runtime-mx", "--wgrad-layers", "all", "--nproc", "2"]
        args += ["--micro-batches", "2"]
        assert _train(args, tmp_path) == 0
    assert json.loads((tmp_path / "run.json").read_text())["config"]["wgrad"] == "runtime-mx"
    gaps = [abs(a - b) for a, b in zip(_losses(tmp_path), _losses(two_ranks))]
    assert 1e-4 < max(gaps) < 0.03, gaps
    with pytest.raises(ValueError, match="--wgrad 'runtime-mx' is not one of"):
        TrainConfig(wgrad="runtime-mx")  # unregistered again


def test_engine_not_implemented_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch):
    """An option combination the engine does not build yet raises NotImplementedError inside
    the ranks; the job reports it as one line, exit 2 (as for any bad input)."""
    import aligndp

    def not_yet(module, **kwargs):
        raise NotImplementedError("sharding='zero2' is not implemented yet")

    monkeypatch.setattr(aligndp, "parallelize", not_yet)
    assert _train([*COMMON, "--nproc", "1"], tmp_path) == 2
    assert (
        _error_line(capsys)
        == "aligndp train: error: not implemented yet: sharding='zero2' is not implemented yet"
    )


def test_flags_are_pinned():
    """The CLI is generated from TrainConfig; this pins it so it cannot drift silently."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    flags = {s for a in parser._actions for s in a.option_strings} - {"-h", "--help"}
    assert flags == {
        "--preset",
        "--steps",
        "--batch-size",
        "--micro-batches",
        "--optimizer",
        "--sharding",
        "--wgrad",
        "--wgrad-layers",
        "--fp8-param-gather",
        "--lr",
        "--seed",
        "--nproc",
        "--replicas",
        "--device",
        "--dtype",
        "--compile",
        "--no-compile",
        "--eval-every",
        "--checkpoint-dir",
        "--checkpoint-every",
        "--no-final-checkpoint",
        "--keep-last",
        "--resume",
        "--resume-from",
        "--overwrite",
        "--out",
        "--log-with",
        "--data",
        "--timeout",
        "--config",
    }
    assert config_from_args(parser.parse_args([])) == TrainConfig()
    config = config_from_args(
        parser.parse_args(["--batch-size", "12", "--lr", "0.01", "--resume", "--data", "x.bin"])
    )
    assert (config.batch_size, config.lr, config.resume, config.data) == (12, 0.01, True, "x.bin")
    help_text = parser.format_help()
    assert "Global batch in sequences per optimizer step" in help_text  # from the field docstring
    with pytest.raises(SystemExit):
        parser.parse_args(["--optimizer", "sgd"])


def test_config_checks_choices_when_built_in_code():
    with pytest.raises(ValueError, match="--sharding 'zero3' is not one of none, zero1"):
        TrainConfig(sharding="zero3")
    with pytest.raises(ValueError, match="--lr must be > 0"):
        TrainConfig(lr=0.0)
    assert TrainConfig(checkpoint_dir=None, out="o").checkpoint_path == os.path.join(
        "o", "checkpoints"
    )


def test_lr_schedule_by_hand():
    # 100 steps: 10 warm-up steps (0.1, 0.2, ..., 1.0), then cosine from 1.0 at step 10 to 0.1
    # at step 99
    assert [lr_factor(s, 100) for s in (0, 4, 9)] == pytest.approx([0.1, 0.5, 1.0])
    assert lr_factor(10, 100) == pytest.approx(1.0)
    assert lr_factor(10 + 89 / 2, 100) == pytest.approx(0.55)
    assert lr_factor(99, 100) == pytest.approx(0.1)
    assert lr_factor(0, 1) == pytest.approx(1.0)  # no warm-up in a 1-step run


def test_latest_checkpoint_picks_the_highest_complete_step(tmp_path):
    """A ``step-N.partial`` left by a save that died, and a ``step-N`` without the
    ``aligndp.json`` that aligndp.save writes last, are no checkpoints to resume from."""
    assert latest_checkpoint(str(tmp_path / "missing")) is None
    for name in ("step-000010", "step-000200", "step-000030", "notes"):
        (tmp_path / name).mkdir()
        (tmp_path / name / META_FILE).write_text("{}")
    (tmp_path / "step-000300.partial").mkdir()
    (tmp_path / "step-000300.partial" / META_FILE).write_text("{}")
    (tmp_path / "step-000400").mkdir()  # a user's, or one being renamed into place
    assert latest_checkpoint(str(tmp_path)) == str(tmp_path / "step-000200")


def test_resumed_metrics_drop_the_steps_after_the_checkpoint(tmp_path):
    path = str(tmp_path / "metrics.jsonl")
    log = MetricsLog(path)
    for step in range(5):
        log.write({"step": step, "loss": 10.0 - step})
    resumed = MetricsLog(path, start_step=3)
    resumed.write({"step": 3, "loss": 7.5})
    assert [(r["step"], r["loss"]) for r in read_metrics(path)] == [
        (0, 10.0),
        (1, 9.0),
        (2, 8.0),
        (3, 7.5),
    ]
    assert resumed.first_loss == 10.0
