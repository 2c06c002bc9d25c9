"""Where FP8 pays, per layer: one Linear's forward + backward in bf16 against each FP8 recipe.

For ``M`` tokens (default 8192 = gpt2-small's and 1b's batch 8 x 1024) and every distinct
``(in, out)`` of the presets' block Linears (qkv, proj, fc, out), times ``y = layer(x)`` and
``y.backward(dy)`` under bf16 autocast with an fp32 weight (as ``benchmarks/fp8_step.py``
trains), eager and ``torch.compile``-d, in bf16 (``nn.Linear``) and as each recipe's
``MXLinear`` (its CUDA backend, wgrad into ``weight.grad``). Prints ms per fwd+bwd and the
ratio to bf16 of the same mode; [Note: layers that pay] in aligndp/lowp/layer_rule.py takes
its default rule from these ratios.

Usage: ``python benchmarks/fp8_layer_sweep.py [--tokens 8192] [--presets gpt2-small,1b]
[--recipes fp8-tensor,fp8] [--out f.md]``.
"""

from __future__ import annotations

import argparse
import datetime

import torch
import torch.nn as nn

from aligndp.lowp.linear import MXLinear
from aligndp.lowp.recipes import get_recipe
from aligndp.models.gpt import PRESETS


def shapes(presets: list[str]) -> list[tuple[int, int]]:
    """Distinct ``(in, out)`` of the presets' block Linears, in order."""
    out: dict[tuple[int, int], None] = {}
    for name in presets:
        d, r = PRESETS[name].dim, PRESETS[name].mlp_ratio
        for shape in ((d, 3 * d), (d, d), (d, r * d), (r * d, d)):
            out[shape] = None
    return list(out)


def layer(kind: str, k: int, n: int) -> nn.Module:
    torch.manual_seed(0)
    lin = nn.Linear(k, n, device="cuda")
    if kind == "bf16":
        return lin
    backend = get_recipe(kind).default_backend("cuda")
    return MXLinear.from_linear(lin, backend=backend.name)


def time_ms(mod: nn.Module, x: torch.Tensor, dy: torch.Tensor, iters: int) -> float:
    """ms per fwd+bwd: ``iters`` issued back to back between two CUDA events (the host runs
    ahead as in a training step, so this is the slower of host and GPU), after 3 warm-ups."""

    def once():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = mod(x)
        y.backward(dy)
        for p in mod.parameters():
            p.grad = None

    for _ in range(3):
        once()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        once()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def main(argv=None) -> list[str]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--presets", default="gpt2-small,1b")
    ap.add_argument("--recipes", default="fp8-tensor,fp8")
    ap.add_argument("--modes", default="eager,compile")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    recipes, modes = args.recipes.split(","), args.modes.split(",")
    rows = [
        f"# fp8_layer_sweep {datetime.date.today()} on {torch.cuda.get_device_name()}, "
        f"torch {torch.__version__}",
        "",
        f"M = {args.tokens} tokens, Linear fwd+bwd, bf16 autocast, fp32 weight, {args.iters} "
        "back to back; ratio = recipe ms / bf16 ms of the same mode",
        "",
        "| in | out | mode | bf16 ms | "
        + " | ".join(f"{r} ms | {r} / bf16" for r in recipes)
        + " |",
        "| --- | --- | --- | --- |" + " --- | --- |" * len(recipes),
    ]
    print("\n".join(rows), flush=True)
    for k, n in shapes(args.presets.split(",")):
        x = torch.randn(args.tokens, k, device="cuda", requires_grad=True)
        dy = torch.randn(args.tokens, n, device="cuda", dtype=torch.bfloat16)
        for mode in modes:
            ms = {}
            for kind in ["bf16", *recipes]:
                mod = layer(kind, k, n)
                if mode == "compile":
                    torch._dynamo.reset()
                    mod = torch.compile(mod)
                ms[kind] = time_ms(mod, x, dy, args.iters)
            cells = " | ".join(f"{ms[r]:.3f} | {ms[r] / ms['bf16']:.2f}" for r in recipes)
            rows.append(f"| {k} | {n} | {mode} | {ms['bf16']:.3f} | {cells} |")
            print(rows[-1], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(rows) + "\n")
    return rows


if __name__ == "__main__":
    main()
