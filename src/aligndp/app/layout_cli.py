"""`aligndp layout`: plan and show the flat buffer layout of a model, without building it.

A preset model is built on the meta device, so even the 1B preset costs no memory; only
the shapes of its trainable params reach the planner. Use it to see what padding a mode
costs and where each param lands before a run, e.g.::

    python -m aligndp layout --preset 1b --dp 8 --mode layerwise --wgrad mxfp8 --png layout.png

``--optimizer muon`` plans what ``parallelize(optimizer="muon", ...)`` builds: with
``--mode layerwise`` (that is ``sharding="zero1"``) the Muon matrices go to a layer-wise
buffer and everything else to a ZeRO-1 sharded buffer, through the same
:func:`~aligndp.plan.layout.plan_buffers` the data-parallel wrapper calls.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

import torch

from aligndp.lowp.recipes import WGRAD_RECIPES, wgrad_requirements
from aligndp.plan.layout import (
    DEFAULT_BUCKET_NUMEL,
    DEFAULT_START_ALIGNMENT,
    BufferLayout,
    Mode,
    ParamSpec,
    plan_buffers,
)

__all__ = ["add_arguments", "run", "preset_model", "preset_specs", "parse_shapes", "LayoutOptions"]

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
OPTIMIZERS = ("adamw", "muon")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``aligndp layout``; each maps to one field of :class:`LayoutOptions`."""
    source = parser.add_argument_group("params (give exactly one)")
    source.add_argument(
        "--preset", help="GPT preset from aligndp.models.gpt.PRESETS, e.g. gpt2-small"
    )
    source.add_argument(
        "--shapes",
        help="comma-separated shapes in registration order, e.g. '768x2304,2304,50257x768'",
    )
    parser.add_argument("--dp", type=int, default=1, help="data-parallel size (default 1)")
    parser.add_argument(
        "--mode",
        choices=[m.value for m in Mode],
        default=Mode.REPLICATED.value,
        help="how buffers are reduced and owned (default replicated)",
    )
    parser.add_argument(
        "--optimizer",
        choices=OPTIMIZERS,
        default="adamw",
        help="muon: route hidden matrices to Muon as parallelize() does; with --mode layerwise "
        "they get the layer-wise buffer and the rest a sharded one (default adamw: every "
        "param in --mode)",
    )
    parser.add_argument(
        "--wgrad",
        choices=WGRAD_RECIPES,
        default="none",
        help="fused wgrad recipe whose alignment requirement the layout must meet (default none)",
    )
    parser.add_argument(
        "--bucket-numel",
        type=int,
        default=DEFAULT_BUCKET_NUMEL,
        help=f"elements per bucket (default {DEFAULT_BUCKET_NUMEL:,}, as parallelize() builds)",
    )
    parser.add_argument(
        "--dtype", choices=sorted(DTYPES), default="fp32", help="param dtype (default fp32)"
    )
    parser.add_argument(
        "--grad-dtype",
        choices=sorted(DTYPES),
        default=None,
        help="grad dtype (default: param dtype)",
    )
    parser.add_argument(
        "--start-alignment",
        type=int,
        default=DEFAULT_START_ALIGNMENT,
        help=f"param start alignment in elements (default {DEFAULT_START_ALIGNMENT}); a wgrad "
        "requirement may raise it",
    )
    parser.add_argument(
        "--json", action="store_true", help="print the layouts as JSON instead of a table"
    )
    parser.add_argument("--png", metavar="FILE", help="also draw the layouts into this PNG")


@dataclasses.dataclass(frozen=True)
class LayoutOptions:
    """Everything ``aligndp layout`` plans from; checked in ``__post_init__``."""

    specs: tuple[ParamSpec, ...]
    """Trainable params in registration order (dtype already set to the param dtype)."""
    dp_size: int = 1
    """Data-parallel ranks the buffers are sharded over."""
    mode: Mode = Mode.REPLICATED
    """Reduction/ownership mode of every buffer."""
    wgrad: str = "none"
    """Wgrad recipe (see :func:`aligndp.lowp.recipes.wgrad_requirements`)."""
    bucket_numel: int | None = None
    """Elements per bucket; None: one bucket."""
    grad_dtype: torch.dtype | None = None
    """Grad buffer dtype; None: each buffer's param dtype."""
    start_alignment: int = DEFAULT_START_ALIGNMENT
    """Requested param start alignment (elements); the planner raises it to every requirement's."""
    muon: tuple[str, ...] | None = None
    """Names routed to Muon (``--optimizer muon``); None: no routing, every param in ``mode``."""

    def __post_init__(self) -> None:
        if self.muon is not None and self.mode is Mode.SHARDED:
            raise ValueError(
                "Muon steps whole matrices, which ZeRO-1's slices cut apart: use --mode layerwise "
                "(sharding='zero1' with Muon) or --mode replicated (sharding='none')"
            )
        if self.dp_size < 1:
            raise ValueError(f"--dp must be >= 1, got {self.dp_size}")
        if self.bucket_numel is not None and self.bucket_numel <= 0:
            raise ValueError(
                f"--bucket-numel must be > 0, got {self.bucket_numel}; leave it out for "
                f"parallelize()'s default of {DEFAULT_BUCKET_NUMEL:,} elements"
            )

    def modes(self) -> dict[str, Mode]:
        """Per-param modes as parallelize() assigns them (empty: every param in ``mode``)."""
        if self.muon is None or self.mode is not Mode.LAYERWISE:
            return {}
        return {s.name: Mode.LAYERWISE if s.name in self.muon else Mode.SHARDED for s in self.specs}

    def plan(self) -> list[BufferLayout]:
        return plan_buffers(
            self.specs,
            mode=self.mode,
            modes=self.modes(),
            dp_size=self.dp_size,
            bucket_numel=self.bucket_numel,
            requirements=wgrad_requirements(self.wgrad),
            start_alignment=self.start_alignment,
            grad_dtype=self.grad_dtype,
        )


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
                f"--shapes item {i} is {item.strip()!r}, not a shape: write positive integers joined by 'x', "
                "e.g. --shapes 768x2304,2304"
            )
        specs.append(ParamSpec(f"p{i}", tuple(int(d) for d in dims), dtype))
    return specs


