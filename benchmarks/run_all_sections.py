"""The sections of benchmarks/run_all.py: each measures its figures beside their peers."""

from __future__ import annotations

import argparse
import dataclasses
import gc
import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist
from _bench import Timing, build_gpt
from fp8_step_rows import run_all_rows as fp8_step_rows
from run_all_table import FP8_ROWS, ROWS, Goal, Row, matches

from aligndp.models.gpt import PRESETS

# torch >= 2.13 renamed the tensor-in/tensor-out collectives; older releases keep the old names.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


# --- sections: each returns its rows (on rank 0; other ranks' rows are ignored) ---------------


@dataclasses.dataclass
class Context:
    """What every section shares."""

    args: argparse.Namespace
    device: torch.device
    dtype: torch.dtype
    timing: Timing
    bucket_numels: list[int] = dataclasses.field(default_factory=list)
    """The aligndp DDP run's bucket sizes in elements (set by the DDP section)."""


def ddp_section(ctx: Context) -> list[Row]:
    from ddp_step import aligndp_ddp_step, local_fwdbwd, torch_ddp_step

    args, timing = ctx.args, ctx.timing
    cfg = PRESETS[args.preset]
    idx = torch.randint(0, cfg.vocab_size, (args.batch, cfg.seq_len), device=ctx.device)
    model = build_gpt(args.preset, ctx.device, ctx.dtype)
    per_rank = local_fwdbwd(model, idx, timing)
    local = max(per_rank)
    t_torch = torch_ddp_step(model, idx, timing, bucket_cap_mb=args.torch_bucket_mb)
    del model
    free_memory(ctx.device)
    ours = aligndp_ddp_step(
        build_gpt(args.preset, ctx.device, ctx.dtype), idx, timing, bucket_numel=args.bucket_numel
    )
    ctx.bucket_numels = ours.bucket_numels
    free_memory(ctx.device)
    rows = [
        Row(
            "ddp.step",
            ours.seconds / local,
            "x local",
            t_torch / local,
            f"torch DDP {args.torch_bucket_mb:g} MB buckets, same run",
            Goal("<=", 1.02),
            note=f"{ours.seconds * 1e3:.2f} ms vs {local * 1e3:.2f} ms local; "
            f"{len(ours.bucket_numels)} buckets of <= {args.bucket_numel:,} elements",
        )
    ]
    rows += [
        Row(
            f"local.fwdbwd@rank{r}",
            t * 1e3,
            "ms",
            what=f"local fwd+bwd, rank {r} (no communication)",
        )
        for r, t in enumerate(per_rank)
    ]
    rows.append(
        Row(
            "local.skew",
            max(per_rank) / min(per_rank),
            "x",
            note="slowest / fastest rank; the slowest sets a data-parallel step's pace",
        )
    )
    return rows


