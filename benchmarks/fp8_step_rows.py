"""run_all.py's rows of issue 23's goals (benchmarks/fp8_step.py, rank 0's GPU): the 1b
step of each recipe beside torchao float8 + compile and torch bf16, and gpt2-small's step
under every recipe's default layer rule beside torch bf16, eager and compiled."""

from __future__ import annotations

from fp8_step import RECIPES, loss_cell, parse_args, run


def run_all_rows(ctx, group) -> list:
    """run_all.py's rows of issue 23's goals at ``--mx-preset``, rank 0 alone (``group``), one
    pass, 1x128 on every block Linear (its rule converts none at 1b); on CPU (``--smoke``) only
    fp8-tensor compiled by aot_eager on every layer, beside bf16 eager (a smoke test, no figure)."""
    from run_all_table import FP8_ROWS, Goal, Row

    if ctx.args.skip_fp8_step:
        return [Row(key, skipped="--skip-fp8-step") for key in FP8_ROWS]
    cpu = ctx.device.type == "cpu"
    gpu = "bf16,torchao+compile,fp8-tensor+compile,fp8:all+compile"
    variants = ["--variants", "bf16,fp8-tensor+compile", "--smoke"] if cpu else ["--variants", gpu]
    args = parse_args(_argv(ctx, ctx.args.mx_preset) + variants)
    args.process_group = group
    res = run(args)
    base, peer = res["bf16"], res.get("torchao+compile")
    rows = []
    for key, variant, against, goal in (
        ("fp8.tensor_compile.vs_torchao", "fp8-tensor+compile", peer, Goal("<=", 1.0, "ratio")),
        ("fp8.tensor_compile.vs_bf16", "fp8-tensor+compile", base, Goal("<=", 0.80, "ratio")),
        ("fp8.blockwise_compile.vs_bf16", "fp8:all+compile", base, Goal("<=", 0.85, "ratio")),
    ):
        r = res.get(variant)
        if cpu:  # the path ran (aot_eager, every layer); no figure to report
            ran = f"smoke: {variant} {r.best:.1f} ms on CPU" if r is not None and r.ms else ""
            rows.append(Row(key, skipped=f"needs CUDA; {ran or (r.note if r else variant)}"))
            continue
        note = f"{args.preset}, FP8 layers {r.converted}, loss {loss_cell(r)}" if r else ""
        rows.append(_row(key, r, against, goal, note))
    return rows + small_rows(ctx, group)


def _argv(ctx, preset: str) -> list[str]:
    """fp8_step.py's arguments for run_all: ``preset`` at run_all's batch, rounds and steps,
    one pass."""
    argv = ["--preset", preset, "--batch", str(ctx.args.batch), "--passes", "1"]
    return argv + ["--rounds", str(ctx.args.mx_rounds), "--steps", str(ctx.args.mx_steps)]


def _row(key: str, r, against, goal, note: str, why: str = ""):
    """``r``'s best ms beside ``against``'s, or the row saying why one is missing (``why``,
    else either's note)."""
    from run_all_table import Row

    if why or r is None or not r.ms or against is None or not against.ms:
        why = why or (r.note if r else "") or (against.note if against else "") or "not run"
        return Row(key, skipped=why)
    return Row(key, r.best, "ms", against.best, "peer step, ms", goal, note=note)


SMALL_ROWS = ("fp8.small_compile.vs_bf16_compile", "fp8.small_eager.vs_bf16")


def small_rows(ctx, group) -> list:
    """Issue 23's gpt2-small goals: every recipe under its default layer rule, compiled and
    eager, never slower than torch bf16 (``<= 1.00``). A recipe whose rule converts no layer
    steps exactly as aligndp's bf16 step, so that row stands for it; the slowest recipe that
    converts something counts otherwise."""
    from run_all_table import Goal, Row

    if ctx.device.type == "cpu":
        return [Row(k, skipped="needs CUDA (gpt2-small's host-bound step)") for k in SMALL_ROWS]
    recipes = ",".join(f"{r}{c}" for r in RECIPES for c in ("", "+compile"))
    variants = f"bf16,bf16+compile,aligndp,aligndp+compile,{recipes}"
    args = parse_args(_argv(ctx, "gpt2-small") + ["--variants", variants])
    args.process_group = group
    res = run(args)
    rows = []
    for key, suffix, base in zip(SMALL_ROWS, ("+compile", ""), (res["bf16+compile"], res["bf16"])):
        each = [res[f"{name}{suffix}"] for name in RECIPES]
        timed = [t for t in each if t.ms]
        r = max(timed, key=lambda t: t.best) if timed else res[f"aligndp{suffix}"]
        which = "slowest converting recipe" if timed else "no recipe converts a layer: aligndp"
        failed = [t.note for t in each if "FAILED" in t.note]
        goal = Goal("<=", 1.0, "ratio")
        rows.append(_row(key, r, base, goal, f"gpt2-small, {which}", (failed or [""])[0]))
    return rows
