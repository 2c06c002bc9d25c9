r"""ZeRO-1 full step against torch DDP + fused AdamW on the same model, measured in one run.

GPU (the figure we report; goal: ratio <= 0.95, state padding <= 0.5 %):
    torchrun --nproc-per-node 2 benchmarks/zero1_step.py --preset 1b --batch 8
CPU smoke run (gloo):
    torchrun --nproc-per-node 2 benchmarks/zero1_step.py \
        --preset demo --device cpu --batch 2 --iters 2

A "step" is forward + backward + gradient collectives + optimizer + param all-gather, i.e.
everything between two forwards. Steps are timed back to back (one device sync per
``--iters`` steps) so a param all-gather overlapped with the next forward counts as hidden.
JSON lines on rank 0:
  torch_ddp   torch DDP (bf16 grads, gradient_as_bucket_view) + torch.optim.AdamW(fused=True)
  aligndp_ddp aligndp parallelize(sharding="none") + fused AdamW (ZeRO-1 should never be slower)
  zero1       aligndp parallelize(sharding="zero1"), per overlap_param_gather setting and per
              master_weights: null (default: fp32 masters of bf16 params) and false (params
              and AdamW state stepped in bf16, torch's numerics); ratio = zero1 / torch
  state       optimizer bytes per rank (fp32 masters + AdamW state) against total / dp_size,
              per master_weights setting
  summary     best default ratio (goal 0.95) and best master_weights=false ratio
FP8 param all-gathers: benchmarks/fp8_gather_step.py.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from _bench import (
    Timing,
    add_common_arguments,
    build_gpt,
    device_label,
    init,
    log,
)

import aligndp
from aligndp.models.gpt import PRESETS
from aligndp.runtime.masters import keeps_fp32_master


def state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of every tensor in the optimizer's state (exp_avg, exp_avg_sq, step)."""
    return sum(
        t.numel() * t.element_size()
        for s in opt.state.values()
        for t in s.values()
        if torch.is_tensor(t)
    )


def torch_ddp_adamw(
    model: nn.Module, idx: torch.Tensor
) -> tuple[Callable[[], None], torch.optim.Optimizer]:
    """The peer's training step as a function — torch DDP (bf16 grads,
    gradient_as_bucket_view) + ``AdamW(fused=True)`` — and its optimizer."""
    ddp = nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
    torch_opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def torch_step() -> None:
        ddp(idx, idx).backward()
        torch_opt.step()
        torch_opt.zero_grad(set_to_none=True)

    return torch_step, torch_opt


def torch_ddp_adamw_step(model: nn.Module, idx: torch.Tensor, timing: Timing) -> tuple[float, int]:
    """Seconds per torch DDP + fused AdamW step (:func:`torch_ddp_adamw`), and the optimizer's
    state bytes per rank."""
    torch_step, torch_opt = torch_ddp_adamw(model, idx)
    return timing(torch_step), state_bytes(torch_opt)


def aligndp_adamw_step(
    model: nn.Module,
    idx: torch.Tensor,
    timing: Timing,
    *,
    sharding: str,
    bucket_numel: int,
    grad_dtype: torch.dtype | None = None,
    overlap_param_gather: bool = False,
    master_weights: bool | None = None,
    inspect: Callable | None = None,
    **parallelize_kwargs,
) -> tuple[float, int]:
    """Seconds per ``parallelize(sharding=..., fused=True)`` AdamW step (fwd + bwd + step +
    zero_grad) and the number of buckets; ``inspect(model, opt)`` runs after timing, before
    the hooks are removed."""
    ours, opt = aligndp.parallelize(
        model,
        sharding=sharding,
        lr=1e-4,
        bucket_numel=bucket_numel,
        grad_dtype=grad_dtype,
        overlap_param_gather=overlap_param_gather,
        master_weights=master_weights,
        fused=True,
        **parallelize_kwargs,
    )

    def step() -> None:
        ours(idx, idx).backward()
        opt.step()
        opt.zero_grad()

    try:
        seconds = timing(step)
        if inspect is not None:
            inspect(ours, opt)
        return seconds, sum(len(layout.buckets) for layout in ours.layouts)
    finally:
        opt.gather.wait_all()
        ours.remove_hooks()
        opt.gather.remove_hooks()


