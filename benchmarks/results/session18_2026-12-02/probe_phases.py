"""gpt2-small, one GPU, inductor: host ms per phase and GPU kernel ms per step, interleaved
rounds, of KINDS among: torch (fused AdamW) | torch_sub (its params of a trivial
nn.Parameter subclass) | torch_flat (params as views of one flat buffer) | aligndp |
aligndp_plain (aligndp's params given back the nn.Parameter class) | aligndp_torchopt
(aligndp's model, torch fused AdamW over its params). SRC: the aligndp source measured.
Usage: KINDS=torch,aligndp ROUNDS=10 python probe_phases.py"""

import collections
import os
import statistics
import sys
import time

sys.path[:0] = [os.environ.get("SRC", "src"), "benchmarks"]  # SRC: the code measured
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import aligndp  # noqa: E402

print("aligndp from", aligndp.__file__)
from aligndp.models.gpt import GPT, PRESETS  # noqa: E402

dist.init_process_group(
    "nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=torch.device("cuda:0")
)
cfg = PRESETS[os.environ.get("PRESET", "gpt2-small")]
B = int(os.environ.get("B", "8"))
dev = torch.device("cuda")
KINDS = os.environ.get("KINDS", "torch,torch_flat,aligndp,aligndp_torchopt").split(",")


class Sub(torch.nn.Parameter):
    pass


def build(kind):
    torch.manual_seed(0)
    net = GPT(cfg).to(dev)
    if kind in ("torch", "torch_sub"):
        if kind == "torch_sub":
            for p in net.parameters():
                p.__class__ = Sub
        model, opt = net, torch.optim.AdamW(net.parameters(), lr=3e-4, fused=True)
    elif kind == "torch_flat":
        ps = list(net.parameters())
        flat = torch.empty(sum((p.numel() + 63) // 64 * 64 for p in ps), device=dev)
        o = 0
        with torch.no_grad():
            for p in ps:
                n = p.numel()
                flat[o : o + n].copy_(p.reshape(-1))
                p.data = flat[o : o + n].view_as(p)
                o += (n + 63) // 64 * 64
        model, opt = net, torch.optim.AdamW(net.parameters(), lr=3e-4, fused=True)
    elif kind in ("aligndp", "aligndp_plain"):
        model, opt = aligndp.parallelize(net, optimizer="adamw", lr=3e-4)
        if kind == "aligndp_plain":
            for p in net.parameters():
                p.__class__ = torch.nn.Parameter
    else:
        model, _ = aligndp.parallelize(net, optimizer="adamw", lr=3e-4)
        topt = torch.optim.AdamW(net.parameters(), lr=3e-4, fused=True)

        class TorchStep:
            def step(self):
                topt.step()

            def zero_grad(self):
                model.zero_grad()

        opt = TorchStep()
    return torch.compile(model), opt


gen = torch.Generator().manual_seed(0)
xs = [torch.randint(cfg.vocab_size, (2, B, cfg.seq_len), generator=gen).to(dev) for _ in range(8)]
variants = {k: build(k) for k in KINDS}
P = ("fwd", "bwd", "step", "zero")
phases = {k: {p: [] for p in P} for k in variants}
walls = {k: [] for k in variants}


def step(k, i, record=True):
    cm, opt = variants[k]
    x, y = xs[i % len(xs)]
    t0 = time.perf_counter()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = cm(x, y)
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    opt.step()
    t3 = time.perf_counter()
    opt.zero_grad()
    t4 = time.perf_counter()
    if record:
        for p, d in zip(P, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            phases[k][p].append(d * 1e3)


for k in variants:
    for i in range(6):
        step(k, i, record=False)
torch.cuda.synchronize()
for _ in range(int(os.environ.get("ROUNDS", "6"))):
    for k in variants:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(10):
            step(k, i)
        torch.cuda.synchronize()
        walls[k].append((time.perf_counter() - t0) / 10 * 1e3)
base = statistics.median(walls[KINDS[0]])
for k in variants:
    med = {p: statistics.median(v) for p, v in phases[k].items()}
    w = statistics.median(walls[k])
    print(
        f"{k:17s} wall {w:.2f} ({w / base:.3f})  "
        + "  ".join(f"{p} {m:.3f}" for p, m in med.items())
        + f"  host-sum {sum(med.values()):.3f} ms"
    )
ref: dict = {}
for k in variants:
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(5):
            step(k, i, record=False)
        torch.cuda.synchronize()
    per = collections.defaultdict(float)
    n = 0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per[e.name[:70]] += (e.time_range.end - e.time_range.start) / 1e3 / 5
            n += 1
    print(f"{k:17s} GPU kernel ms/step {sum(per.values()):.3f}  launches/step {n / 5:.0f}")
    if k != KINDS[0]:
        d = {m: per[m] - ref.get(m, 0) for m in set(per) | set(ref)}
        for m, v in sorted(d.items(), key=lambda t: -abs(t[1]))[:6]:
            print(f"    {v:+.3f} {m}")
    else:
        ref = dict(per)
dist.destroy_process_group()
