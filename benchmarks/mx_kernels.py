"""MXFP8 / FP8 kernels vs their peers on one GPU: quantise bandwidth and wgrad GEMM throughput.

Prints a markdown table (and writes it to ``--out``). Peers, all run in the same process:
device copy bandwidth; cuBLAS bf16 matmul (alone and + ``add_`` into an fp32 main_grad);
``torch._scaled_mm`` fp8, per-tensor and (where this torch/cuBLAS has it) 1x128 blockwise,
each + ``add_``; and dequantise-to-bf16 with torch ops + cuBLAS + ``add_`` (the MXFP8 peer
named by the issue). Every kernel of ours is first checked against a float64 reference on
the same data, so a fast wrong kernel cannot print a rate.
Usage: ``python benchmarks/mx_kernels.py [--size 8192] [--out results.md]``.
"""

from __future__ import annotations

import argparse
import datetime

import torch
from triton.testing import do_bench, do_bench_cudagraph

from aligndp.lowp.recipe import ScaleFormat
from aligndp.lowp.triton_kernels import dequantize_operand, quantize_rows_and_columns, scaled_gemm


def tflops(m, n, k, ms):
    return 2 * m * n * k / ms / 1e9


def dequant_torch(op, block, scale_format):
    """(rows, K) operand back to float32 with torch ops (the dequant peer's first step)."""
    scale = op.scale_t
    if scale_format is ScaleFormat.E8M0:
        scale = torch.where(
            scale == 0,
            torch.tensor(2.0**-127, device=scale.device),
            (scale.to(torch.int32) << 23).view(torch.float32),
        )
    return op.data.float() * scale.T.repeat_interleave(block, dim=1)


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def copy_ms(numel: int, dev, *, graph: bool) -> float:
    """Median ms of a device copy of ``numel`` bf16 elements into a preallocated tensor (the
    bandwidth peer: it moves ``4 * numel`` bytes), under ``do_bench`` or ``do_bench_cudagraph``."""
    big = torch.empty(numel, device=dev, dtype=torch.bfloat16)
    dst = torch.empty_like(big)
    if graph:
        return do_bench_cudagraph(lambda: dst.copy_(big), return_mode="median")
    return do_bench(lambda: dst.copy_(big))


def quantise_bytes(
    n: int, *, block: int, scale_format: ScaleFormat, rowwise: bool, colwise: bool
) -> int:
    """Bytes one quantise of an (n, n) bf16 tensor moves: read it, write each requested fp8
    copy and its scales (one E8M0 byte per 32, or one fp32 per 128)."""
    scale_bytes = n * n // block * (1 if scale_format is ScaleFormat.E8M0 else 4)
    return 2 * n * n + (rowwise + colwise) * (n * n + scale_bytes)


def quantise_ms(
    x, *, block: int, scale_format: ScaleFormat, rowwise: bool, colwise: bool, impl: str = "auto"
) -> float:
    """Median ms of one quantise of ``x`` under ``do_bench_cudagraph`` (Python and launch
    time, which can exceed these kernels' GPU time, are not measured)."""
    return do_bench_cudagraph(
        lambda: quantize_rows_and_columns(
            x, block=block, scale_format=scale_format, rowwise=rowwise, colwise=colwise, impl=impl
        ),
        return_mode="median",
    )


def bf16_wgrad_peer_ms(x, dy, main_grad) -> tuple[float, float]:
    """Median ms of cuBLAS bf16 ``x @ dy.T`` alone, and of the wgrad ``dy^T x`` + ``add_`` into
    fp32 ``main_grad`` (what an in-place wgrad kernel replaces)."""
    alone = do_bench(lambda: x @ dy.T)
    dyt, xt = dy.T.contiguous(), x.T.contiguous()
    return alone, do_bench(lambda: main_grad.add_(dyt @ xt.T))


def wgrad_operands(dy, x, *, block: int, scale_format: ScaleFormat):
    """The column-quantised operands of the wgrad GEMM ``dy^T x``."""
    _, a = quantize_rows_and_columns(dy, block=block, scale_format=scale_format, rowwise=False)
    _, b = quantize_rows_and_columns(x, block=block, scale_format=scale_format, rowwise=False)
    return a, b


def wgrad_rel_err(a, b, *, block: int, scale_format: ScaleFormat, sub: int = 1024) -> float:
    """Relative error of our in-place wgrad GEMM against float64 on a (sub, sub) corner of the
    benchmark's own operands: checked before any timing, so a fast wrong kernel prints no rate."""
    sub = min(sub, a.data.shape[0], b.data.shape[0])
    a_sub = type(a)(a.data[:sub].contiguous(), a.scale_t[:, :sub].contiguous())
    b_sub = type(b)(b.data[:sub].contiguous(), b.scale_t[:, :sub].contiguous())
    start = torch.randn(sub, sub, device=a.data.device)
    got = scaled_gemm(
        a_sub, b_sub, start.clone(), block=block, scale_format=scale_format, accumulate=True
    )
    return rel_err(
        got,
        start.double()
        + dequant_torch(a_sub, block, scale_format).double()
        @ dequant_torch(b_sub, block, scale_format).double().T,
    )