def main() -> None:
    ap = argparse.ArgumentParser()
    add_common_arguments(ap)
    ap.add_argument(
        "--batch", type=int, default=8, help="sequences per GPU (of the preset's seq_len)"
    )
    ap.add_argument("--bucket-numel", type=int, default=40_000_000)
    ap.add_argument(
        "--grad-dtype",
        default="param",
        choices=["param", "fp32"],
        help="aligndp gradient buffer dtype (torch DDP always reduces in the param dtype)",
    )
    args = ap.parse_args()
    device, dtype = init(args.device)
    cuda = device.type == "cuda"
    timing = Timing(device, args.iters, args.warmup)
    cfg = PRESETS[args.preset]
    ws = dist.get_world_size()
    log(
        what="env",
        torch=torch.__version__,
        world_size=ws,
        device=device_label(device),
        preset=args.preset,
        batch=args.batch,
        seq_len=cfg.seq_len,
        dtype=str(dtype),
    )

    gen = torch.Generator(device=device).manual_seed(1 + dist.get_rank())
    idx = torch.randint(0, cfg.vocab_size, (args.batch, cfg.seq_len), device=device, generator=gen)

    def make() -> nn.Module:
        return build_gpt(args.preset, device, dtype)

    model = make()
    nparams = sum(p.numel() for p in model.parameters())
    t_torch, torch_state = torch_ddp_adamw_step(model, idx, timing)
    log(what="torch_ddp", params=nparams, step_ms=t_torch * 1e3, optimizer_state_bytes=torch_state)
    del model
    if cuda:
        torch.cuda.empty_cache()

    grad_dtype = torch.float32 if args.grad_dtype == "fp32" else None
    t, buckets = aligndp_adamw_step(
        make(), idx, timing, sharding="none", bucket_numel=args.bucket_numel, grad_dtype=grad_dtype
    )
    log(
        what="aligndp_ddp",
        bucket_numel=args.bucket_numel,
        buckets=buckets,
        step_ms=t * 1e3,
        ratio=t / t_torch,
    )
    best: dict[bool | None, float] = {}
    for master_weights in (None, False):
        for overlap_param_gather in (False, True):
            if cuda:
                torch.cuda.empty_cache()
            inspect = (
                (
                    lambda m, o, mw=master_weights: report_state(
                        o, m, nparams=nparams, ws=ws, master_weights=mw
                    )
                )
                if overlap_param_gather
                else None
            )
            t, buckets = aligndp_adamw_step(
                make(),
                idx,
                timing,
                sharding="zero1",
                bucket_numel=args.bucket_numel,
                grad_dtype=grad_dtype,
                overlap_param_gather=overlap_param_gather,
                master_weights=master_weights,
                inspect=inspect,
            )
            best[master_weights] = min(t, best.get(master_weights, t))
            log(
                what="zero1",
                master_weights=master_weights,
                overlap_param_gather=overlap_param_gather,
                bucket_numel=args.bucket_numel,
                buckets=buckets,
                step_ms=t * 1e3,
                ratio=t / t_torch,
            )
    ratio = best[None] / t_torch
    log(
        what="summary",
        ratio=ratio,
        goal=0.95,
        met=ratio <= 0.95,
        ratio_master_weights_false=best[False] / t_torch,
    )
    dist.destroy_process_group()


def report_state(opt, model, *, nparams: int, ws: int, master_weights: bool | None) -> None:
    """Optimizer bytes (fp32 masters that are copies + state) per rank vs the ideal
    total / dp_size: AdamW's two moments in the master's dtype, plus the fp32 master where one
    is kept."""
    masters = sum(p.master.numel() * 4 for p in opt.masters if p.cast_back)
    mine = state_bytes(opt.inner[0]) + masters
    scalar = sum(
        t.numel() * t.element_size()
        for s in opt.inner[0].state.values()
        for t in s.values()
        if torch.is_tensor(t) and t.dim() == 0
    )
    everyone: list[int] = [0] * ws
    dist.all_gather_object(everyone, [mine, scalar])
    dtype = next(model.module.parameters()).dtype
    keeps = keeps_fp32_master(dtype, master_weights=master_weights is not False)
    per_element = 2 * (4 if keeps else dtype.itemsize) + (4 if keeps else 0)
    ideal = nparams * per_element / ws
    worst = max(m - s for m, s in everyone)  # per-param step counters are not per-element state
    log(
        what="state",
        master_weights=master_weights,
        bytes_per_rank=[m for m, _ in everyone],
        ideal_bytes_per_rank=ideal,
        padding_over_ideal=worst / ideal - 1,
        goal=0.005,
        layout_padding_fraction=max(layout.padding_fraction for layout in model.layouts),
    )


if __name__ == "__main__":
    main()
