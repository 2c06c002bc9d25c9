"""`aligndp layout`: flags, JSON, PNG, presets and user errors (in-process through cli.main)."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import aligndp
from aligndp.app import cli, layout_cli
from aligndp.app.plot import draw_layout
from aligndp.models.gpt import GPT, PRESETS
from aligndp.optim.ns_cost import H200_NS_COST
from aligndp.plan.layout import plan_layout
from aligndp.plan.spec import ParamSpec

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def layout_main(capsys, *argv):
    code = cli.main(["layout", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_flags_are_pinned():
    """Adding, renaming or dropping a flag must be a deliberate change to this list (and the
    docs)."""
    parser = argparse.ArgumentParser()
    layout_cli.add_arguments(parser)
    flags = {s for action in parser._actions for s in action.option_strings}
    assert flags == {
        "-h",
        "--help",
        "--preset",
        "--shapes",
        "--nproc",
        "--replicas",
        "--sharding",
        "--optimizer",
        "--wgrad",
        "--capability",
        "--bucket-numel",
        "--dtype",
        "--grad-dtype",
        "--start-alignment",
        "--json",
        "--png",
        "--dp",  # refused, naming --nproc
        "--mode",  # refused, naming --sharding
    }


def test_json_matches_plan_layout(capsys):
    code, out, _ = layout_main(
        capsys,
        "--shapes",
        "768x2304,2304,50257x768",
        "--nproc",
        "4",
        "--sharding",
        "zero1",
        "--bucket-numel",
        "2000000",
        "--json",
    )
    assert code == 0
    doc = json.loads(out)
    expected = plan_layout(
        [ParamSpec("p0", (768, 2304)), ParamSpec("p1", (2304,)), ParamSpec("p2", (50257, 768))],
        dp_size=4,
        mode="sharded",
        bucket_numel=2_000_000,
    )
    (buffer,) = doc["buffers"]
    for key in (
        "mode",
        "dtype",
        "numel",
        "padded_numel",
        "padding_numel",
        "imbalance",
        "buckets",
        "params",
    ):
        assert key in buffer
    assert buffer["mode"] == "sharded" and buffer["dtype"] == "float32"
    assert (buffer["numel"], buffer["padded_numel"]) == (expected.numel, expected.padded_numel)
    assert buffer["numel"] == 768 * 2304 + 2304 + 50257 * 768
    assert buffer["buckets"] == [{"start": b.start, "end": b.end} for b in expected.buckets]
    assert [
        (p["name"], tuple(p["shape"]), p["start"], p["end"], p["bucket"], p["owner"])
        for p in buffer["params"]
    ] == [(p.name, p.shape, p.start, p.end, p.bucket, p.owner) for p in expected.params]
    assert [p["name"] for p in buffer["params"]] == ["p2", "p1", "p0"]


def test_replicas_plan_for_the_shard_group(capsys):
    """--nproc 8 --replicas 2: 2 replicas of 4 ranks; the buffers are planned for the 4 ranks
    that shard them (the run's shard group), not for all 8 (at dp 8 this buffer pads to 4,096
    elements, at dp 4 to 3,584), and each rank sends its owned shard of every sharded bucket
    across the replicas: 3,584 / 4 fp32 elements."""
    shapes = ["--shapes", "40x30,30,50x40", "--sharding", "zero1", "--bucket-numel", "1000"]
    code, out, _ = layout_main(capsys, *shapes, "--nproc", "8", "--replicas", "2", "--json")
    assert code == 0
    doc = json.loads(out)
    specs = [ParamSpec("p0", (40, 30)), ParamSpec("p1", (30,)), ParamSpec("p2", (50, 40))]
    expected = plan_layout(specs, dp_size=4, mode="sharded", bucket_numel=1000)
    assert doc["mesh"] == {"replicas": 2, "shards": 4}
    (buffer,) = doc["buffers"]
    assert buffer["padded_numel"] == expected.padded_numel == 3584
    assert buffer["buckets"] == [{"start": b.start, "end": b.end} for b in expected.buckets]
    assert len(expected.buckets) > 1
    assert [(p["name"], p["start"], p["owner"]) for p in buffer["params"]] == [
        (p.name, p.start, p.owner) for p in expected.params
    ]
    code, out, _ = layout_main(capsys, *shapes, "--nproc", "8", "--replicas", "2")
    assert (
        "mesh: 8 ranks (2 replicas x 4 shards): every replica holds the plan above, made for "
        f"its 4 ranks (its shard group); each rank all-reduces {3584 // 4 * 4:,} bytes of owned "
        "shards across the replicas per step"
    ) in out
    assert "dp_size=4" in out
    code, out, _ = layout_main(capsys, *shapes, "--nproc", "8", "--json")
    assert json.loads(out)["mesh"] == {"replicas": 1, "shards": 8}
    assert json.loads(out)["buffers"][0]["padded_numel"] == 4096


def test_layerwise_table_shows_per_rank_cost_numel_and_imbalance(capsys):
    # two 64x64 and two 32x32 on 2 ranks: each rank one of each; Muon's default cost is the
    # H200's Newton-Schulz time ([Note: Newton–Schulz device cost]): per matrix a fixed cost
    # and m²·(2m + m) multiply-adds per iteration, so 2 fixed costs + 3·(64^3 + 32^3) =
    # 884,736 multiply-adds, and 4096 + 1024 = 5,120 elements per rank, imbalance exactly 1.
    code, out, _ = layout_main(
        capsys,
        "--shapes",
        "64x64,64x64,32x32,32x32",
        "--nproc",
        "2",
        "--sharding",
        "zero1",
        "--optimizer",
        "muon",  # Newton–Schulz owner cost; without it the cost is the numel
    )
    assert code == 0
    cost = 2 * H200_NS_COST.fixed_s + 884_736 * H200_NS_COST.s_per_madd
    assert out.count(f"{cost:.4g}") == 2 and out.count("5,120") >= 2
    assert "NS imbalance max/mean 1.0000 (numel 1.0000), 0 matrices split" in out
    assert "0 padding" in out and "1 bucket(s)" in out


def test_layerwise_muon_shows_split_matrices_and_ns_imbalance(capsys):
    # p0 8192x32768 costs F + 8192²·(2·32768 + 8192) multiply-adds per iteration (F the H200's
    # fixed cost per part), p1 256x256 F + 256²·768: whole, p0's owner does nearly all of it.
    # Split in 2: 16384 columns and (2·32768 + 8192)/2 - 2·16384 = 4096 rows of B per part,
    # F + 8192²·36864 each; rank 1 also owns p1.
    code, out, _ = layout_main(
        capsys, "--shapes", "8192x32768,256x256", "--nproc", "2", "--sharding", "zero1",
        "--optimizer", "muon",
    )  # fmt: skip
    assert code == 0
    fixed, s = H200_NS_COST.fixed_s, H200_NS_COST.s_per_madd
    part, small = fixed + 8192**2 * 36864 * s, fixed + 256**2 * 768 * s
    ratio = (part + small) / ((2 * part + small) / 2)
    assert f"NS imbalance max/mean {ratio:.4f}" in out and "1 matrices split" in out
    assert "p0 8192x32768: 0:16384 1:16384" in out
    code, out, _ = layout_main(
        capsys, "--shapes", "8192x32768,256x256", "--nproc", "2", "--sharding", "zero1",
        "--optimizer", "muon", "--json",
    )  # fmt: skip
    (layerwise,) = json.loads(out)["buffers"]
    split = {p["name"]: p["split"] for p in layerwise["params"]}
    assert split == {"p0": {"ranks": [0, 1], "cols": [0, 16384, 32768]}, "p1": None}


def test_lowered_alignment_shows_the_effective_one(capsys):
    code, out, _ = layout_main(
        capsys, "--shapes", "97,103", "--wgrad", "mxfp8", "--start-alignment", "1", "--json"
    )
    assert code == 0
    (buffer,) = json.loads(out)["buffers"]
    assert buffer["start_alignment"] == 64 and [p["start"] for p in buffer["params"]] == [0, 128]
    code, out, _ = layout_main(
        capsys, "--shapes", "97,103", "--wgrad", "mxfp8", "--start-alignment", "1"
    )
    assert "asked 1, effective 64 elements (raised by MXFP8 wgrad (cuBLASLt/Triton): 64)" in out


def test_png_is_written(capsys, tmp_path):
    path = tmp_path / "layout.png"
    code, out, _ = layout_main(
        capsys,
        "--shapes",
        "97,103,100x100,300x50",
        "--nproc",
        "2",
        "--sharding",
        "zero1",
        "--optimizer",
        "muon",
        "--png",
        str(path),
    )
    assert code == 0 and str(path) in out
    assert path.read_bytes()[:8] == PNG_MAGIC


def test_draw_layout_handles_many_params_and_buffers(tmp_path):
    specs = [ParamSpec(f"blocks.{i}.w", (37 + i, 11 + i % 7)) for i in range(200)]
    layouts = [
        plan_layout(specs, dp_size=8, mode=m, bucket_numel=40_000) for m in ("sharded", "layerwise")
    ]
    draw_layout(layouts, tmp_path / "many.png")
    assert (tmp_path / "many.png").read_bytes()[:8] == PNG_MAGIC


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_preset_plans_on_the_meta_device(capsys, preset):
    code, out, _ = layout_main(
        capsys,
        "--preset",
        preset,
        "--nproc",
        "8",
        "--sharding",
        "zero1",
        "--dtype",
        "bf16",
        "--wgrad",
        "mxfp8",
        "--json",
    )
    assert code == 0
    (buffer,) = json.loads(out)["buffers"]
    with torch.device("meta"):
        model = GPT(PRESETS[preset])
    named = dict(model.named_parameters())  # a tied head is listed once
    assert buffer["numel"] == sum(p.numel() for p in named.values())
    assert sorted(p["name"] for p in buffer["params"]) == sorted(named)
    assert ("head.weight" in named) is not PRESETS[preset].tied
    assert buffer["param_dtype"] == "bfloat16" and all(
        p["start"] % 64 == 0 for p in buffer["params"]
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--shapes", "12xq"], r"'12xq', not a shape.*e\.g\. --shapes"),
        (["--shapes", "12,,3"], r"item 1 is ''"),
        (["--shapes", "0x4"], r"zero elements"),
        (
            ["--preset", "demo", "--shapes", "4"],
            r"one of --preset or --shapes \(both given\)",
        ),
        (["--preset", "gpt5"], r"unknown preset 'gpt5'.*gpt2-small"),
        (["--shapes", "4", "--nproc", "0"], r"--nproc must be >= 1, got 0"),
        (
            ["--shapes", "4", "--nproc", "4", "--replicas", "3"],
            r"--replicas 3 does not split --nproc 4 ranks \(the world size\).*use one of 1, 2, 4$",
        ),
        (["--shapes", "4", "--nproc", "4", "--replicas", "0"], r"--replicas 0 does not split"),
        (
            ["--shapes", "4", "--bucket-numel", "0"],
            r"--bucket-numel must be a positive number.*leave it out",
        ),
        (["--shapes", "4", "--start-alignment", "48"], r"power of two.*48"),
        (["--shapes", "4", "--wgrad", "nvfp4"], r"--wgrad 'nvfp4' is not one of none, fp8"),
    ],
)
def test_bad_input_exits_2_with_a_message(capsys, argv, message):
    code, out, err = layout_main(capsys, *argv)
    assert code == 2 and out == ""
    assert err.startswith("aligndp layout: error: ")
    assert re.search(message, err), err


@pytest.mark.parametrize("preset", ["gpt2-small", "tiny-odd"])
def test_muon_layerwise_plans_what_zero1_muon_builds(capsys, preset):
    """--optimizer muon --mode layerwise: the routed hidden matrices (tied head and embeddings
    excluded) in one layer-wise buffer, every other param in a ZeRO-1 sharded buffer."""
    code, out, _ = layout_main(
        capsys,
        "--preset",
        preset,
        "--nproc",
        "4",
        "--sharding",
        "zero1",
        "--optimizer",
        "muon",
        "--json",
    )
    assert code == 0
    buffers = {b["mode"]: {p["name"] for p in b["params"]} for b in json.loads(out)["buffers"]}
    with torch.device("meta"):
        model = GPT(PRESETS[preset])
    hidden = {n for n, p in model.named_parameters() if p.ndim == 2 and n.startswith("blocks.")}
    assert buffers["layerwise"] == hidden
    assert buffers["sharded"] == {n for n, _ in model.named_parameters()} - hidden
    code, out, _ = layout_main(
        capsys, "--preset", preset, "--nproc", "4", "--optimizer", "muon", "--json"
    )
    (only,) = json.loads(out)["buffers"]
    assert only["mode"] == "replicated", "sharding none with Muon: plain DDP buffers"


def test_muon_on_bare_shapes_routes_the_2d_ones(capsys):
    code, out, _ = layout_main(
        capsys,
        "--shapes",
        "96x64,64,64x96",
        "--nproc",
        "2",
        "--sharding",
        "zero1",
        "--optimizer",
        "muon",
        "--json",
    )
    buffers = {b["mode"]: [p["name"] for p in b["params"]] for b in json.loads(out)["buffers"]}
    assert sorted(buffers["layerwise"]) == ["p0", "p2"] and buffers["sharded"] == ["p1"]


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (
            ["--sharding", "zero3"],
            "aligndp layout: error: argument --sharding: invalid choice: 'zero3' (choose from "
            "'none', 'zero1'); did you mean zero1? (see aligndp layout --help)",
        ),
        (
            ["--dp", "2"],
            "aligndp layout: error: --dp is now --nproc N (the rank count, as aligndp train "
            "counts it) (see aligndp layout --help)",
        ),
        (
            ["--mode", "layerwise"],
            "aligndp layout: error: --mode is now --sharding none|zero1 (replicated -> none, "
            "sharded -> zero1; layerwise -> zero1 with --optimizer muon) (see aligndp layout "
            "--help)",
        ),
        (
            ["--nprc", "2"],
            "aligndp layout: error: unrecognized arguments: --nprc 2; did you mean --nproc? "
            "(see aligndp layout --help)",
        ),
    ],
)
def test_flag_errors_are_one_line_naming_the_right_spelling(capsys, argv, line):
    """The vocabulary of aligndp train: the old --dp and --mode are refused naming the new
    flag, a mistyped flag or choice names the closest one; one line, exit 2, no usage."""
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["layout", "--shapes", "4", *argv])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.splitlines() == [line]


def test_bare_layout_shows_the_demo(capsys):
    code, bare, _ = layout_main(capsys)
    assert code == 0
    _, demo, _ = layout_main(capsys, "--preset", "demo")
    assert bare == demo and "total: " in bare


def test_python_dash_m_aligndp_layout():
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "aligndp",
            "layout",
            "--shapes",
            "96x64,64,64x96",
            "--nproc",
            "2",
            "--sharding",
            "zero1",
            "--optimizer",
            "muon",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "layerwise buffer" in result.stdout and "NS imbalance max/mean" in result.stdout


@pytest.mark.parametrize(
    ("flags", "kwargs"),
    [
        ([], {}),  # the defaults: replicated, 40 M-element buckets
        (
            ["--sharding", "zero1", "--optimizer", "muon"],
            {"optimizer": "muon", "sharding": "zero1"},
        ),
    ],
)
def test_gpt2_small_shows_the_buckets_the_run_builds(capsys, flags, kwargs):
    """The picture is not a second implementation: what `aligndp layout --preset gpt2-small`
    prints is what ``parallelize`` allocates for the real model (one rank; the defaults of
    both, nothing passed twice)."""
    code, out, _ = layout_main(capsys, "--preset", "gpt2-small", *flags, "--json")
    assert code == 0
    shown = [
        (b["mode"], b["buckets"], [(p["name"], p["start"], p["owner"]) for p in b["params"]])
        for b in json.loads(out)["buffers"]
    ]
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model, _ = aligndp.parallelize(GPT(PRESETS["gpt2-small"]), **kwargs)
        built = [
            (
                layout.mode.value,
                [{"start": b.start, "end": b.end} for b in layout.buckets],
                [(p.name, p.start, p.owner) for p in layout.params],
            )
            for layout in model.layouts
        ]
        del model
    finally:
        dist.destroy_process_group()
    assert shown == built
    assert sum(len(buckets) for _, buckets, _ in shown) > len(shown), "several 40 M buckets"


def test_reports_which_layers_the_wgrad_recipe_converts(capsys, monkeypatch):
    """1b on Hopper (the default --capability 9.0): fp8-tensor and fp8 1x128 convert the 64
    block Linears (in and out >= 2048, where the H200 1b step measured a gain); MXFP8 on
    sm_100 converts qkv and fc (torchao's rowwise rule keeps out <= 2048: proj, out); no
    recipe converts anything on a CPU, and says why once."""
    from aligndp.lowp import layer_rule

    monkeypatch.setattr(layer_rule, "_WARNED", set())  # warned once per process: not yet here
    code, out, _ = layout_main(capsys, "--preset", "1b", "--wgrad", "fp8-tensor")
    assert code == 0
    assert "wgrad fp8-tensor: converts 64 of 65 Linear layers (blocks.*.qkv, blocks.*.proj, " in out
    _, out, _ = layout_main(capsys, "--preset", "1b", "--wgrad", "fp8")
    assert "wgrad fp8: converts 64 of 65 Linear layers (blocks.*.qkv, blocks.*.proj, " in out
    _, out, _ = layout_main(capsys, "--preset", "1b", "--wgrad", "mxfp8", "--capability", "10.0")
    assert "wgrad mxfp8: converts 32 of 65" in out
    with pytest.warns(UserWarning, match="no fast path on a CPU"):
        _, out, _ = layout_main(
            capsys, "--preset", "1b", "--wgrad", "fp8-tensor", "--capability", "cpu"
        )
    assert "converts 0 of 65 Linear layers (none)" in out
