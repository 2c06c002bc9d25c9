"""`aligndp layout`: plan and show the flat buffer layout of a model, without building it.

A preset model is built on the meta device, so even the 1B preset costs no memory; only
the shapes of its trainable params reach the planner. Use it to see what padding a sharding
costs and where each param lands before a run, e.g.::

    python -m aligndp layout --preset 1b --nproc 8 --sharding zero1 --optimizer muon \
        --wgrad mxfp8 --png layout.png

The flags (``layout_args.py``) are ``aligndp train``'s where they mean the same thing.
``--replicas R`` plans as ``aligndp train --replicas R`` runs: ``--nproc`` stays the job's rank
count and the buffers are planned for one replica's ``--nproc / R`` ranks (the shard group of
[Note: replicate x shard mesh]); every replica holds that layout.

[Note: one plan request] (aligndp/plan/request.py): the command builds its request with
:func:`aligndp.parallelize.plan_request`, the function ``parallelize()`` builds the run's
with, and plans it with the same :func:`~aligndp.plan.request.plan_buffers` the
data-parallel wrapper calls. ``--optimizer muon`` (any registered whole-matrix optimizer)
with ``--sharding zero1`` puts its matrices in a layer-wise buffer, owners balanced by its cost,
and everything else in a ZeRO-1 sharded buffer.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

import torch
import torch.nn as nn

from aligndp.app.layout_args import add_arguments  # noqa: F401  (the flags, torch-free)
from aligndp.app.train_config import check_replicas, describe_mesh
from aligndp.lowp.recipes import recipe_names
from aligndp.optim.registry import whole_matrix_spec
from aligndp.parallelize import plan_request
from aligndp.plan.request import PlanRequest, plan_buffers
from aligndp.plan.slots import BufferLayout, padding_totals
from aligndp.plan.spec import (
    DEFAULT_BUCKET_NUMEL,
    DEFAULT_START_ALIGNMENT,
    Mode,
    ParamSpec,
    check_bucket_numel,
    max_over_mean,
)

__all__ = [
    "run",
    "preset_model",
    "preset_specs",
    "parse_shapes",
    "shapes_model",
    "LayoutOptions",
]

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


@dataclasses.dataclass(frozen=True)
class LayoutOptions:
    """Everything ``aligndp layout`` plans from; checked in ``__post_init__``."""

    model: nn.Module
    """The params to plan, on the meta device (a preset or ``--shapes``), in the param dtype."""
    dp_size: int = 1
    """Data-parallel ranks of the job (the world size, every replica's ranks)."""
    replicas: int = 1
    """Replicas the ranks form ([Note: replicate x shard mesh]): buffers are sharded over
    ``dp_size / replicas`` ranks, the same layout in every replica."""
    mode: Mode = Mode.REPLICATED
    """replicated: ``sharding="none"``; sharded / layerwise: ``sharding="zero1"`` (layerwise
    without a whole-matrix optimizer: every param in a layer-wise buffer)."""
    optimizer: str = "adamw"
    """``adamw`` or a registered whole-matrix optimizer (``muon``), as ``parallelize`` takes."""
    wgrad: str = "none"
    """Wgrad recipe (see :func:`aligndp.lowp.recipes.wgrad_requirements`)."""
    bucket_numel: int | None = DEFAULT_BUCKET_NUMEL
    """Elements per bucket, as parallelize(bucket_numel=); None: one bucket."""
    grad_dtype: torch.dtype | None = None
    """Grad buffer dtype; None: each buffer's param dtype."""
    start_alignment: int = DEFAULT_START_ALIGNMENT
    """Requested param start alignment (elements); the planner raises it to every requirement's."""
    capability: tuple[int, int] | None = (9, 0)
    """GPU compute capability the wgrad recipe's layer rule is judged for (None: a CPU)."""

    def __post_init__(self) -> None:
        whole = whole_matrix_spec(self.optimizer) is not None
        if whole and self.mode is Mode.SHARDED:
            raise ValueError(
                f"{self.optimizer} steps whole matrices, which ZeRO-1's slices cut apart: use "
                "a layer-wise buffer (sharding='zero1') or replicated ones (sharding='none')"
            )
        if self.dp_size < 1:
            raise ValueError(f"--nproc must be >= 1, got {self.dp_size}")
        check_replicas(
            self.replicas, self.dp_size, ranks=f"--nproc {self.dp_size} ranks (the world size)"
        )
        check_bucket_numel(self.bucket_numel, flag="--bucket-numel")

    def request(self) -> PlanRequest:
        """The request ``parallelize`` builds for these settings (one function makes both)."""
        request, _ = plan_request(
            self.model,
            optimizer=self.optimizer,
            sharding="none" if self.mode is Mode.REPLICATED else "zero1",
            dp_size=self.shard_size,
            bucket_numel=self.bucket_numel,
            wgrad=self.wgrad,
            grad_dtype=self.grad_dtype,
            start_alignment=self.start_alignment,
        )
        if self.mode is Mode.LAYERWISE and whole_matrix_spec(self.optimizer) is None:
            request = dataclasses.replace(request, mode=Mode.LAYERWISE, modes={})
        return request

    @property
    def shard_size(self) -> int:
        """Ranks one replica shards over: the plan's ``dp_size``, as the run's shard group."""
        return self.dp_size // self.replicas

    def plan(self) -> list[BufferLayout]:
        return plan_buffers(self.request())

    def conversion(self) -> str:
        """Which Linear layers ``aligndp train --wgrad`` converts on this GPU ("" when the
        recipe converts none or the model has no Linear)."""
        from aligndp.lowp.layer_rule import describe_plan
        from aligndp.lowp.linear import conversion_plan
        from aligndp.lowp.recipes import get_recipe

        if not get_recipe(self.wgrad).backends:
            return ""
        plan = conversion_plan(self.model, self.wgrad, capability=self.capability)
        return describe_plan(self.wgrad, plan) if plan else ""


def preset_model(name: str) -> torch.nn.Module:
    """A GPT preset built on the meta device (no memory)."""
    from aligndp.models.gpt import GPT, PRESETS

    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}: choose one of {', '.join(PRESETS)}")
    with torch.device("meta"):
        return GPT(PRESETS[name])


