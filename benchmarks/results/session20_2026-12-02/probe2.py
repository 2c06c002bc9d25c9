"""Session 20 probe 2 (call 8): decode tiles beyond probe.py's six, on 1b's four weight shapes.
torchrun --nproc-per-node 1 .gpu/s20/probe2.py"""

import statistics

import torch

from aligndp.lowp import fp8_gather_kernels as K


def t(fn):
    for _ in range(3):
        fn()
    ms = []
    for _ in range(20):
        a, b = torch.cuda.Event(True), torch.cuda.Event(True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ms.append(a.elapsed_time(b))
    return statistics.median(ms)


shapes = [(6144, 2048), (2048, 2048), (8192, 2048), (2048, 8192)]
masters = [torch.randn(r * c, device="cuda") for r, c in shapes]
scales = torch.stack([m.abs().max() / 448 for m in masters])
outs = [torch.empty(m.numel(), dtype=torch.float8_e4m3fn, device="cuda") for m in masters]
K.encode(masters, scales, [0, 1, 2, 3], outs)
datas = [o.view(s) for o, s in zip(outs, shapes)]
values = [torch.empty(s, dtype=torch.bfloat16, device="cuda") for s in shapes]
trans = [torch.empty(s[::-1], dtype=torch.float8_e4m3fn, device="cuda") for s in shapes]
slots = torch.zeros(4 * K.SCALE_STRIDE, device="cuda")
n = sum(m.numel() for m in masters)
want_t = [d.t().contiguous().view(torch.uint8) for d in datas]
want_v = [torch.mul(d.float(), s).to(torch.bfloat16) for d, s in zip(datas, scales)]
tiles = [
    (64, 128, 4),
    (64, 128, 8),
    (64, 256, 4),
    (64, 256, 8),
    (32, 256, 4),
    (128, 128, 16),
    (128, 256, 8),
    (32, 128, 2),
    (16, 256, 4),
    (128, 64, 8),
]
for rnd in range(2):
    for tile in tiles:
        K.DECODE_TILE = tile
        for x in trans:
            x.view(torch.uint8).zero_()
        ms = t(lambda: K.decode(datas, scales, values, trans, slots))
        ok = all(torch.equal(a.view(torch.uint8), b) for a, b in zip(trans, want_t)) and all(
            torch.equal(a, b) for a, b in zip(values, want_v)
        )
        print(
            f"round {rnd} decode tile {tile}: {ms * 1e3:.1f} us, "
            f"{4 * n / ms / 1e9:.2f} TB/s, right={ok}",
            flush=True,
        )
copy = torch.empty(n * 4, dtype=torch.uint8, device="cuda")
src = torch.empty_like(copy)
ms = t(lambda: copy.copy_(src))
print(f"device copy of the same bytes: {ms * 1e3:.1f} us, {2 * copy.numel() / ms / 1e9:.2f} TB/s")
