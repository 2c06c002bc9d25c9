"""Session 20 probe, calls 3 and 4 (torchrun --nproc-per-node 1 .gpu/s20/probe.py):

(A) ``kernels()``, call 3: GPU time of the FP8 gather codec kernels' variants on 1b's four
weight shapes, run against the kernel module as it was then (a ``RELOAD_T`` switch, a tunable
``ENCODE_WARPS``), since folded into the winners;
(B) ``host()``, call 4: host profile (cProfile) of the 1b ZeRO-1 fp8-tensor step, bf16 vs FP8
gathers, dp 1.
"""

import cProfile
import io
import pstats
import statistics
import sys

sys.path.insert(0, "benchmarks")
import torch
import torch.distributed as dist

from aligndp.lowp import fp8_gather_kernels as K


def kernels():
    shapes = [(6144, 2048), (2048, 2048), (8192, 2048), (2048, 8192)]
    masters = [torch.randn(r * c, device="cuda") for r, c in shapes]
    scales = torch.stack([m.abs().max() / 448 for m in masters])
    outs = [torch.empty(m.numel(), dtype=torch.float8_e4m3fn, device="cuda") for m in masters]
    datas = [o.view(s) for o, s in zip(outs, shapes)]
    values = [torch.empty(s, dtype=torch.bfloat16, device="cuda") for s in shapes]
    trans = [torch.empty(s[::-1], dtype=torch.float8_e4m3fn, device="cuda") for s in shapes]
    slots = torch.zeros(4 * K.SCALE_STRIDE, device="cuda")
    n = sum(m.numel() for m in masters)

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

    ref = None
    for block in (2048, 4096, 8192, 16384):
        for warps in (4, 8):
            K.ENCODE_BLOCK, K.ENCODE_WARPS = block, warps
            ms = t(lambda: K.encode(masters, scales, [0, 1, 2, 3], outs))
            print(
                f"encode block {block} warps {warps}: {ms * 1e3:.1f} us, "
                f"{5 * n / ms / 1e9:.2f} TB/s",
                flush=True,
            )
    K.ENCODE_BLOCK, K.ENCODE_WARPS = 4096, 8
    K.encode(masters, scales, [0, 1, 2, 3], outs)
    for reload in (True, False):
        for tile in (
            (64, 64, 4),
            (64, 128, 4),
            (128, 64, 4),
            (128, 128, 4),
            (128, 128, 8),
            (32, 128, 4),
        ):
            K.RELOAD_T, K.DECODE_TILE = reload, tile
            ms = t(lambda: K.decode(datas, scales, values, trans, slots))
            got = [v.clone() for v in values] + [x.view(torch.uint8).clone() for x in trans]
            if ref is None:
                ref = got
            same = all(torch.equal(a, b) for a, b in zip(ref, got))
            print(
                f"decode reload_t={reload} tile {tile}: {ms * 1e3:.1f} us, "
                f"{4 * n / ms / 1e9:.2f} TB/s, same={same}",
                flush=True,
            )
    want = [d.t().contiguous().view(torch.uint8) for d in datas]
    print("transposes right:", all(torch.equal(a, b) for a, b in zip(want, ref[4:])))


def host():
    from _bench import build_gpt

    import aligndp
    from aligndp.lowp import convert_to_mxfp8
    from aligndp.models.gpt import PRESETS

    cfg_idx = torch.randint(0, PRESETS["1b"].vocab_size, (8, PRESETS["1b"].seq_len), device="cuda")
    for fp8 in (False, True):
        module = convert_to_mxfp8(
            build_gpt("1b", torch.device("cuda"), torch.bfloat16),
            backend="fp8-tensor",
            layers="pays",
        )
        ours, opt = aligndp.parallelize(
            module,
            sharding="zero1",
            lr=1e-4,
            bucket_numel=40_000_000,
            wgrad="fp8-tensor",
            fp8_param_gather=fp8,
            fused=True,
        )

        def step(ours=ours, opt=opt):
            ours(cfg_idx, cfg_idx).backward()
            opt.step()
            opt.zero_grad()

        for _ in range(3):
            step()
        torch.cuda.synchronize()
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(5):
            step()
        pr.disable()
        torch.cuda.synchronize()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(30)
        print(f"==== fp8_param_gather={fp8}\n" + s.getvalue()[:9000], flush=True)
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(45)
        print(s.getvalue()[:9000], flush=True)
        del ours, opt, module
        torch.cuda.empty_cache()


dist.init_process_group("nccl")
torch.cuda.set_device(0)
# kernels()  (call 3)
host()
dist.destroy_process_group()
