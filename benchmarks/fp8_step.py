"""FP8 training steps against the peers a user would pick instead, one GPU, one process (issue 23).

Variants (``--variants``, comma-separated; ``+compile`` = ``torch.compile`` of the model):
``bf16`` / ``bf16+compile`` (plain torch, fused AdamW), ``aligndp`` / ``aligndp+compile``
(bf16 through ``aligndp.parallelize`` with no FP8 layer: the data-parallel runtime's own share
of an FP8 variant's time), ``torchao+compile`` (torchao float8
tensorwise with its own auto layer filter, when torchao is importable), and every aligndp recipe
``fp8-tensor``, ``fp8``, ``mxfp8``, eager and ``+compile``, each converting the layers its default
rule picks ([Note: layers that pay]; ``--layers all`` converts every layer it can run, and a
variant written ``fp8-tensor:all+compile`` sets it for that variant alone); ``+nocache``
quantises a recipe's weights in every forward ([Note: weights once per step] off), which with
``--grad-accum 4`` shows what quantising them once per step saves. A recipe
that converts no layer on this GPU is reported, not timed (its step is the bf16 step).
All variants use aligndp's GPT preset, bf16 autocast, fp32 params; the aligndp ones go through
``aligndp.parallelize`` (fused wgrad into the grad buffer, AdamW).

Variants are built one at a time (a 1b model with AdamW state is ~15 GB): each is built,
warmed (compiled) and timed for ``--rounds`` x ``--steps`` steps, in ``--passes`` passes over
the variants in alternating order (default 1, to stay well inside 5 minutes at 1b; ``--passes
2`` adds the reverse order); the figure is the best pass's median round.
Usage: ``python benchmarks/fp8_step.py --preset gpt2-small`` (and ``--preset 1b``);
``--smoke`` runs a CPU smoke test (demo preset, aot_eager, every layer) CI can afford.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import json
import statistics
import time
import warnings

import torch
import torch.distributed as dist
from _bench import build_gpt

import aligndp
from aligndp.lowp import convert_to_mxfp8
from aligndp.lowp.layer_rule import describe_plan
from aligndp.lowp.linear import conversion_plan
from aligndp.lowp.recipes import get_recipe
from aligndp.models.gpt import PRESETS

RECIPES = ("fp8-tensor", "fp8", "mxfp8")
DEFAULT_VARIANTS = "bf16,bf16+compile,aligndp,aligndp+compile,torchao+compile," + ",".join(
    f"{r}{c}" for r in RECIPES for c in ("", "+compile")
)


SMOKE_VARIANTS = "bf16,bf16+compile,fp8-tensor,fp8-tensor+compile,mxfp8"


@dataclasses.dataclass
class Result:
    """One variant's figures over the passes."""

    ms: list[float] = dataclasses.field(default_factory=list)
    """Median ms per step of each pass."""
    loss: float | None = None
    """The last timed step's loss; None (not NaN) when no step finished: FAILED, not timed."""
    nonfinite: str = ""
    """``step k of n`` (warm-up counted) where the loss first was not finite."""
    peak_gib: float = 0.0
    note: str = ""
    """Why it was not timed, or what it converted."""
    converted: str = ""
    """``k/n`` Linear layers converted (aligndp recipes)."""
    host_ms: list[float] = dataclasses.field(default_factory=list)
    """Median ms per step the host took to issue the steps (before the closing sync): near
    ``ms`` when the step is host-bound."""
    profile: dict = dataclasses.field(default_factory=dict)
    """``--profile``: wall ms and per-kernel GPU ms per step (benchmarks/profile_ddp.py)."""

    @property
    def best(self) -> float:
        return min(self.ms) if self.ms else float("nan")


def torchao_available() -> bool:
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        return False
    return True


