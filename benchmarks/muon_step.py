"""Layer-wise Muon step against one-GPU torch.optim.Muon over the same matrices, in one run.

GPU (the figure we report; goal: ratio <= 0.55 at dp 2):
    torchrun --nproc-per-node 2 benchmarks/muon_step.py --preset 1b
CPU smoke run (gloo):
    torchrun --nproc-per-node 2 benchmarks/muon_step.py --preset demo --device cpu --iters 2

Only the optimizer is timed, on the hidden matrices of ``GPT(PRESETS[preset])`` (64 for
``1b``) as routed by :func:`aligndp.routing.route_params`, bf16 params on GPU:
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

import torch
import torch.distributed as dist
import torch.nn as nn

import aligndp
from aligndp.models.gpt import GPT, PRESETS
from aligndp.routing import route_params
from _bench import add_common_arguments, device_label, init, log, timed


class Matrices(nn.Module):
    """Just the Muon matrices of a model, under their own names (nothing else is timed)."""

    def __init__(self, named: dict[str, torch.Tensor]):
        super().__init__()
        self.names = list(named)
        for i, t in enumerate(named.values()):
            self.register_parameter(f"m{i}", nn.Parameter(t.detach().clone()))


def main() -> None:
    ap = argparse.ArgumentParser()
    add_common_arguments(ap)
    ap.add_argument("--bucket-numel", type=int, default=40_000_000)
    args = ap.parse_args()

    device, dtype = init(args.device)
    ws, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    with torch.device(device):
        gpt = GPT(PRESETS[args.preset]).to(dtype)
    named = dict(gpt.named_parameters())
    matrices = {n: named[n] for n in route_params(gpt).muon}
    del gpt, named
    numel = sum(t.numel() for t in matrices.values())
    log(what="env", torch=torch.__version__, world_size=ws, device=device_label(device),
        preset=args.preset, matrices=len(matrices), numel=numel, dtype=str(dtype))

    # one GPU: torch's Muon over fp32 masters of every matrix, cast back into the params
    params = [t.detach().clone() for t in matrices.values()]
    masters = [p.float() for p in params]
    for m in masters:
        m.grad = torch.randn_like(m) * 1e-3
    single = torch.optim.Muon(masters, lr=0.02)

    def single_step() -> None:
        if rank == 0:
            single.step()
            torch._foreach_copy_(params, masters)

    torch_s = timed(single_step, device=device, iters=args.iters, warmup=args.warmup)
    del single, masters, params
    log(what="torch_muon_1gpu", ms=1e3 * torch_s)

    # aligndp: owners step their matrices whole, then one all-gather of the layer-wise buffer
    model, opt = aligndp.parallelize(Matrices(matrices), optimizer="muon", sharding="zero1", lr=0.02,
                                     bucket_numel=args.bucket_numel, grad_dtype=torch.float32)
    model.finish_grad_sync()  # no backward: mark this step's gradients as synced, then fill them
    for buf in model.flat_buffers:
        buf.grad_data.normal_(0, 1e-3)  # every timed step reuses these "reduced" gradients
    aligndp_s = timed(opt.step, device=device, iters=args.iters, warmup=args.warmup)
    layout = model.layouts[0]
    log(what="aligndp", ms=1e3 * aligndp_s, dp_size=ws, buckets=len(layout.buckets),
        owned=len(opt.parts[0].owned), imbalance=round(opt.imbalance, 4),
        padding_fraction=round(opt.padding_fraction, 6))
    log(what="ratio", ratio=aligndp_s / torch_s, goal=0.55)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