def preset_specs(name: str, *, dtype: torch.dtype = torch.float32) -> list[ParamSpec]:
    """Specs of a GPT preset's trainable params, built on the meta device (no memory).

    ``named_parameters`` yields a tied head once (under the embedding's name), exactly as the
    buffer will hold it.
    """
    model = preset_model(name)
    return [
        dataclasses.replace(s, dtype=dtype)
        for s in ParamSpec.from_named_parameters(model.named_parameters())
    ]


def parse_shapes(text: str, *, dtype: torch.dtype = torch.float32) -> list[ParamSpec]:
    """``"768x2304,2304"`` -> specs ``p0`` (768, 2304) and ``p1`` (2304,), in that order."""
    specs = []
    for i, item in enumerate(text.split(",")):
        dims = item.strip().split("x")
        if not item.strip() or not all(d.strip().isdigit() for d in dims):
            raise ValueError(
                f"--shapes item {i} is {item.strip()!r}, not a shape: write positive integers "
                "joined by 'x', "
                "e.g. --shapes 768x2304,2304"
            )
        specs.append(ParamSpec(f"p{i}", tuple(int(d) for d in dims), dtype))
    return specs


def shapes_model(specs: list[ParamSpec]) -> nn.Module:
    """A module on the meta device holding one param per spec (``p0``, ``p1``, ...), in order:
    bare shapes carry no module types, so every 2-D one routes as a hidden matrix."""
    model = nn.Module()
    for s in specs:
        param = nn.Parameter(torch.empty(s.shape, dtype=s.dtype, device="meta"))
        model.register_parameter(s.name, param)
    return model


def _mode(sharding: str, optimizer: str) -> Mode:
    """The buffer mode ``parallelize(sharding=, optimizer=)`` builds (a whole-matrix optimizer's
    matrices under ZeRO-1 go to a layer-wise buffer, the rest to a sharded one)."""
    if sharding == "none":
        return Mode.REPLICATED
    return Mode.SHARDED if whole_matrix_spec(optimizer) is None else Mode.LAYERWISE


def _options(args: argparse.Namespace) -> LayoutOptions:
    if args.preset is not None and args.shapes is not None:
        raise ValueError("give one of --preset or --shapes (both given), e.g. --preset gpt2-small")
    if args.preset is None and args.shapes is None:
        args = argparse.Namespace(**{**vars(args), "preset": "demo"})
    if args.wgrad not in recipe_names():
        raise ValueError(f"--wgrad {args.wgrad!r} is not one of {', '.join(recipe_names())}")
    dtype = DTYPES[args.dtype]
    if args.preset:
        model = preset_model(args.preset).to(dtype)
    else:
        model = shapes_model(parse_shapes(args.shapes, dtype=dtype))
    return LayoutOptions(
        model=model,
        dp_size=args.nproc,
        replicas=args.replicas,
        mode=_mode(args.sharding, args.optimizer),
        optimizer=args.optimizer,
        wgrad=args.wgrad,
        bucket_numel=DEFAULT_BUCKET_NUMEL if args.bucket_numel is None else args.bucket_numel,
        grad_dtype=DTYPES[args.grad_dtype] if args.grad_dtype else None,
        start_alignment=(
            DEFAULT_START_ALIGNMENT if args.start_alignment is None else args.start_alignment
        ),
        capability=_capability(args.capability),
    )