def build(variant: str, args, device: torch.device):
    """(model, optimizer, note) for ``variant``; model None with a note when it is not timed."""
    kind, *flags = variant.split("+")
    if not set(flags) <= {"compile", "nocache"}:
        raise SystemExit(f"variant {variant!r}: the suffixes are +compile and +nocache")
    kind, _, layers = kind.partition(":")  # fp8-tensor:all+compile: this variant's --layers
    layers = layers or args.layers
    module = build_gpt(args.preset, device, torch.float32)
    fused = device.type == "cuda"
    note = ""
    if kind == "bf16":
        model, opt = module, torch.optim.AdamW(module.parameters(), lr=3e-4, fused=fused)
    elif kind == "aligndp":  # bf16 through aligndp.parallelize, no FP8: the runtime's share
        model, opt = aligndp.parallelize(
            module, optimizer="adamw", lr=3e-4, process_group=args.process_group
        )
    elif kind == "torchao":
        if not torchao_available():
            return None, None, "torchao is not importable"
        from torchao.float8 import _auto_filter_for_recipe, convert_to_float8_training

        convert_to_float8_training(
            module, module_filter_fn=_auto_filter_for_recipe("tensorwise", ["head"])
        )
        model, opt = module, torch.optim.AdamW(module.parameters(), lr=3e-4, fused=fused)
        note = "torchao auto filter (tensorwise), head kept"
    elif kind in RECIPES:
        recipe = get_recipe(kind)
        backend = recipe.default_backend(device.type)
        if backend is None:
            return None, None, f"no {kind} backend on {device.type}"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the no-fast-path warning: the note says it
            plan = conversion_plan(module, recipe, layers=layers)
        note = describe_plan(kind, plan)
        if all(why for _, why in plan):
            return None, None, note
        note = f"{sum(not why for _, why in plan)}/{len(plan)}|{note}"
        # +nocache: [Note: weights once per step] off, a weight quantise per forward
        convert_to_mxfp8(
            module, backend=backend.name, layers=layers, cache_weight="nocache" not in flags
        )
        model, opt = aligndp.parallelize(
            module, optimizer="adamw", lr=3e-4, wgrad=kind, process_group=args.process_group
        )
    else:
        raise SystemExit(f"unknown variant {variant!r}: choose from {DEFAULT_VARIANTS}")
    if "compile" in flags:
        model = torch.compile(model, backend=args.compile_backend)
    return model, opt, note


def step(model, opt, x, y, device_type: str, accum: int = 1) -> torch.Tensor:
    """One optimizer step over ``x``, ``y`` in ``accum`` micro-batches (all but the last under
    ``no_sync`` where the model has it: aligndp's, also through torch.compile)."""
    total = 0.0
    for i, (xm, ym) in enumerate(zip(x.chunk(accum), y.chunk(accum))):
        last = i == accum - 1
        quiet = getattr(model, "no_sync", None)
        with contextlib.nullcontext() if last or quiet is None else quiet():
            with torch.autocast(device_type, dtype=torch.bfloat16):
                loss = model(xm, ym) / accum
            loss.backward()
        total = total + loss.detach()
    opt.step()
    opt.zero_grad()
    return total


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_variant(variant: str, args, device: torch.device, result: Result) -> None:
    cfg = PRESETS[args.preset]
    gen = torch.Generator().manual_seed(0)

    def batch():
        return torch.randint(cfg.vocab_size, (2, args.batch, cfg.seq_len), generator=gen).to(device)

    model, opt, note = build(variant, args, device)
    result.converted, _, result.note = note.rpartition("|")
    if model is None:
        return
    losses = []  # every step's loss, on the device: no host sync until the end
    for _ in range(args.warmup):
        losses.append(step(model, opt, *batch(), device.type, args.grad_accum))
    sync(device)
    rounds, issued = [], []
    for _ in range(args.rounds):
        xs = [batch() for _ in range(args.steps)]
        sync(device)
        t0 = time.perf_counter()
        for x, y in xs:
            losses.append(loss := step(model, opt, x, y, device.type, args.grad_accum))
        issued.append((time.perf_counter() - t0) / args.steps * 1e3)
        sync(device)
        rounds.append((time.perf_counter() - t0) / args.steps * 1e3)
    result.ms.append(statistics.median(rounds))
    result.host_ms.append(statistics.median(issued))
    if args.profile and device.type == "cuda" and variant not in result.profile:
        from profile_ddp import profile_steps

        xs = iter([batch() for _ in range(4)])
        result.profile = profile_steps(
            lambda: step(model, opt, *next(xs), "cuda", args.grad_accum), steps=3, warmup=1
        )
    result.loss = loss.item()
    if len(bad := torch.stack(losses).isfinite().logical_not().nonzero()) and not result.nonfinite:
        result.nonfinite = f"step {bad[0].item()} of {len(losses)}"
    if device.type == "cuda":
        result.peak_gib = torch.cuda.max_memory_allocated(device) / 2**30


def free(device: torch.device) -> None:
    gc.collect()
    torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def run(args) -> dict[str, Result]:
    device = torch.device(args.device)
    variants = args.variants.split(",")
    results = {v: Result() for v in variants}
    for p in range(args.passes):
        for v in variants if p % 2 == 0 else variants[::-1]:
            t0 = time.perf_counter()
            try:
                time_variant(v, args, device, results[v])
            except Exception as e:  # one variant failing must not lose the others' figures
                results[v].note = f"FAILED {type(e).__name__}: {str(e).splitlines()[0][:200]}"
            free(device)
            r = results[v]
            print(
                f"pass {p} {v}: {r.ms[-1:] or '-'} ms ({time.perf_counter() - t0:.0f} s) {r.note}",
                flush=True,
            )
    return results


