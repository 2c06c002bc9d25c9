"""One-rank per-step bookkeeping host us (gpt2-small's 148 params at width 16, CPU, gloo):
finish_grad_sync + zero_grad with autograd's gradients set, and opt.step of a fused AdamW."""

import dataclasses
import time

import torch
import torch.distributed as dist

import aligndp
from aligndp.models.gpt import GPT, PRESETS

torch.set_num_threads(1)
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
cfg = dataclasses.replace(PRESETS["gpt2-small"], dim=16, head_dim=8, vocab_size=64, seq_len=16)
torch.manual_seed(0)
model, opt = aligndp.parallelize(GPT(cfg), optimizer="adamw", lr=1e-3, fused=True)
x = torch.randint(cfg.vocab_size, (2, cfg.seq_len))
r = model.reducer
model(x, x).backward()
grads = [p.grad for p in r.params]
opt.zero_grad()


def best(fn, n=300):
    out = 1e9
    for _ in range(9):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        out = min(out, (time.perf_counter() - t0) / n * 1e6)
    return out


def book():
    for p, g in zip(r.params, grads):
        p.grad = g
    r.finish_grad_sync()
    r.zero_grad_buffer()


def setz():
    for p, g in zip(r.params, grads):
        p.grad = g
    r.zero_grad_buffer()


def step():
    for p, g in zip(r.params, grads):
        p.grad = g
    r.finish_grad_sync()
    opt.step()
    opt.zero_grad()


b, s, st = best(book), best(setz), best(step, 100)
print(
    f"finish_grad_sync {b - s:.1f} us  zero_grad_buffer+set {s:.1f} us  "
    f"step(fused AdamW)-book {st - b:.1f} us"
)
