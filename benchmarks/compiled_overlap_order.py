r"""Where a compiled backward launches its bucket collectives ([Note: compiled overlap]).

Two ranks over gloo on one device (both on cuda:0 with ``--device cuda``: no NCCL, which
refuses two ranks on one GPU), ``torch.compile`` of the whole wrapped GPT (Inductor), one
aligndp variant after another. For the last of a few steps each rank logs, on the host and in
order, ``launch <k>`` for every bucket collective, ``first layer grad`` when autograd produced
the gradient of the model's first param (the token embedding), and ``backward end``; rank 0
prints them with their milliseconds since the backward began, and whether a collective was
launched before the first layer's gradient (the overlap). ``--profile DIR`` also writes a
torch.profiler trace of that step per variant (open in Perfetto: gloo's collectives beside
the backward's kernels).

    python benchmarks/compiled_overlap_order.py --device cuda
    python benchmarks/compiled_overlap_order.py --device cpu --preset demo --dim 256 \
        --layers 3 --batch 2 --bucket-numel 500000   # a CPU check (minutes on 2 cores)

``--no-split`` sets ``torch._dynamo.config.optimize_ddp = False`` (the whole backward one node),
the order without the graph split; ``--eager`` the order without compiling.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import aligndp
from aligndp.models.gpt import GPT, PRESETS

VARIANTS = {
    "none": {"optimizer": "adamw", "sharding": "none"},
    "zero1": {"optimizer": "adamw", "sharding": "zero1"},
    "muon": {"optimizer": "muon", "sharding": "zero1"},
}


def run_variant(name: str, args, rank: int, device: torch.device) -> dict:
    cfg = PRESETS[args.preset]
    if args.dim or args.layers:  # a smaller model for a CPU check
        cfg = dataclasses.replace(
            cfg, dim=args.dim or cfg.dim, num_layers=args.layers or cfg.num_layers
        )
    torch.manual_seed(0)
    model, opt = aligndp.parallelize(
        GPT(cfg).to(device), bucket_numel=args.bucket_numel, **VARIANTS[name]
    )
    events: list[tuple[str, float]] = []
    t0 = [0.0]

    def note(what: str) -> None:
        events.append((what, (time.perf_counter() - t0[0]) * 1e3))

    coll = model.collectives
    for op in ("all_reduce_mean", "reduce_scatter_mean"):
        launch = getattr(coll, op)

        def logged(bucket, launch=launch):
            note(f"launch {sum(e[0].startswith('launch') for e in events)}")
            return launch(bucket)

        setattr(coll, op, logged)
    first = next(p for p in model.module.parameters())
    first.register_hook(lambda g: note("first layer grad"))
    compiled = model if args.eager else torch.compile(model)
    g = torch.Generator().manual_seed(rank)
    idx = torch.randint(0, cfg.vocab_size, (args.batch, cfg.seq_len), generator=g).to(device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    trace = None
    for step in range(args.steps):
        last = step == args.steps - 1
        prof = None
        if last and args.profile:
            prof = torch.profiler.profile(record_shapes=False)
            prof.__enter__()
        with autocast:
            loss = compiled(idx, idx)
        if device.type == "cuda":
            torch.cuda.synchronize()
        events.clear()
        t0[0] = time.perf_counter()
        loss.backward()
        note("backward end")
        opt.step()
        opt.zero_grad()
        if prof is not None:
            prof.__exit__(None, None, None)
            os.makedirs(args.profile, exist_ok=True)
            trace = os.path.join(args.profile, f"{name}_rank{rank}.json")
            prof.export_chrome_trace(trace)
    names = [e[0] for e in events]
    before = names[: names.index("first layer grad")] if "first layer grad" in names else names
    model.remove_hooks()
    torch._dynamo.reset()
    return {
        "variant": name,
        "buckets": len(model.bucket_refs),
        "launched_before_first_layer_grad": sum(n.startswith("launch") for n in before),
        "overlap": any(n.startswith("launch") for n in before),
        "events_ms": [(n, round(ms, 2)) for n, ms in events],
        "trace": trace,
    }


def worker(rank: int, args, init_file: str) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    device = torch.device("cuda:0" if args.device == "cuda" else "cpu")
    if args.no_split:
        torch._dynamo.config.optimize_ddp = False
    for name in args.variants:
        try:
            result = run_variant(name, args, rank, device)
        except Exception as e:  # noqa: BLE001  report the variant and go on with the next
            result = {"variant": name, "error": f"{type(e).__name__}: {e}"}
        if rank == 0:
            print(json.dumps(result), flush=True)
        dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--preset", default="gpt2-small", choices=sorted(PRESETS))
    parser.add_argument("--dim", type=int, default=0, help="override the preset's width")
    parser.add_argument("--layers", type=int, default=0, help="override its number of blocks")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--bucket-numel", type=int, default=4_000_000)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--profile", default=None, help="write a trace per variant here")
    parser.add_argument("--no-split", action="store_true", help="optimize_ddp=False")
    parser.add_argument("--eager", action="store_true", help="no torch.compile: the eager order")
    args = parser.parse_args()
    init_file = tempfile.mktemp(prefix="compiled_overlap_")
    mp.spawn(worker, args=(args, init_file), nprocs=2)


if __name__ == "__main__":
    main()