def loss_cell(r: Result) -> str:
    """The loss cell: ``-`` when no step finished, and where a non-finite loss began."""
    if r.loss is None:
        return "-"
    return f"{r.loss:.3f}" + (f" (not finite from {r.nonfinite})" if r.nonfinite else "")


def table(args, results: dict[str, Result]) -> list[str]:
    def ratio(v: str, base: str) -> str:
        b = results.get(base)
        if b is None or not b.ms or not results[v].ms:
            return "-"
        return f"{results[v].best / b.best:.3f}"

    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    cfg = PRESETS[args.preset]
    rows = [
        f"# fp8_step {args.preset} {datetime.date.today()} on {name}, torch {torch.__version__}",
        "",
        f"batch {args.batch} x {cfg.seq_len} tokens in {args.grad_accum} micro-batches, "
        "bf16 autocast, fp32 params, AdamW, 1 process; "
        f"best of {args.passes} passes of the median of {args.rounds} rounds x {args.steps} steps; "
        f"layers: {args.layers}",
        "",
        "| variant | ms/step | host ms/step | / bf16 eager | / bf16+compile | / torchao+compile "
        "| loss | peak GiB | FP8 layers |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for v, r in results.items():
        rows.append(
            f"| {v} | {r.best:.1f} | {min(r.host_ms, default=float('nan')):.1f} | "
            f"{ratio(v, 'bf16')} | {ratio(v, 'bf16+compile')} | "
            f"{ratio(v, 'torchao+compile')} | {loss_cell(r)} | {r.peak_gib:.1f} | "
            f"{r.converted or ('-' if r.ms else 'not timed')} |"
        )
    notes = dict.fromkeys(
        f"- {v.partition('+')[0]}: {r.note}" for v, r in results.items() if r.note
    )
    return rows + ["", *notes]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="gpt2-small", choices=sorted(PRESETS))
    ap.add_argument("--variants", default=DEFAULT_VARIANTS)
    ap.add_argument("--layers", default="pays", choices=["pays", "all"])
    ap.add_argument("--batch", type=int, default=8, help="sequences per step")
    ap.add_argument(
        "--grad-accum",
        type=int,
        default=1,
        help="micro-batches per step (--batch split evenly; aligndp variants under no_sync but "
        "the last): shows the weight quantised once per step ([Note: weights once per step]); "
        "compare a recipe with its +nocache variant",
    )
    ap.add_argument(
        "--passes",
        type=int,
        default=1,
        help="passes over the variants, alternating order (each rebuilds and recompiles, from "
        "Inductor's cache after the first; 1 keeps a 1b run near 3 minutes on H200)",
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--compile-backend", default="inductor")
    ap.add_argument("--out", default="", help="also write the table to this file")
    ap.add_argument(
        "--profile",
        default="",
        metavar="JSON",
        help="CUDA only: also profile 3 steps of each variant after its first timing and write "
        "wall ms, GPU ms per kernel class and per kernel to this file (adds seconds, not minutes)",
    )
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="CPU smoke run: demo preset, batch 2, aot_eager, every layer, 1 pass of 1 x 2 steps",
    )
    args = ap.parse_args(argv)
    if args.grad_accum < 1 or args.batch % args.grad_accum:
        raise SystemExit(
            f"--grad-accum {args.grad_accum} must be >= 1 and divide --batch {args.batch}"
        )
    args.process_group = None
    if args.smoke:
        args.device, args.preset, args.batch, args.layers = "cpu", "demo", 2, "all"
        args.compile_backend, args.passes, args.rounds, args.steps = "aot_eager", 1, 1, 2
        args.warmup = 1
        if args.variants == DEFAULT_VARIANTS:  # mxfp8+compile: tests/test_mx_compile.py
            args.variants = SMOKE_VARIANTS
    return args


def main(argv=None) -> dict[str, Result]:
    args = parse_args(argv)
    if args.smoke:
        torch.set_num_threads(1)
    backend = "nccl" if args.device == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        results = run(args)
    finally:
        dist.destroy_process_group()
    rows = table(args, results)
    print("\n".join(rows), flush=True)
    if args.profile:
        with open(args.profile, "w") as f:
            json.dump({v: r.profile for v, r in results.items() if r.profile}, f, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(rows) + "\n")
    return results


if __name__ == "__main__":
    main()