def nccl_section(ctx: Context) -> list[Row]:
    """Bus bandwidth of each collective at the message sizes of this run's buckets: torch DDP's
    bucket cap and aligndp's median and largest bucket (gradient dtype = the model's)."""
    esize = torch.empty((), dtype=ctx.dtype).element_size()
    ws = dist.get_world_size()
    grad_bytes = (
        sum(p.numel() for p in build_gpt(ctx.args.preset, "meta", ctx.dtype).parameters()) * esize
    )
    sizes = {min(int(ctx.args.torch_bucket_mb * 2**20), grad_bytes)}
    if ctx.bucket_numels:
        ordered = sorted(ctx.bucket_numels)
        sizes |= {ordered[len(ordered) // 2] * esize, ordered[-1] * esize}
    rows = []
    for nbytes in sorted(sizes):
        numel = max(nbytes // esize // ws, 1) * ws
        x = torch.zeros(numel, device=ctx.device, dtype=ctx.dtype)
        shard = torch.zeros(numel // ws, device=ctx.device, dtype=ctx.dtype)
        full = torch.zeros_like(x)
        size = numel * esize  # nccl-tests' S: the full message (reduce-scatter in, all-gather out)
        seconds = {  # each lambda runs within this iteration: binding the loop's tensors is right
            "all_reduce": ctx.timing(lambda: dist.all_reduce(x)),  # noqa: B023
            "reduce_scatter": ctx.timing(lambda: _reduce_scatter(shard, x)),  # noqa: B023
            "all_gather": ctx.timing(lambda: _all_gather(full, shard)),  # noqa: B023
        }
        factor = {
            "all_reduce": 2 * (ws - 1) / ws,
            "reduce_scatter": (ws - 1) / ws,
            "all_gather": (ws - 1) / ws,
        }
        label = f"{size / 2**20:.3g}MB"
        for name, t in seconds.items():
            rows.append(
                Row(
                    f"nccl.{name}@{label}",
                    size / t * factor[name] / 1e9,
                    "GB/s",
                    note=f"{label}, {t * 1e6:.0f} us, {dist.get_backend()}",
                    what=f"{ROWS[f'nccl.{name}@']}, {label}",
                )
            )
    return rows


def zero1_section(ctx: Context) -> list[Row]:
    from zero1_step import aligndp_adamw_step, torch_ddp_adamw_step

    args, timing = ctx.args, ctx.timing
    cfg = PRESETS[args.preset]
    gen = torch.Generator(device=ctx.device).manual_seed(1 + dist.get_rank())
    idx = torch.randint(
        0, cfg.vocab_size, (args.batch, cfg.seq_len), device=ctx.device, generator=gen
    )

    def make():
        free_memory(ctx.device)
        return build_gpt(args.preset, ctx.device, ctx.dtype)

    t_torch, _ = torch_ddp_adamw_step(make(), idx, timing)
    t_ddp, _ = aligndp_adamw_step(
        make(), idx, timing, sharding="none", bucket_numel=args.bucket_numel
    )
    zero1 = {
        (overlap, masters): aligndp_adamw_step(
            make(),
            idx,
            timing,
            sharding="zero1",
            bucket_numel=args.bucket_numel,
            overlap_param_gather=overlap,
            master_weights=masters,
        )[0]
        for masters in (None, False)
        for overlap in (False, True)
    }
    free_memory(ctx.device)

    rows = []
    for key, masters, numerics in (
        ("zero1", None, "fp32 masters and AdamW state"),
        ("zero1_bf16", False, "params and AdamW state in bf16, as the peer's"),
    ):
        t = {overlap: zero1[overlap, masters] for overlap in (False, True)}
        best = min(t.values())
        note = (
            f"param gather overlapped with the next forward {t[True] * 1e3:.2f} ms, "
            f"after the step {t[False] * 1e3:.2f} ms; {numerics}"
        )
        rows += [
            Row(
                f"{key}.vs_torch",
                best * 1e3,
                "ms",
                t_torch * 1e3,
                "torch DDP + fused AdamW, ms",
                Goal("<=", 0.95, "ratio"),
                note=note,
            ),
            Row(
                f"{key}.vs_aligndp_ddp",
                best * 1e3,
                "ms",
                t_ddp * 1e3,
                "aligndp DDP + fused AdamW, ms",
                Goal("<=", 1.0, "ratio"),
                note="the issue: never slower than aligndp's own DDP",
            ),
        ]
    return rows + [
        Row("ddp_adamw.vs_torch", t_ddp * 1e3, "ms", t_torch * 1e3, "torch DDP + fused AdamW, ms")
    ]


def muon_section(ctx: Context) -> list[Row]:
    from muon_step import aligndp_muon_step, hidden_matrices, torch_muon_1gpu

    matrices = hidden_matrices(ctx.args.preset, ctx.device, ctx.dtype)
    t_torch = torch_muon_1gpu(matrices, ctx.timing)
    free_memory(ctx.device)
    ours = aligndp_muon_step(matrices, ctx.timing, bucket_numel=ctx.args.bucket_numel)
    free_memory(ctx.device)
    return [
        Row(
            "muon.step",
            ours.seconds * 1e3,
            "ms",
            t_torch * 1e3,
            "torch.optim.Muon on one GPU, ms",
            Goal("<=", 0.55, "ratio"),
            note=f"{len(matrices)} matrices, dp {dist.get_world_size()}, "
            f"imbalance {ours.imbalance:.3f}, {ours.shared} split matrices on rank 0; "
            "goal from benchmarks/muon_step.py",
        )
    ]


def hopper(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)


def mx_training_section(ctx: Context, group: dist.ProcessGroup) -> list[Row]:
    """One GPU (rank 0 alone, on a one-rank group): bf16 against ``--wgrad fp8`` / ``mxfp8``.
    On CPU only the mxfp8 reference backend runs (a smoke test of the code path, no figure)."""
    from mx_training import step_times

    args = ctx.args
    if ctx.device.type == "cuda" and not hopper(ctx.device):
        return [
            Row(k, skipped=f"needs a Hopper GPU, not {torch.cuda.get_device_name()}")
            for k in ("mx.fp8_step", "mx.fp8_tensor_step", "mx.mxfp8_step")
        ]
    gpu_only = ["fp8"] if ctx.device.type == "cuda" else []
    modes = ["none", *gpu_only, "fp8-tensor", "mxfp8"]
    res = step_times(
        args.mx_preset,
        modes,
        ctx.device,
        batch_size=args.batch,
        rounds=args.mx_rounds,
        steps=args.mx_steps,
        process_group=group,
    )
    base = res["none"]
    rows = (
        []
        if "fp8" in res
        else [Row("mx.fp8_step", skipped="needs CUDA (a Hopper GPU): FP8 1x128 has no CPU backend")]
    )
    fp8_goal = Goal("<=", 0.85, "ratio")
    for mode, goal in (("fp8", fp8_goal), ("fp8-tensor", fp8_goal), ("mxfp8", None)):
        if mode in res:
            r = res[mode]
            rows.append(
                Row(
                    f"mx.{mode.replace('-', '_')}_step",
                    r.median_ms,
                    "ms",
                    base.median_ms,
                    "bf16 step, ms",
                    goal,
                    note=f"{args.mx_preset}, rounds {min(r.ms):.1f}-{max(r.ms):.1f} ms, "
                    f"loss {r.loss:.3f} (bf16 {base.loss:.3f}); loss parity is not measured here"
                    + ("" if ctx.device.type == "cuda" else "; CPU reference backend"),
                )
            )
    return rows


def mx_kernels_section(ctx: Context) -> list[Row]:
    """One GPU (the last rank): the MX kernels at 8192^3 against cuBLAS and a device copy."""
    keys = ("mx.wgrad_mxfp8", "mx.wgrad_fp8", "mx.quantise_fp8", "mx.quantise_mxfp8")
    if ctx.device.type != "cuda":
        return [Row(k, skipped="needs CUDA") for k in keys]
    if not hopper(ctx.device):
        return [
            Row(k, skipped=f"needs a Hopper GPU, not {torch.cuda.get_device_name()}") for k in keys
        ]
    return mx_kernel_rows(ctx.args.kernel_size, ctx.device)


def mx_kernel_rows(n: int, dev: torch.device) -> list[Row]:
    import mx_kernels as mk

    from aligndp.lowp.recipe import ScaleFormat

    copy_numel = 4 * n * n
    copy_tbs = max(
        4 * copy_numel / mk.copy_ms(copy_numel, dev, graph=g) / 1e9 for g in (False, True)
    )
    torch.manual_seed(0)
    x = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    dy = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    main_grad = torch.zeros(n, n, device=dev, dtype=torch.float32)
    rows = []
    for key, block, fmt, goal in (
        ("mx.quantise_fp8", 128, ScaleFormat.FP32, Goal(">=", 0.90, "ratio")),
        ("mx.quantise_mxfp8", 32, ScaleFormat.E8M0, None),
    ):
        ms = mk.quantise_ms(x, block=block, scale_format=fmt, rowwise=True, colwise=True)
        nbytes = mk.quantise_bytes(n, block=block, scale_format=fmt, rowwise=True, colwise=True)
        tbs = nbytes / ms / 1e9
        rows.append(
            Row(
                key,
                tbs,
                "TB/s",
                copy_tbs,
                "device copy, faster of do_bench / graphed, TB/s",
                goal,
                note=f"{n}x{n} bf16, {ms * 1e3:.1f} us graphed",
            )
        )
    ms_alone, ms_add = mk.bf16_wgrad_peer_ms(x, dy, main_grad)
    for key, block, fmt, goal in (
        ("mx.wgrad_mxfp8", 32, ScaleFormat.E8M0, Goal(">=", 700)),
        ("mx.wgrad_fp8", 128, ScaleFormat.FP32, None),
    ):
        a, b = mk.wgrad_operands(dy, x, block=block, scale_format=fmt)
        err = mk.wgrad_rel_err(a, b, block=block, scale_format=fmt)
        if not err < 1e-3:
            rows.append(Row(key, skipped=f"wrong result: relative error {err:.1e} against float64"))
            continue
        ms = mk.wgrad_ms(a, b, main_grad, block=block, scale_format=fmt)
        rows.append(
            Row(
                key,
                mk.tflops(n, n, n, ms),
                "TFLOP/s",
                mk.tflops(n, n, n, ms_add),
                "cuBLAS bf16 + add_, TFLOP/s",
                goal,
                note=f"{n}^3, rel err {err:.1e}; "
                f"cuBLAS bf16 alone {mk.tflops(n, n, n, ms_alone):.0f} TFLOP/s",
            )
        )
        del a, b
    return rows


def one_gpu_sections(ctx: Context, group: dist.ProcessGroup) -> list[Row]:
    """Rank 0 times the MX training steps while the last rank times the kernels (on another GPU,
    so neither waits for the other); every rank's rows are gathered to rank 0."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    mine: list[Row] = []
    for runs_here, fn, keys in (
        (
            rank == 0,
            lambda: mx_training_section(ctx, group),
            ("mx.fp8_step", "mx.fp8_tensor_step", "mx.mxfp8_step"),
        ),
        (rank == 0, lambda: fp8_step_rows(ctx, group), FP8_ROWS),
        (
            rank == ws - 1,
            lambda: mx_kernels_section(ctx),
            ("mx.wgrad_mxfp8", "mx.wgrad_fp8", "mx.quantise_fp8", "mx.quantise_mxfp8"),
        ),
    ):
        if runs_here:
            mine += guarded(fn, keys)
            free_memory(ctx.device)
    everyone: list[list[Row] | None] = [None] * ws
    dist.all_gather_object(everyone, mine)
    return [row for rows in everyone for row in rows]


# --- running, printing, writing ----------------------------------------------------------------


def guarded(fn: Callable[[], list[Row]], keys) -> list[Row]:
    """``fn()``'s rows, plus a skip row for every expected key it did not produce (its error
    when it raised) so that no row silently disappears."""
    try:
        rows, reason = fn(), "not measured"
    except Exception as err:  # noqa: BLE001 -- a failed section must not cost the other rows
        traceback.print_exc()
        rows, reason = (
            [],
            f"error: {type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}",
        )
    return rows + [
        Row(k.rstrip("@"), skipped=reason) for k in keys if not any(matches(r.key, k) for r in rows)
    ]


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
