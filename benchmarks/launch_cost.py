"""Host microseconds per FP8 call, eager and through the custom ops a compiled graph calls,
cached launches ([Note: cheap launches] in aligndp/lowp/triton_launch.py) vs every launch
through ``kernel[grid]``, on one GPU.

Host time is the loop's wall time without a synchronize inside it; the tensors are small
(768 x 768 by default), so the GPU keeps up and the loop measures the host alone. Each row is
the best of ``--rounds`` rounds of ``--calls`` calls, the two ways interleaved.
Usage: ``python benchmarks/launch_cost.py [--size 768] [--calls 2000] [--rounds 5]``.
"""

from __future__ import annotations

import argparse
import time

import torch

import aligndp.lowp.fp8_tensor_kernels as fk
import aligndp.lowp.ops  # noqa: F401  (registers torch.ops.aligndp)
from aligndp.lowp.recipe import ScaleFormat
from aligndp.lowp.recipe_fp8_tensor import quantize_tensor
from aligndp.lowp.triton_kernels import quantize_rows_and_columns, scaled_gemm
from aligndp.lowp.triton_launch import through_triton


def host_us(fn, calls: int) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--size", type=int, default=768)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    n = args.size
    x = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    programs = fk._device_state(x.get_device())[2]
    amax = torch.zeros((), device="cuda")  # not the quantise's workspace, which casts reset
    block, unroll = fk.AMAX_LOOP
    grid = (max(1, min(-(-x.numel() // (block * unroll)), programs)),)
    workspace: dict = {}
    a = quantize_rows_and_columns(x, block=128, scale_format=ScaleFormat.FP32, colwise=False)[0]
    out = torch.empty(n, n, device="cuda")
    rows = {
        "fp8-tensor amax launch": lambda: fk._amax[grid](
            x, amax, x.numel(), BLOCK=block, UNROLL=unroll, num_warps=8
        ),
        "fp8-tensor quantize_tensor(transposed=True)": lambda: quantize_tensor(x, transposed=True),
        "  same, into a workspace (grad_out)": lambda: quantize_tensor(
            x, transposed=True, workspace=workspace
        ),
        "1x128 quantise, rows and columns": lambda: quantize_rows_and_columns(
            x, block=128, scale_format=ScaleFormat.FP32
        ),
        "1x128 GEMM into main_grad": lambda: scaled_gemm(
            a, a, out, block=128, scale_format=ScaleFormat.FP32, accumulate=True
        ),
        # what a compiled graph calls ([Note: compiled MX layers] in aligndp/lowp/ops.py)
        "compiled: 1x128 quantise op, rows and columns": lambda: torch.ops.aligndp.quantize_rc(
            x, 128, False, True, True
        ),
        "compiled: 1x128 GEMM op, bf16 out": lambda: torch.ops.aligndp.scaled_mm(
            a.data, a.scale_t, a.data, a.scale_t, 128, False, torch.bfloat16, None
        ),
    }
    print(f"host us per call, {n} x {n} bf16, {torch.cuda.get_device_name()}")
    print("| call | cached launches | kernel[grid] |\n|---|---|---|")
    for name, fn in rows.items():
        fn(), fn()  # compile and cache
        fast, slow = [], []
        for _ in range(args.rounds):
            fast.append(host_us(fn, args.calls))
            with through_triton():
                slow.append(host_us(fn, args.calls))
        print(f"| {name} | {min(fast):.1f} | {min(slow):.1f} |")


if __name__ == "__main__":
    main()
