"""Split Newton–Schulz balance in time on one GPU: the layer-wise plan's ranks, piece by piece.

GPU (one H200):
    torchrun --nproc-per-node 1 benchmarks/split_ns_balance.py --preset 1b --dp 8 16 32 64
CPU smoke run:
    torchrun --nproc-per-node 1 benchmarks/split_ns_balance.py --preset tiny-odd --dp 4 \
        --device cpu --iters 1 --warmup 0

The plan is what ``aligndp layout --optimizer muon --mode layerwise --dp D`` prints: each rank
orthogonalises its whole matrices and its parts of the split ones ([Note: split Newton–Schulz]
in aligndp/plan/split.py). Every distinct piece is timed alone on this device in bf16: a whole
matrix by torch's Newton–Schulz, a part by ``ns_steps`` iterations of its Gram GEMM, its rows of
``B`` and its columns' update (aligndp/optim/split_ns.py). Compute only: the collectives a
split adds are not in it. A rank's time is the sum of its pieces'. For each D, with the default
split policy and with ``split=False``: rank time max (ms) and max/mean, beside the flops model's
max/mean. JSON lines.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch
import torch.distributed as dist
from _bench import Timing, add_common_arguments, device_label, init, log

from aligndp.app.layout_cli import LayoutOptions, preset_model
from aligndp.optim import split_ns
from aligndp.plan.request import plan_buffers
from aligndp.plan.spec import Mode, max_over_mean
from aligndp.plan.split import wide

A, B, C = 3.4445, -4.7750, 2.0315  # torch's Muon's default coefficients
NS_STEPS = 5


def piece_seconds(piece: tuple, device: torch.device, timing: Timing) -> float:
    """``("whole", shape)`` or ``("part", shape, cols, rows)``: seconds of its Newton–Schulz."""
    m, n = wide(piece[1])
    if piece[0] == "whole":
        grad = torch.randn(piece[1], device=device)
        ns = torch.optim._muon._zeropower_via_newtonschulz
        return timing(lambda: ns(grad, (A, B, C), NS_STEPS, 1e-7))
    cols, rows = piece[2], piece[3]
    x0 = torch.randn(m, cols, device=device, dtype=torch.bfloat16) / (m * n) ** 0.5
    full_b = torch.randn(m, m, device=device, dtype=torch.bfloat16) / m

    def part() -> None:
        x = x0
        for _ in range(NS_STEPS):
            gram = split_ns.gram_part(x).to(torch.bfloat16)  # the all-reduce would sit here
            split_ns.b_rows(gram, 0, rows, B, C)  # the all-gather of B would follow
            x = split_ns.apply_b(x, full_b, A)

    return timing(part)


def rank_pieces(options: LayoutOptions, split: bool) -> tuple[list[list[tuple]], list[float]]:
    """Each rank's pieces, and its cost in the planner's flops model."""
    request = options.request()
    if not split:
        request = dataclasses.replace(request, split=None)
    pieces: list[list[tuple]] = [[] for _ in range(options.dp_size)]
    flops = [0.0] * options.dp_size
    for layout in plan_buffers(request):
        if layout.mode is not Mode.LAYERWISE:
            continue
        flops = [a + b for a, b in zip(flops, layout.rank_costs())]
        for p in layout.params:
            if p.split is None:
                pieces[p.owner].append(("whole", p.shape))
                continue
            bounds = zip(
                p.split.ranks, p.split.cols, p.split.cols[1:], p.split.rows, p.split.rows[1:]
            )
            for rank, c0, c1, r0, r1 in bounds:
                pieces[rank].append(("part", p.shape, c1 - c0, r1 - r0))
    return pieces, flops


def main() -> None:
    ap = argparse.ArgumentParser()
    add_common_arguments(ap)
    ap.add_argument("--dp", type=int, nargs="+", default=[8, 16, 32, 64])
    args = ap.parse_args()
    device, _ = init(args.device)
    timing = Timing(device, args.iters, args.warmup)
    log(what="env", torch=torch.__version__, device=device_label(device), preset=args.preset)
    seconds: dict[tuple, float] = {}
    model = preset_model(args.preset)
    for dp in args.dp:
        options = LayoutOptions(model=model, dp_size=dp, mode=Mode.LAYERWISE, optimizer="muon")
        for split in (True, False):
            pieces, flops = rank_pieces(options, split)
            for piece in sorted({q for ps in pieces for q in ps} - set(seconds), key=str):
                seconds[piece] = piece_seconds(piece, device, timing)
            ms = [1e3 * sum(seconds[q] for q in ps) for ps in pieces]
            log(
                what="split_ns_balance",
                dp=dp,
                split="default" if split else "off",
                max_ms=round(max(ms), 3),
                imbalance_time=round(max_over_mean(ms), 4),
                imbalance_flops=round(max_over_mean(flops), 4),
                parts=sum(q[0] == "part" for ps in pieces for q in ps),
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
