"""Layer-wise Muon step against one-GPU torch.optim.Muon over the same matrices, in one run.

GPU (the figure we report; goal: ratio <= 0.55 at dp 2):
    torchrun --nproc-per-node 2 benchmarks/muon_step.py --preset 1b
CPU smoke run (gloo):
    torchrun --nproc-per-node 2 benchmarks/muon_step.py --preset demo --device cpu --iters 2
``--split off`` steps every matrix on its owner alone (``parallelize(split=False)``); by
default large matrices are shared where balance needs it ([Note: split Newton–Schulz] in
aligndp/plan/split.py), e.g. 1b at 8 GPUs.

Only the optimizer is timed, on the hidden matrices of ``GPT(PRESETS[preset])`` (64 for
``1b``) as routed by :func:`aligndp.plan.routing.route_params`, bf16 params on GPU:
  torch_muon_1gpu  rank 0 alone: ``torch.optim.Muon`` on fp32 masters of every matrix, then the
                   cast back into the bf16 params (what one GPU without data parallelism does)
  aligndp          ``parallelize(optimizer="muon", sharding="zero1")``: each rank steps the
                   matrices it owns (fp32 masters) + all-gather of the layer-wise buffer
  ratio            aligndp / torch_muon_1gpu (ideal ~ 1/dp_size plus the all-gather)
Gradients are random and reduced once before timing; each timed call is one ``opt.step()``.
JSON lines on rank 0.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch
import torch.distributed as dist
import torch.nn as nn
from _bench import Timing, add_common_arguments, build_gpt, device_label, init, log

import aligndp
from aligndp.plan.routing import route_params


class Matrices(nn.Module):
    """Just the Muon matrices of a model, under their own names (nothing else is timed)."""

    def __init__(self, named: dict[str, torch.Tensor]):
        super().__init__()
        self.names = list(named)
        for i, t in enumerate(named.values()):
            self.register_parameter(f"m{i}", nn.Parameter(t.detach().clone()))


def hidden_matrices(
    preset: str, device: torch.device, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """The matrices :func:`aligndp.plan.routing.route_params` gives Muon in
    ``GPT(PRESETS[preset])``."""
    gpt = build_gpt(preset, device, dtype)
    named = dict(gpt.named_parameters())
    return {n: named[n] for n in route_params(gpt).whole}


def torch_muon_1gpu(matrices: dict[str, torch.Tensor], timing: Timing) -> float:
    """Seconds per one-GPU step: torch's Muon over fp32 masters of every matrix, cast back into
    the params, on rank 0 alone (the other ranks only keep time with it)."""
    params = [t.detach().clone() for t in matrices.values()]
    masters = [p.float() for p in params]
    for m in masters:
        m.grad = torch.randn_like(m) * 1e-3
    single = torch.optim.Muon(masters, lr=0.02)
    rank = dist.get_rank()

    def single_step() -> None:
        if rank == 0:
            single.step()
            torch._foreach_copy_(params, masters)

    return timing(single_step)


@dataclasses.dataclass(frozen=True)
class MuonStep:
    """One layer-wise Muon measurement."""

    seconds: float
    buckets: int
    owned: int
    """Matrices this rank steps."""
    shared: int
    """Split matrices this rank has a part of."""
    imbalance: float
    padding_fraction: float


def aligndp_muon_step(
    matrices: dict[str, torch.Tensor], timing: Timing, *, bucket_numel: int, split: bool = True
) -> MuonStep:
    """Seconds per ``opt.step()`` of ``parallelize(optimizer="muon", sharding="zero1")``: owners
    step their matrices whole, then one all-gather of the layer-wise buffer."""
    model, opt = aligndp.parallelize(
        Matrices(matrices),
        optimizer="muon",
        sharding="zero1",
        lr=0.02,
        bucket_numel=bucket_numel,
        grad_dtype=torch.float32,
        split=None if split else False,
    )
    # one real backward, so that every matrix has a reduced gradient and is stepped (a param
    # without one is skipped, as in torch); then random "reduced" gradients that every timed
    # step reuses
    sum(p.float().sum() for p in model.module.parameters()).backward()
    for buf in model.flat_buffers:
        buf.grad_data.normal_(0, 1e-3)
    before = [p.detach().clone() for p in model.module.parameters()]
    opt.step()
    moved = sum(not torch.equal(a, p) for a, p in zip(before, model.module.parameters()))
    assert moved == len(before), f"only {moved} of {len(before)} matrices were stepped"
    seconds = timing(opt.step)
    return MuonStep(
        seconds,
        len(model.layouts[0].buckets),
        len(opt.parts[0].owned),
        len(opt.parts[0].splits),
        opt.imbalance,
        opt.padding_fraction,
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    add_common_arguments(ap)
    ap.add_argument("--bucket-numel", type=int, default=40_000_000)
    ap.add_argument("--split", choices=["default", "off"], default="default")
    args = ap.parse_args()

    device, dtype = init(args.device)
    timing = Timing(device, args.iters, args.warmup)
    matrices = hidden_matrices(args.preset, device, dtype)
    numel = sum(t.numel() for t in matrices.values())
    log(
        what="env",
        torch=torch.__version__,
        world_size=dist.get_world_size(),
        device=device_label(device),
        preset=args.preset,
        matrices=len(matrices),
        numel=numel,
        dtype=str(dtype),
    )
    torch_s = torch_muon_1gpu(matrices, timing)
    log(what="torch_muon_1gpu", ms=1e3 * torch_s)
    r = aligndp_muon_step(
        matrices, timing, bucket_numel=args.bucket_numel, split=args.split == "default"
    )
    log(
        what="aligndp",
        ms=1e3 * r.seconds,
        dp_size=dist.get_world_size(),
        buckets=r.buckets,
        owned=r.owned,
        shared=r.shared,
        split=args.split,
        imbalance=round(r.imbalance, 4),
        padding_fraction=round(r.padding_fraction, 6),
    )
    log(what="ratio", ratio=r.seconds / torch_s, goal=0.55)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
