"""`aligndp rehearse`: rank r of a D-rank job in one process ([Note: rehearsal] in rehearse.py).

    python -m aligndp rehearse --preset 1b --nproc 64 --rank all --sharding zero1 \\
        --optimizer muon --device cuda --png rehearse.png

Prints per rank: peak memory (allocated, reserved) beside the plan's analytical figure, the
step's forward / backward / optimizer / param-gather seconds on this device, the measured
Newton–Schulz seconds (layer-wise), the step's collectives (kind, group size, bytes, phase,
launch time) and the step time predicted at D by the communication model, whose parameters
are printed and set by ``--intra`` / ``--inter`` / ``--ranks-per-node`` ([Note:
communication model] in rehearse_cost.py). ``--json`` prints all of it as JSON. This module
imports no torch until the command runs, so ``aligndp --help`` stays fast.
"""

from __future__ import annotations

import argparse

from aligndp.app.layout_args import Renamed

__all__ = ["add_arguments", "run", "options_from_args"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``aligndp rehearse``; each maps to one field of ``RehearsalOptions``."""
    parser.add_argument("--preset", default="demo", help="GPT preset (default demo)")
    parser.add_argument(
        "--nproc",
        dest="dp",
        type=int,
        default=8,
        help="ranks of the rehearsed job, all replicas together, as aligndp train --nproc "
        "(default 8)",
    )
    parser.add_argument("--dp", action=Renamed)  # the rank count is --nproc everywhere
    parser.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="replicas of a (R, dp / R) mesh, as aligndp train --replicas (default 1)",
    )
    parser.add_argument(
        "--rank",
        default="0",
        help="rank(s) to play: N, N,M,..., or all (plan and Newton-Schulz for every rank, the "
        "step on a sample of --sample ranks; default 0)",
    )
    parser.add_argument("--sharding", choices=("none", "zero1"), default="none")
    parser.add_argument("--optimizer", default="adamw", help="adamw, muon, ... (as parallelize)")
    parser.add_argument("--wgrad", default="none", help="wgrad recipe (default none)")
    parser.add_argument("--fp8-param-gather", action="store_true")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=None, help="default: the preset's")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="param dtype")
    parser.add_argument("--autocast", action="store_true", help="bf16 autocast forward")
    parser.add_argument("--compile", action="store_true", help="torch.compile the wrapper")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--steps", type=int, default=1, help="timed steps after one warm-up")
    parser.add_argument(
        "--sample",
        type=int,
        default=3,
        help="--rank all: ranks stepped (0: plan and Newton-Schulz only)",
    )
    parser.add_argument("--ns-repeats", type=int, default=3, help="timings per NS part shape")
    parser.add_argument(
        "--ns-cost",
        choices=("device", "cpu", "cuda", "flops"),
        default="device",
        help="Newton-Schulz cost a layer-wise Muon plan is balanced by: the --device's "
        "(default), the CPU's or the H200's figures, or the flops alone",
    )
    parser.add_argument("--bucket-numel", type=int, default=None)
    parser.add_argument(
        "--intra", default=None, metavar="GBPS,US", help="link within a node (default 360,10)"
    )
    parser.add_argument(
        "--inter", default=None, metavar="GBPS,US", help="link across nodes (default 40,25)"
    )
    parser.add_argument("--ranks-per-node", type=int, default=8)
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--png", metavar="FILE", help="draw the per-rank costs into this PNG")


def _ranks(text: str, dp: int) -> tuple[int, ...] | None:
    if text == "all":
        return None
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--rank {text!r}: write N, N,M,... or all") from None


def options_from_args(args: argparse.Namespace):
    from aligndp.app.rehearse import RehearsalOptions
    from aligndp.app.rehearse_cost import CommModel, Link
    from aligndp.optim.ns_cost import ns_cost_for

    comm = CommModel(
        intra=Link.parse(args.intra, flag="--intra") if args.intra else CommModel.intra,
        inter=Link.parse(args.inter, flag="--inter") if args.inter else CommModel.inter,
        ranks_per_node=args.ranks_per_node,
    )
    return RehearsalOptions(
        preset=args.preset,
        dp_size=args.dp,
        replicas=args.replicas,
        ranks=_ranks(args.rank, args.dp),
        sharding=args.sharding,
        optimizer=args.optimizer,
        wgrad=args.wgrad,
        fp8_param_gather=args.fp8_param_gather,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        dtype=args.dtype,
        autocast=args.autocast,
        compile=args.compile,
        device=args.device,
        steps=args.steps,
        sample=args.sample,
        bucket_numel=args.bucket_numel,
        ns_repeats=args.ns_repeats,
        comm=comm,
        ns_cost=None if args.ns_cost == "device" else ns_cost_for(args.ns_cost),
    )


def run(args: argparse.Namespace) -> int:
    from aligndp.app.rehearse import rehearse

    result = rehearse(options_from_args(args))
    if args.json:
        from aligndp.app.train_report import dumps

        print(dumps(result.to_dict(), indent=1, default=str))
    else:
        print(table(result))
    if args.png:
        draw(result, args.png)
    return 0


def _mb(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:,.1f}"


def _ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1e3:.2f}"


def table(result) -> str:
    """The rehearsal as text: a header, one row per rank, the sampled rank's collectives."""
    o = result.options
    lines = [
        f"rehearsal: {o.preset}, dp {o.dp_size} (replicas {o.replicas}), sharding "
        f"{o.sharding}, {o.optimizer}, wgrad {o.wgrad}, batch {o.batch_size}, dtype {o.dtype}"
        f"{', autocast bf16' if o.autocast else ''}{', compiled' if o.compile else ''}, "
        f"on {o.device}",
        f"communication model: within a node {o.comm.intra.gbps:g} GB/s + "
        f"{o.comm.intra.latency_us:g} us, across nodes {o.comm.inter.gbps:g} GB/s + "
        f"{o.comm.inter.latency_us:g} us per tree step, {o.comm.ranks_per_node} ranks per node",
        f"sampling: {result.sampled}",
        f"{'rank':>5} {'ran':>3} {'fits':>4} {'peak MB':>10} {'reserved':>10} {'plan MB':>10} "
        f"{'fwd ms':>8} {'bwd ms':>8} {'opt ms':>8} {'gather':>7} {'NS ms':>8} {'comm ms':>8} "
        f"{'step ms':>8} {'overlap':>8}",
    ]
    for r in result.ranks:
        s, p = r.seconds, r.predicted
        lines.append(
            f"{r.rank:>5} {'yes' if r.ran else 'no':>3} {'yes' if r.fits else 'NO':>4} "
            f"{_mb(r.peak_allocated):>10} {_mb(r.peak_reserved):>10} "
            f"{_mb(sum(r.analytic.values())):>10} {_ms(s.get('forward')):>8} "
            f"{_ms(s.get('backward')):>8} {_ms(s.get('optimizer')):>8} {_ms(s.get('gather')):>7} "
            f"{_ms(r.ns_seconds):>8} {_ms(p.get('comm_s')):>8} {_ms(p.get('no_overlap_s')):>8} "
            f"{_ms(p.get('overlap_s')):>8}"
        )
    if result.ns_max_over_mean is not None:
        lines.append(f"Newton-Schulz measured max / mean over ranks: {result.ns_max_over_mean:.4f}")
    shown = next((r for r in result.ranks if r.ran), None)
    if shown is not None:
        lines.append(f"collectives of rank {shown.rank}'s step (kind, group, bytes, phase, at ms):")
        for c in shown.collectives:
            lines.append(
                f"  {c.kind:<15} {c.group_size:>5} {c.bytes:>14,} {c.dtype:<9} {c.phase:<10} "
                f"{c.at_ms:9.2f}"
            )
    return "\n".join(lines)


def draw(result, path: str) -> None:
    """Per-rank bars: measured Newton–Schulz ms and predicted step ms (with overlap)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranks = [r.rank for r in result.ranks]
    fig, axes = plt.subplots(2, 1, figsize=(max(6, len(ranks) * 0.02 + 6), 6), sharex=True)
    ns = [(r.ns_seconds or 0) * 1e3 for r in result.ranks]
    step = [r.predicted.get("overlap_s", 0) * 1e3 for r in result.ranks]
    axes[0].bar(ranks, ns, width=1.0)
    axes[0].set_ylabel("Newton-Schulz ms")
    axes[1].bar(ranks, step, width=1.0, color="tab:orange")
    axes[1].set_ylabel("predicted step ms")
    axes[1].set_xlabel("rank")
    o = result.options
    fig.suptitle(f"aligndp rehearse: {o.preset}, dp {o.dp_size}, {o.sharding}, {o.optimizer}")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