def wgrad_ms(
    a, b, main_grad, *, block: int, scale_format: ScaleFormat, impl: str = "auto"
) -> float:
    """Median ms of our wgrad GEMM accumulating in place into ``main_grad``."""
    return do_bench(
        lambda: scaled_gemm(
            a, b, main_grad, block=block, scale_format=scale_format, accumulate=True, impl=impl
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", type=int, default=8192)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    n = args.size
    dev = "cuda"
    rows = [
        f"# mx_kernels {datetime.date.today()} on {torch.cuda.get_device_name()}, "
        f"torch {torch.__version__}",
        "",
        f"M = N = K = {n} (wgrad: out = in = tokens = {n}); GEMMs: do_bench median ms (L2 flushed "
        "between calls); memory-bound kernels and their copy peer: do_bench_cudagraph median (a "
        "graph of back-to-back calls, so Python and launch time per call, which can exceed these "
        "kernels' GPU time, is not measured; one row shows the same call under plain do_bench)",
        "",
        "| what | ms | rate | vs peer |",
        "| --- | --- | --- | --- |",
    ]

    def row(what, ms, rate, peer=""):
        rows.append(f"| {what} | {ms:.3f} | {rate} | {peer} |")
        print(rows[-1], flush=True)

    torch.manual_seed(0)
    x = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    dy = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    main_grad = torch.zeros(n, n, device=dev, dtype=torch.float32)
    copy_numel = 4 * n * n
    ms = copy_ms(copy_numel, dev, graph=False)
    copy_tbs = 2 * copy_numel * 2 / ms / 1e9
    row(
        f"peer: device copy ({copy_numel * 2 >> 20} MiB into a preallocated tensor), read + write, "
        "do_bench",
        ms,
        f"{copy_tbs:.2f} TB/s",
    )
    ms = copy_ms(copy_numel, dev, graph=True)
    row("peer: the same copy, do_bench_cudagraph", ms, f"{2 * copy_numel * 2 / ms / 1e9:.2f} TB/s")
    copy_tbs = max(copy_tbs, 2 * copy_numel * 2 / ms / 1e9)
    rows.append(f"| (ratios 'of copy' below are to the faster copy: {copy_tbs:.2f} TB/s) | | | |")

    for name, block, scale_format in (
        ("MXFP8 1x32 e8m0", 32, ScaleFormat.E8M0),
        ("FP8 1x128 fp32", 128, ScaleFormat.FP32),
    ):
        for impl, what, rw, cw in (
            ("auto", "row+col in one pass", True, True),
            ("auto", "row only", True, False),
            ("auto", "col only (the wgrad operand)", False, True),
            ("triton", "row+col, plain-Triton fallback kernel", True, True),
        ):
            ms = quantise_ms(
                x, block=block, scale_format=scale_format, rowwise=rw, colwise=cw, impl=impl
            )
            tbs = (
                quantise_bytes(n, block=block, scale_format=scale_format, rowwise=rw, colwise=cw)
                / ms
                / 1e9
            )
            row(
                f"ours: quantise {name}, {what} (bf16 in)",
                ms,
                f"{tbs:.2f} TB/s",
                f"{tbs / copy_tbs:.2f} of copy",
            )

    ms = do_bench(lambda: quantize_rows_and_columns(x))
    row(
        "ours: quantise MXFP8 row+col, plain do_bench (Python + launch included)",
        ms,
        f"{(4 * n * n + 2 * n * n // 32) / ms / 1e9:.2f} TB/s",
    )
    ms_bf16, ms_bf16_add = bf16_wgrad_peer_ms(x, dy, main_grad)
    row("peer: cuBLAS bf16 matmul", ms_bf16, f"{tflops(n, n, n, ms_bf16):.0f} TFLOP/s")
    row(
        "peer: cuBLAS bf16 matmul + add_ into fp32 main_grad",
        ms_bf16_add,
        f"{tflops(n, n, n, ms_bf16_add):.0f} TFLOP/s",
    )

    dyt, xt = dy.T.contiguous(), x.T.contiguous()
    a8, b8 = dyt.to(torch.float8_e4m3fn), xt.to(torch.float8_e4m3fn)
    one = torch.ones((), device=dev)
    ms = do_bench(
        lambda: torch._scaled_mm(a8, b8.T, scale_a=one, scale_b=one, out_dtype=torch.float32)
    )
    row("peer: _scaled_mm fp8 per-tensor (fp32 out)", ms, f"{tflops(n, n, n, ms):.0f} TFLOP/s")
    ms_sm = do_bench(
        lambda: main_grad.add_(
            torch._scaled_mm(a8, b8.T, scale_a=one, scale_b=one, out_dtype=torch.float32)
        )
    )
    row(
        "peer: _scaled_mm fp8 per-tensor + add_ into fp32 main_grad",
        ms_sm,
        f"{tflops(n, n, n, ms_sm):.0f} TFLOP/s",
    )

    for name, block, scale_format in (
        ("MXFP8", 32, ScaleFormat.E8M0),
        ("FP8 1x128", 128, ScaleFormat.FP32),
    ):
        a, b = wgrad_operands(dy, x, block=block, scale_format=scale_format)
        err = wgrad_rel_err(
            a, b, block=block, scale_format=scale_format
        )  # correctness on the benchmark's own data first
        peer = ms_sm
        if scale_format is ScaleFormat.E8M0:
            ms = do_bench(
                lambda a=a, b=b, block=block, fmt=scale_format: main_grad.add_(
                    dequant_torch(a, block, fmt).bfloat16()
                    @ dequant_torch(b, block, fmt).bfloat16().T
                )
            )
            row(
                "peer: MXFP8 dequant (torch ops) -> bf16 -> cuBLAS + add_",
                ms,
                f"{tflops(n, n, n, ms):.0f} TFLOP/s",
            )
            peer = ms
            da, db = dequantize_operand(a), dequantize_operand(b)
            ms = do_bench(lambda da=da, db=db: main_grad.add_(da @ db.T))
            row(
                "peer: cuBLAS on pre-dequantised bf16 + add_",
                ms,
                f"{tflops(n, n, n, ms):.0f} TFLOP/s",
            )
            del da, db
            ms = do_bench_cudagraph(lambda b=b: dequantize_operand(b), return_mode="median")
            row(
                "ours: MXFP8 dequantise pass (one operand, fp8 + e8m0 -> bf16)",
                ms,
                f"{3 * n * n / ms / 1e9:.2f} TB/s",
                f"{3 * n * n / ms / 1e9 / copy_tbs:.2f} of copy",
            )
        else:
            try:  # cuBLAS blockwise 1x128 x 1x128 (scales outer-dim-major), where available
                sa, sb = a.scale_t.T, b.scale_t
                ms = do_bench(
                    lambda a=a, b=b, sa=sa, sb=sb: main_grad.add_(
                        torch._scaled_mm(
                            a.data, b.data.T, scale_a=sa, scale_b=sb, out_dtype=torch.float32
                        )
                    )
                )
                row(
                    "peer: _scaled_mm fp8 1x128 blockwise + add_ into fp32 main_grad",
                    ms,
                    f"{tflops(n, n, n, ms):.0f} TFLOP/s",
                )
                peer = ms
            except RuntimeError as err_sm:
                first_line = str(err_sm).splitlines()[0][:90]
                rows.append(f"| peer: _scaled_mm fp8 1x128 blockwise | failed | {first_line} | |")
                print(rows[-1])
        ms = wgrad_ms(a, b, main_grad, block=block, scale_format=scale_format)
        row(
            f"ours: {name} wgrad GEMM accumulating in place into fp32 main_grad "
            f"(rel err {err:.1e})",
            ms,
            f"{tflops(n, n, n, ms):.0f} TFLOP/s",
            f"{peer / ms:.2f}x the peer above; {ms_bf16_add / ms:.2f}x cuBLAS bf16+add_",
        )
        if scale_format is ScaleFormat.FP32:  # the plain-Triton 1x128 kernel, Gluon's fallback
            ms = wgrad_ms(a, b, main_grad, block=block, scale_format=scale_format, impl="triton")
            row(
                f"ours: {name} wgrad GEMM, plain-Triton fallback kernel, fp32 main_grad",
                ms,
                f"{tflops(n, n, n, ms):.0f} TFLOP/s",
                f"{peer / ms:.2f}x the peer above",
            )
        bf16_grad = main_grad.to(torch.bfloat16)
        ms = wgrad_ms(a, b, bf16_grad, block=block, scale_format=scale_format)
        row(
            f"ours: {name} wgrad GEMM accumulating in place into bf16 main_grad",
            ms,
            f"{tflops(n, n, n, ms):.0f} TFLOP/s",
        )
        ms = do_bench(
            lambda a=a, b=b, block=block, fmt=scale_format: (
                quantize_rows_and_columns(dy, block=block, scale_format=fmt, rowwise=False),
                quantize_rows_and_columns(x, block=block, scale_format=fmt, rowwise=False),
                scaled_gemm(a, b, main_grad, block=block, scale_format=fmt, accumulate=True),
            )
        )
        row(
            f"ours: {name} quantise both + wgrad GEMM (end to end)",
            ms,
            f"{tflops(n, n, n, ms):.0f} TFLOP/s",
        )
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