def _capability(text: str) -> tuple[int, int] | None:
    if text == "cpu":
        return None
    major, dot, minor = text.partition(".")
    if not (dot and major.isdigit() and minor.isdigit()):
        raise ValueError(f"--capability {text!r}: write major.minor (e.g. 9.0) or cpu")
    return int(major), int(minor)


def summary(layout: BufferLayout, *, asked_alignment: int, ns: bool = False) -> str:
    """Lines under the table: alignment (and who raised it) and, in layerwise mode, per-rank
    load, its imbalance (``ns``: the owner cost is Muon's Newton–Schulz) and the split
    matrices as ``rank:columns`` per part ([Note: split Newton–Schulz] in plan/split.py)."""
    lines = []
    if layout.start_alignment != asked_alignment:
        itemsizes = {layout.grad_dtype.itemsize, layout.param_dtype.itemsize}
        raisers = [
            f"{r.rule}: {max(r.start_alignment(i) for i in itemsizes)}"
            for r in layout.requirements
            if max(r.start_alignment(i) for i in itemsizes) > asked_alignment
        ]
        lines.append(
            f"  start alignment: asked {asked_alignment}, effective {layout.start_alignment} "
            f"elements (raised by {', '.join(raisers) or 'the requirements'})"
        )
    if layout.mode is Mode.LAYERWISE:
        costs, numels = layout.rank_costs(), layout.rank_numels()
        lines.append(f"  {'rank':>4}  {'owner cost':>18}  {'owned numel':>14}")
        for rank, (cost, numel) in enumerate(zip(costs, numels)):
            lines.append(f"  {rank:>4}  {cost:>18.4g}  {numel:>14,}")
        what = "NS imbalance max/mean" if ns else "owner cost imbalance max/mean"
        lines.append(
            f"  {what} {max_over_mean(costs):.4f} (numel {max_over_mean(numels):.4f}), "
            f"{len(layout.splits)} matrices split"
        )
        lines += [f"    {p.name} {'x'.join(map(str, p.shape))}: {p.split}" for p in layout.splits]
    return "\n".join(lines)


def replicas_line(layouts: list[BufferLayout], replicas: int) -> str:
    """What a mesh adds: the plan above is each replica's (identical in all of them), and each
    rank all-reduces its owned shards across the replicas once per step."""
    shard = layouts[0].dp_size if layouts else 1
    owned = sum(
        sum(b.end - b.start for b in lo.buckets) // lo.dp_size * lo.grad_dtype.itemsize
        for lo in layouts
        if lo.mode is not Mode.REPLICATED
    )
    return (
        f"mesh: {shard * replicas} ranks{describe_mesh(replicas, shard * replicas)}: every "
        f"replica holds the plan above, made for its {shard} ranks (its shard group); each rank "
        f"all-reduces {owned:,} bytes of owned shards across the replicas per step"
    )


def _png_path(path: str) -> str:
    """The file ``--png`` writes (matplotlib adds ``.png`` to a name without a suffix), checked
    before planning so that a bad path is one line, not a traceback after the work."""
    if os.path.isdir(path):
        raise ValueError(
            f"--png {path} is a directory; give a file name, e.g. --png "
            f"{os.path.join(path, 'layout.png')}"
        )
    if not os.path.splitext(path)[1]:
        path += ".png"
    parent = os.path.dirname(path) or "."
    if not os.path.isdir(parent):
        raise ValueError(f"--png {path}: the directory {parent} does not exist; create it first")
    return path


def run(args: argparse.Namespace) -> int:
    options = _options(args)
    png = _png_path(args.png) if args.png else None
    layouts = options.plan()
    if args.json:
        mesh = {"replicas": options.replicas, "shards": options.shard_size}
        doc = {"mesh": mesh, "buffers": [layout.to_dict() for layout in layouts]}
        print(json.dumps(doc, allow_nan=False))
    else:
        for layout in layouts:
            print(layout)
            extra = summary(
                layout,
                asked_alignment=options.start_alignment,
                ns=whole_matrix_spec(options.optimizer) is not None,
            )
            if extra:
                print(extra)
        real, padded = padding_totals(layouts)
        percent = 100 * (padded - real) / padded if padded else 0.0
        print(
            f"total: {real:,} real + {padded - real:,} padding = {padded:,} elements "
            f"({percent:.3f}% padding) in {len(layouts)} buffer(s), "
            f"{sum(len(layout.buckets) for layout in layouts)} bucket(s)"
        )
        if options.replicas > 1:
            print(replicas_line(layouts, options.replicas))
        conversion = options.conversion()
        if conversion:
            print(conversion)
    if args.png:
        from aligndp.app.plot import draw_layout

        draw_layout(layouts, png)
        if not args.json:
            print(f"wrote {png}")
    return 0
