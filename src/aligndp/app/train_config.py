"""What ``aligndp train`` can be told: :class:`TrainConfig`, one frozen field per flag.

The argparse flags are generated from the fields (their docstrings are the help texts), so
the options, their checks and ``aligndp train --help`` cannot drift apart. ``--config run.toml``
gives the fields from a TOML file (the ``run.toml`` a run writes reproduces it); flags given on
the command line override it. This module imports no torch: ``aligndp train --help`` and a
mistyped flag answer at once.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import os
import textwrap
import typing
from typing import Literal

from aligndp.app.config_file import field_type, read_toml
from aligndp.models.presets import PRESETS, describe_presets

__all__ = [
    "LOGGERS",
    "TrainConfig",
    "add_arguments",
    "check_replicas",
    "config_from_args",
    "describe_mesh",
]

Optimizer = Literal["adamw", "muon"]
Sharding = Literal["none", "zero1"]
WgradLayers = Literal["pays", "all"]
Device = Literal["cpu", "cuda"]
Dtype = Literal["fp32", "bf16"]
LOGGERS = ("tensorboard", "wandb")
"""What ``--log-with`` takes (comma-separated), beside metrics.jsonl which is always written."""


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything ``aligndp train`` can be told; one flag per field."""

    preset: str = "demo"
    """Model shape, one of aligndp.models.PRESETS: {presets}."""
    steps: int = 500
    """Optimizer steps to train for, in total (counting steps done before a --resume).
    --resume with a larger --steps extends a finished run: from the resume step on, the lr
    follows the schedule of a run of the new length (the cosine decay laid out again over the
    new total, so the lr rises to that schedule's value at the resume step)."""
    batch_size: int = 32
    """Global batch in sequences per optimizer step, over all ranks and micro-batches."""
    micro_batches: int = 1
    """Micro-batches per rank per step (gradient accumulation under model.no_sync())."""
    optimizer: Optimizer = "adamw"
    """Optimizer that aligndp.parallelize builds."""
    sharding: Sharding = "none"
    """none: replicated optimizer state (all-reduce); zero1: optimizer state sharded over ranks."""
    wgrad: str = "none"
    """Low-precision weight-gradient GEMMs accumulating into the aligned grad buffer: a wgrad
    recipe registered when the flags are read (aligndp.register_recipe adds one)."""
    wgrad_layers: WgradLayers = "pays"
    """Which Linear layers --wgrad converts: pays (those whose GEMMs gain from FP8 on this GPU;
    none on a device without the format's fast path, e.g. a CPU) or all (every layer the
    recipe can run: a correctness path where it is emulated)."""
    fp8_param_gather: bool = False
    """With --wgrad fp8-tensor and --sharding zero1: all-gather the converted layers' weights
    as FP8 bytes plus one scale each (half a bf16 gather), fp32 masters on their owners."""
    lr: float = 3e-3
    """Peak learning rate (linear warm-up over min(20, steps / 10) steps, then cosine decay to a
    tenth of it at the last step: a torch LambdaLR); with
    --optimizer muon the one lr of Muon and AdamW (Muon's update scaled to AdamW's RMS)."""
    seed: int = 0
    """Seeds the model's initialisation and the order of the data."""
    nproc: int = 2
    """Ranks to launch on this machine (ignored inside torchrun, which sets the world size)."""
    replicas: int = 1
    """Replicas of the job: the ranks form a (replicas, ranks / replicas) DeviceMesh, the
    optimizer is sharded inside each replica (consecutive ranks: one node under torchrun) and
    each owned shard's gradient is all-reduced across replicas (--sharding none all-reduces
    over every rank either way). It changes the communication, not the maths, and must divide
    the rank count; 1: one flat group (no mesh)."""
    device: Device = "cpu"
    """cpu trains on gloo ranks; cuda on NCCL ranks, one GPU each."""
    dtype: Dtype = "fp32"
    """fp32, or bf16 autocast for the forward and backward (params, grads and optimizer state
    stay fp32)."""
    compile: bool | None = None
    """torch.compile the wrapped model (one graph for the forward, one for the backward; the
    wrapper's own forward stays eager). Default (neither flag): on for --device cuda where
    Triton is installed, off on CPU (timings: docs/performance.md); the first step pays a
    compile of tens of seconds. On several GPUs Dynamo splits the graph at bucket boundaries, so
    bucket reductions overlap the backward ([Note: compiled overlap] in
    aligndp/runtime/compiled_overlap.py)."""
    eval_every: int = 100
    """Evaluate on the held-out split every this many steps (0: only at the end)."""
    checkpoint_dir: str | None = None
    """Where checkpoints go (default: OUT/checkpoints)."""
    checkpoint_every: int = 0
    """Also save a checkpoint every this many steps (0: only the final one)."""
    final_checkpoint: bool = True
    """Save a checkpoint when the run ends, and when Ctrl-C stops it (after the step under
    way, on every rank); --no-final-checkpoint: keep only the --checkpoint-every ones."""
    keep_last: int = 0
    """Keep only the newest this many checkpoints (0: keep all)."""
    resume: bool = False
    """Continue the run in --out from its newest complete checkpoint (only a run started with
    the same options; --steps may differ, see --steps)."""
    resume_from: str | None = None
    """Continue from this checkpoint directory (e.g. OUT/checkpoints/step-000040) instead of
    the newest; implies --resume."""
    overwrite: bool = False
    """Replace the run that --out (or --checkpoint-dir) holds; without it a fresh run there
    refuses."""
    out: str = "runs/latest"
    """Directory for run.toml, run.json, metrics.jsonl, loss.png, layout.png and summary.json."""
    log_with: str = ""
    """Also log the metrics.jsonl scalars to these, comma-separated: tensorboard (events in
    OUT/tensorboard; pip install 'aligndp[tensorboard]'), wandb (Weights & Biases, offline
    under OUT/wandb unless WANDB_MODE says otherwise; pip install 'aligndp[wandb]')."""
    data: str | None = None
    """Training text: a text file (bytes) or a nanoGPT-style uint16 .bin file (default: embedded
    synthetic arithmetic)."""
    timeout: float = 300.0
    """Seconds a rank waits for the others in a collective (and in save/load) before the run
    fails; raise it when writing a checkpoint takes longer."""

    def __post_init__(self) -> None:
        if self.preset not in PRESETS:
            raise ValueError(f"unknown preset {self.preset!r}: choose one of {', '.join(PRESETS)}")
        for name, lowest in (
            ("steps", 1),
            ("batch_size", 1),
            ("micro_batches", 1),
            ("nproc", 1),
            ("replicas", 1),
            ("eval_every", 0),
            ("checkpoint_every", 0),
            ("keep_last", 0),
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < lowest:
                raise ValueError(f"--{_flag(name)} must be an integer >= {lowest}, got {value!r}")
        if not self.lr > 0:
            raise ValueError(f"--lr must be > 0, got {self.lr!r}")
        if not self.timeout > 0:
            raise ValueError(f"--timeout must be > 0 seconds, got {self.timeout!r}")
        if self.resume_from is not None:
            object.__setattr__(self, "resume", True)  # frozen: set once, while being built
        if self.resume and self.overwrite:
            raise ValueError(
                "--resume continues the run in --out and --overwrite replaces it: pass one of them"
            )
        unknown = [name for name in self.loggers if name not in LOGGERS]
        if unknown:
            raise ValueError(
                f"--log-with {self.log_with!r}: {', '.join(map(repr, unknown))} is not one of "
                f"{', '.join(LOGGERS)}; give a comma-separated list, e.g. --log-with tensorboard"
            )
        hints = typing.get_type_hints(TrainConfig)
        for field in dataclasses.fields(self):
            choices = _choices(field.name, hints[field.name])
            if choices and getattr(self, field.name) not in choices:
                raise ValueError(
                    f"--{_flag(field.name)} {getattr(self, field.name)!r} is not one of "
                    f"{', '.join(choices)}"
                )
        check_replicas(
            self.replicas,
            self.nproc,
            ranks=f"the {self.nproc} ranks (--nproc, or torchrun's world size)",
        )
        parts = self.nproc * self.micro_batches
        if self.batch_size % parts:
            raise ValueError(
                f"--batch-size {self.batch_size} does not split into --nproc {self.nproc} ranks x "
                f"--micro-batches {self.micro_batches} = {parts} equal parts; use a multiple of "
                f"{parts}, e.g. --batch-size {-(-self.batch_size // parts) * parts}"
            )

    @property
    def checkpoint_path(self) -> str:
        return self.checkpoint_dir or os.path.join(self.out, "checkpoints")

    @property
    def loggers(self) -> tuple[str, ...]:
        """``--log-with`` as names, in order, without repeats."""
        names = (name.strip() for name in self.log_with.split(","))
        return tuple(dict.fromkeys(name for name in names if name))


def _flag(name: str) -> str:
    return name.replace("_", "-")


def _recipe_names() -> list[str]:
    from aligndp.lowp.recipes import recipe_names  # imports torch: only when a config is built

    return recipe_names()


RUNTIME_CHOICES = {"wgrad": _recipe_names}
"""Fields whose choices are read when a config is built, not at import nor in the parser: a
recipe registered at runtime (``aligndp.register_recipe``) is a valid ``--wgrad``, as it is for
``parallelize`` and ``aligndp layout``."""


def _choices(name: str, hint: object) -> tuple[str, ...]:
    if name in RUNTIME_CHOICES:
        return tuple(RUNTIME_CHOICES[name]())
    return typing.get_args(hint) if typing.get_origin(hint) is Literal else ()


def _field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a dataclass, read from its source."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return {}
    body = tree.body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


METAVARS = {"resume_from": "CHECKPOINT", "log_with": "NAME[,NAME]", "data": "FILE"}
"""Flags whose value reads better under another name than the field's."""


def _help(name: str, docs: dict[str, str]) -> str:
    text = docs.get(name, "")
    return text.replace("{presets}", describe_presets()) if name == "preset" else text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per :class:`TrainConfig` field (``--batch-size`` for ``batch_size``; a field
    that defaults to True gets ``--no-...``), and ``--config``.

    Every flag defaults to "not given" (argparse.SUPPRESS): :func:`config_from_args` lays the
    given ones over ``--config``'s values over the field defaults."""
    hints = typing.get_type_hints(TrainConfig)
    docs = _field_docs(TrainConfig)
    parser.add_argument(
        "--config",
        metavar="TOML",
        help="Read the options from this TOML file: one key per flag, written as the field "
        "(batch_size = 32) or the flag (batch-size = 32), as in the run.toml every run writes "
        "into --out; flags given beside it override it.",
    )
    for field in dataclasses.fields(TrainConfig):
        hint, flag, help_text = hints[field.name], "--" + _flag(field.name), _help(field.name, docs)
        common = {"dest": field.name, "default": argparse.SUPPRESS, "help": help_text}
        if hint is bool:
            if field.default:
                parser.add_argument("--no-" + _flag(field.name), action="store_false", **common)
            else:
                parser.add_argument(flag, action="store_true", **common)
            continue
        if hint == bool | None:  # --flag / --no-flag, neither: the field's default (None)
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, **common)
            continue
        choices = () if field.name in RUNTIME_CHOICES else _choices(field.name, hint)
        default = "" if field.default in (None, "") else f" (default: {field.default})"
        parser.add_argument(
            flag,
            type=field_type(hint),
            choices=choices or None,
            metavar=None if choices else METAVARS.get(field.name, field.name.upper()),
            **{**common, "help": help_text + default},
        )