def _options(args: argparse.Namespace) -> LayoutOptions:
    if (args.preset is None) == (args.shapes is None):
        given = "both" if args.preset is not None else "neither"
        raise ValueError(
            f"give exactly one of --preset or --shapes ({given} given), e.g. --preset gpt2-small"
        )
    dtype = DTYPES[args.dtype]
    specs = (
        preset_specs(args.preset, dtype=dtype)
        if args.preset
        else parse_shapes(args.shapes, dtype=dtype)
    )
    muon = None
    if args.optimizer == "muon":
        if args.preset:
            from aligndp.plan.routing import route_params

            muon = route_params(preset_model(args.preset)).muon
        else:  # bare shapes carry no module types: every 2-D shape is a hidden matrix
            muon = tuple(s.name for s in specs if len(s.shape) == 2)
    return LayoutOptions(
        specs=tuple(specs),
        dp_size=args.dp,
        mode=Mode.parse(args.mode),
        wgrad=args.wgrad,
        bucket_numel=args.bucket_numel,
        grad_dtype=DTYPES[args.grad_dtype] if args.grad_dtype else None,
        start_alignment=args.start_alignment,
        muon=muon,
    )


def rank_numels(layout: BufferLayout) -> list[int]:
    """Real elements each rank owns: its shard of every bucket intersected with params."""
    owned = [0] * layout.dp_size
    for b in layout.buckets:
        for rank in range(layout.dp_size):
            lo, hi = layout.shard_range(b.index, rank)
            owned[rank] += sum(
                max(0, min(hi, p.end) - max(lo, p.start)) for p in layout.params_in_bucket(b.index)
            )
    return owned


def _max_over_mean(values: list[float]) -> float:
    mean = sum(values) / len(values)
    return max(values) / mean if mean > 0 else 1.0


def summary(layout: BufferLayout, *, asked_alignment: int) -> str:
    """Lines under the table: alignment (and who raised it) and, in layerwise mode, per-rank load."""
    lines = []
    if layout.start_alignment != asked_alignment:
        itemsizes = {layout.grad_dtype.itemsize, layout.param_dtype.itemsize}
        raisers = [
            f"{r.rule}: {max(r.start_alignment(i) for i in itemsizes)}"
            for r in layout.requirements
            if max(r.start_alignment(i) for i in itemsizes) > asked_alignment
        ]
        lines.append(
            f"  start alignment: asked {asked_alignment}, effective {layout.start_alignment} elements"
            f" (raised by {', '.join(raisers) or 'the requirements'})"
        )
    if layout.mode is Mode.LAYERWISE:
        costs, numels = layout.rank_costs(), rank_numels(layout)
        lines.append(f"  {'rank':>4}  {'Newton–Schulz cost':>18}  {'owned numel':>14}")
        for rank, (cost, numel) in enumerate(zip(costs, numels)):
            lines.append(f"  {rank:>4}  {cost:>18.4g}  {numel:>14,}")
        lines.append(
            f"  imbalance (max/mean): cost {_max_over_mean(costs):.4f}, numel {_max_over_mean(numels):.4f}"
        )
    return "\n".join(lines)


def _png_path(path: str) -> str:
    """The file ``--png`` writes (matplotlib adds ``.png`` to a name without a suffix), checked
    before planning so that a bad path is one line, not a traceback after the work."""
    if os.path.isdir(path):
        raise ValueError(
            f"--png {path} is a directory; give a file name, e.g. --png {os.path.join(path, 'layout.png')}"
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
        print(json.dumps({"buffers": [layout.to_dict() for layout in layouts]}))
    else:
        for layout in layouts:
            print(layout)
            extra = summary(layout, asked_alignment=options.start_alignment)
            if extra:
                print(extra)
        real = sum(layout.numel for layout in layouts)
        padded = sum(layout.padded_numel for layout in layouts)
        percent = 100 * (padded - real) / padded if padded else 0.0
        print(
            f"total: {real:,} real + {padded - real:,} padding = {padded:,} elements ({percent:.3f}% padding) "
            f"in {len(layouts)} buffer(s), {sum(len(layout.buckets) for layout in layouts)} bucket(s)"
        )
    if args.png:
        from aligndp.app.plot import draw_layout

        draw_layout(layouts, png)
        if not args.json:
            print(f"wrote {png}")
    return 0
