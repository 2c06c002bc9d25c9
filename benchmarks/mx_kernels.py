"""MXFP8 / FP8 kernels vs their peers on one GPU: quantise bandwidth and wgrad GEMM throughput.

Prints a markdown table (and writes it to ``--out``). Peers, all run in the same process:
device copy bandwidth, cuBLAS bf16 matmul (alone and + add_ into an fp32 main_grad),
``torch._scaled_mm`` per-tensor fp8 + add_, and dequantise-to-bf16 + cuBLAS + add_.
Usage: ``python benchmarks/mx_kernels.py [--size 8192] [--out results.md]``.
"""
from __future__ import annotations

import argparse
import datetime

import torch
from triton.testing import do_bench

from aligndp.mx.triton_kernels import quantize_rows_and_columns, scaled_gemm


def tflops(m, n, k, ms):
    return 2 * m * n * k / ms / 1e9


def dequant_bf16(op, block):
    """(rows, K) operand back to bf16 with torch ops (the dequant peer)."""
    scale = (op.scale_t.to(torch.int32) << 23).view(torch.float32).T  # (rows, K / block)
    return (op.data.float() * scale.repeat_interleave(block, dim=1)).to(torch.bfloat16)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", type=int, default=8192)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    n = args.size
    dev = "cuda"
    rows = [f"# mx_kernels {datetime.date.today()} on {torch.cuda.get_device_name()}, torch {torch.__version__}",
            "", f"M = N = K = {n} (wgrad: out = in = tokens = {n}); do_bench median ms", "",
            "| what | ms | rate | vs peer |", "| --- | --- | --- | --- |"]

    def row(what, ms, rate, peer=""):
        rows.append(f"| {what} | {ms:.3f} | {rate} | {peer} |")
        print(rows[-1], flush=True)

    torch.manual_seed(0)
    x = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    dy = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    main_grad = torch.zeros(n, n, device=dev, dtype=torch.float32)
    big = torch.empty(4 * n * n, device=dev, dtype=torch.bfloat16)
    ms = do_bench(lambda: big.clone())
    copy_tbs = 2 * big.numel() * 2 / ms / 1e9
    row("peer: device copy (clone), 128 MiB read + write", ms, f"{copy_tbs:.2f} TB/s")

    for name, block, mx in (("MXFP8 1x32 e8m0", 32, True), ("FP8 1x128 fp32", 128, False)):
        for tile in (64, 128, 256):
            if tile < block:
                continue
            ms = do_bench(lambda: quantize_rows_and_columns(x, block=block, mx=mx, tile=tile))
            scale_bytes = 2 * n * n // block * (1 if mx else 4)
            tbs = (2 * n * n + 2 * n * n + scale_bytes) / ms / 1e9
            row(f"ours: quantise {name}, row+col in one pass (bf16 in), tile {tile}", ms, f"{tbs:.2f} TB/s",
                f"{tbs / copy_tbs:.2f} of copy")

    ms_bf16 = do_bench(lambda: x @ dy.T)
    row("peer: cuBLAS bf16 matmul", ms_bf16, f"{tflops(n, n, n, ms_bf16):.0f} TFLOP/s")
    ms = do_bench(lambda: main_grad.add_(dy.T @ x))
    row("peer: cuBLAS bf16 matmul + add_ into fp32 main_grad", ms, f"{tflops(n, n, n, ms):.0f} TFLOP/s")

    a8 = dy.T.contiguous().to(torch.float8_e4m3fn)
    b8 = x.T.contiguous().to(torch.float8_e4m3fn)
    one = torch.ones((), device=dev)
    try:
        ms = do_bench(lambda: torch._scaled_mm(a8, b8.T, scale_a=one, scale_b=one, out_dtype=torch.float32))
        row("peer: _scaled_mm fp8 per-tensor (fp32 out)", ms, f"{tflops(n, n, n, ms):.0f} TFLOP/s")
        ms_sm = do_bench(lambda: main_grad.add_(torch._scaled_mm(a8, b8.T, scale_a=one, scale_b=one,
                                                                 out_dtype=torch.float32)))
        row("peer: _scaled_mm fp8 per-tensor + add_ into fp32 main_grad", ms_sm, f"{tflops(n, n, n, ms_sm):.0f} TFLOP/s")
    except RuntimeError as err:  # record, don't hide
        rows.append(f"| peer: _scaled_mm fp8 | failed | {str(err).splitlines()[0][:80]} | |")
        ms_sm = float("nan")

    for name, block, mx in (("MXFP8", 32, True), ("FP8 1x128", 128, False)):
        _, a = quantize_rows_and_columns(dy, block=block, mx=mx, rowwise=False)
        _, b = quantize_rows_and_columns(x, block=block, mx=mx, rowwise=False)
        if mx:
            ms = do_bench(lambda: main_grad.add_(dequant_bf16(a, block) @ dequant_bf16(b, block).T))
            row("peer: MXFP8 dequant -> bf16 -> cuBLAS + add_", ms, f"{tflops(n, n, n, ms):.0f} TFLOP/s")
            da, db = dequant_bf16(a, block), dequant_bf16(b, block)
            ms = do_bench(lambda: main_grad.add_(da @ db.T))
            row("peer: cuBLAS on pre-dequantised bf16 + add_", ms, f"{tflops(n, n, n, ms):.0f} TFLOP/s")
        ms = do_bench(lambda: scaled_gemm(a, b, main_grad, block=block, mx=mx, accumulate=True))
        row(f"ours: {name} wgrad GEMM accumulating in place into fp32 main_grad", ms,
            f"{tflops(n, n, n, ms):.0f} TFLOP/s", f"{ms_bf16 / ms:.2f}x cuBLAS bf16; {ms_sm / ms:.2f}x _scaled_mm+add_")
        bf16_grad = main_grad.to(torch.bfloat16)
        ms = do_bench(lambda: scaled_gemm(a, b, bf16_grad, block=block, mx=mx, accumulate=True))
        row(f"ours: {name} wgrad GEMM accumulating in place into bf16 main_grad", ms, f"{tflops(n, n, n, ms):.0f} TFLOP/s")
        ms = do_bench(lambda: (quantize_rows_and_columns(dy, block=block, mx=mx, rowwise=False),
                               quantize_rows_and_columns(x, block=block, mx=mx, rowwise=False),
                               scaled_gemm(a, b, main_grad, block=block, mx=mx, accumulate=True)))
        row(f"ours: {name} quantise both + wgrad GEMM (end to end)", ms, f"{tflops(n, n, n, ms):.0f} TFLOP/s")
    from aligndp.mx.triton_kernels import _scaled_gemm_kernel

    rows += ["", f"autotuned GEMM config (last shape): {_scaled_gemm_kernel.best_config}"]
    print(rows[-1])
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