def config_from_args(args: argparse.Namespace, *, world_size: int | None = None) -> TrainConfig:
    """The config the flags give, over ``--config``'s file, over the defaults; ``world_size``:
    torchrun's, which replaces ``--nproc`` before the checks that depend on the rank count
    (batch split, ``--replicas``) run."""
    values = read_toml(args.config, TrainConfig) if getattr(args, "config", None) else {}
    names = [f.name for f in dataclasses.fields(TrainConfig)]
    values.update({name: getattr(args, name) for name in names if hasattr(args, name)})
    if world_size is not None:
        values["nproc"] = world_size
    return TrainConfig(**values)


def check_replicas(replicas: int, world_size: int, *, ranks: str) -> None:
    """Refuse (one-line ValueError) a ``--replicas`` that does not split ``world_size`` ranks,
    called ``ranks`` in the message, into equal replicas, naming the counts that would."""
    if replicas >= 1 and world_size % replicas == 0:
        return
    divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
    raise ValueError(
        f"--replicas {replicas} does not split {ranks} into equal replicas; use one of "
        f"{', '.join(map(str, divisors))}"
    )


def describe_mesh(replicas: int, world_size: int) -> str:
    """``" (2 replicas x 2 shards)"`` for 4 ranks in 2 replicas, to follow a rank count;
    ``""`` for one replica (the flat group, whose output stays as it was)."""
    if replicas == 1:
        return ""
    shards = world_size // replicas
    return f" ({replicas} replicas x {shards} shard{'s' if shards > 1 else ''})"


def compile_blocker(device: str) -> str | None:
    """Why ``torch.compile``'s default backend (inductor) cannot build kernels on ``device``
    (Triton on CUDA, a C++ compiler on CPU), or None."""
    import importlib.util
    import shutil

    if device == "cuda":
        if importlib.util.find_spec("triton") is None:
            return "torch.compile on CUDA needs Triton, which is not installed"
    elif not any(shutil.which(cxx) for cxx in ("c++", "g++", "clang++")):
        return "torch.compile on CPU needs a C++ compiler (c++, g++ or clang++) on PATH"
    return None


def compiles(config: TrainConfig) -> bool:
    """Whether the run compiles its model: ``--compile`` / ``--no-compile``, else on CUDA where
    it can (TrainConfig.compile)."""
    if config.compile is not None:
        return config.compile
    return config.device == "cuda" and compile_blocker("cuda") is None
