r"""ZeRO-1's optimizer step over the buckets' masters: one step over all of them, or one per bucket.

    PYTHONPATH=$PWD/src python benchmarks/zero1_bucket_step.py                 # CPU
    PYTHONPATH=$PWD/src python benchmarks/zero1_bucket_step.py --device cuda \
        --numel 62000000 --buckets 1 2 4

[Note: one ZeRO-1 step] (aligndp/optim/sharded.py) steps every bucket's masters in one
``step()`` of the inner torch optimizer. The alternative steps bucket by bucket, so that a
bucket's param all-gather could start while the next bucket is stepped. This measures what
the per-bucket form costs on its own, in one process (no collectives): ``--numel`` fp32
elements (one rank's owned share) cut into ``--buckets`` buckets of ``--pieces`` masters of
GPT-like sizes, AdamW (foreach on CPU, fused on CUDA), three forms:

  one          one optimizer over every master, one ``step()`` (what ShardedPart does)
  per_bucket   the same optimizer, one ``step()`` per bucket with only that bucket's grads
               bound (torch skips params without ``.grad``; how the layer-wise part steps)
  per_optim    one optimizer per bucket, one ``step()`` each

Figures: ``host_ms``, the time until the last ``step()`` returns (on CUDA kernels are queued,
so this is the host's share), and ``wall_ms``, until the device is done too; the median over
``--iters`` after ``--warmup``, the forms taking turns. JSON lines, then the ratios to
``one`` per bucket count.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def pieces(numel: int, count: int, gen: torch.Generator) -> list[int]:
    """``count`` piece sizes summing to ``numel``, uneven as a GPT's params are."""
    weights = torch.rand(count, generator=gen) + 0.05
    sizes = (weights / weights.sum() * numel).long().clamp(min=1)
    sizes[-1] += numel - int(sizes.sum())
    return [int(s) for s in sizes]


def build(numel: int, buckets: int, per_bucket: int, device: torch.device, fused: bool):
    """The buckets' masters with gradients, and the optimizer options."""
    gen = torch.Generator().manual_seed(0)
    share = numel // buckets
    groups: list[list[torch.Tensor]] = []
    for b in range(buckets):
        n = share if b < buckets - 1 else numel - share * (buckets - 1)
        flat = torch.randn(n, generator=gen).to(device)
        masters, cursor = [], 0
        for size in pieces(n, per_bucket, gen):
            m = flat[cursor : cursor + size]
            m.grad = torch.randn(size, generator=gen).to(device)
            masters.append(m)
            cursor += size
        groups.append(masters)
    options = {"lr": 1e-3, "weight_decay": 0.1}
    options |= {"fused": True} if fused else {"foreach": True}
    return groups, options


def forms(groups: list[list[torch.Tensor]], options: dict):
    """name -> a function running one optimizer step of that form."""
    every = [m for g in groups for m in g]
    grads = {id(m): m.grad for m in every}
    one = torch.optim.AdamW(every, **options)
    shared = torch.optim.AdamW(every, **options)
    per = [torch.optim.AdamW(g, **options) for g in groups]

    def step_one() -> None:
        one.step()

    def step_per_bucket() -> None:
        for m in every:
            m.grad = None
        for g in groups:
            for m in g:
                m.grad = grads[id(m)]
            shared.step()
            for m in g:
                m.grad = None
        for m in every:
            m.grad = grads[id(m)]

    def step_per_optim() -> None:
        for opt in per:
            opt.step()

    return {"one": step_one, "per_bucket": step_per_bucket, "per_optim": step_per_optim}


def measure(
    steps: dict, device: torch.device, iters: int, warmup: int
) -> dict[str, tuple[float, float]]:
    """Median (host_ms, wall_ms) of each of ``steps``, run in turn within every iteration (so
    a busy machine slows every form alike)."""
    host: dict[str, list[float]] = {name: [] for name in steps}
    wall: dict[str, list[float]] = {name: [] for name in steps}
    for i in range(warmup + iters):
        for name, fn in steps.items():
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            t1 = time.perf_counter()
            if device.type == "cuda":
                torch.cuda.synchronize()
            t2 = time.perf_counter()
            if i >= warmup:
                host[name].append((t1 - t0) * 1e3)
                wall[name].append((t2 - t0) * 1e3)
    return {n: (statistics.median(host[n]), statistics.median(wall[n])) for n in steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--numel", type=int, default=4_000_000, help="one rank's owned elements")
    ap.add_argument("--buckets", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--pieces", type=int, default=24, help="masters per bucket")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads (default: torch's)"
    )
    args = ap.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    label = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    ratios = {}
    for buckets in args.buckets:
        groups, options = build(args.numel, buckets, args.pieces, device, device.type == "cuda")
        results = measure(forms(groups, options), device, args.iters, args.warmup)
        for name, (host, wall) in results.items():
            print(
                json.dumps(
                    {
                        "form": name,
                        "buckets": buckets,
                        "numel": args.numel,
                        "pieces_per_bucket": args.pieces,
                        "device": label,
                        "host_ms": round(host, 3),
                        "wall_ms": round(wall, 3),
                    }
                ),
                flush=True,
            )
        base_host, base_wall = results["one"]
        ratios[buckets] = {
            name: {"host": round(h / base_host, 3), "wall": round(w / base_wall, 3)}
            for name, (h, w) in results.items()
            if name != "one"
        }
        del groups
    print(json.dumps({"summary": "ratio to one step over every bucket", "ratios": ratios}))


if __name__ == "__main__":
    main()
