"""What the 1x128 block promotion costs on a power-capped GPU: the FP8 1x128 wgrad GEMM next to
the same pipeline with the promotion left out, and cuBLAS's per-tensor and 1x128 GEMMs, each
accumulating into an fp32 main_grad, with the SM clock and board power read while each runs.

Every contender is timed in interleaved rounds (``do_bench`` median, L2 flushed between calls),
then run alone for ``--seconds`` while ``nvidia-smi`` is polled for the SM clock, the board power
and whether the software power cap is holding the clock down. TFLOP/s per watt (TFLOP per joule)
is the figure that matters when every contender sits at the cap. Ours is first checked against
float64 on the benchmark's own data; the no-promotion row is a measurement aid
(``fp8_block_gemm(promote=False)`` adds unscaled partials) checked against the unscaled product.
Usage: ``python benchmarks/fp8_power.py [--size 8192] [--rounds 5] [--seconds 2] [--out f.md]``.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import subprocess
import threading
import time

import torch
from triton.testing import do_bench

from aligndp.lowp import gluon_kernels
from aligndp.lowp.recipe import ScaleFormat
from aligndp.lowp.triton_kernels import quantize_rows_and_columns, scaled_gemm

_FIELDS = ("clocks.sm", "power.draw", "power.limit", "clocks_event_reasons.sw_power_cap")


def _smi_target(device: torch.device) -> str:
    try:
        return "GPU-" + str(torch.cuda.get_device_properties(device).uuid)
    except (AttributeError, RuntimeError):
        return str(torch.cuda.current_device())


def _smi(target: str, fields=_FIELDS) -> list[str]:
    out = subprocess.run(
        [
            "nvidia-smi",
            "-i",
            target,
            f"--query-gpu={','.join(fields)}",
            "--format=csv,noheader,nounits",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode != 0 and fields == _FIELDS:  # older drivers name the reason field differently
        return _smi(target, fields[:-1] + ("clocks_throttle_reasons.sw_power_cap",))
    return [v.strip() for v in out.stdout.strip().split(",")]


def sustained(fn, flops: float, seconds: float, target: str) -> dict:
    """Run ``fn`` back to back for ``seconds``; sample clocks and power from its second quarter
    on."""
    samples, stop = [], threading.Event()

    def poll():
        time.sleep(seconds / 4)
        while not stop.is_set():
            samples.append(_smi(target))
            time.sleep(0.2)

    fn()
    torch.cuda.synchronize()
    th = threading.Thread(target=poll)
    t0 = time.perf_counter()
    th.start()
    calls = 0
    while time.perf_counter() - t0 < seconds:
        fn()
        calls += 1
        if calls % 8 == 0:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    stop.set()
    th.join()
    mhz = [float(s[0]) for s in samples if s[0].replace(".", "").isdigit()]
    watts = [float(s[1]) for s in samples if s[1].replace(".", "").isdigit()]
    capped = [s[3] for s in samples if len(s) > 3]
    return dict(
        tflops=flops * calls / elapsed / 1e12,
        mhz=statistics.median(mhz) if mhz else float("nan"),
        watts=statistics.median(watts) if watts else float("nan"),
        limit=samples[0][2] if samples else "?",
        capped=f"{sum(c == 'Active' for c in capped)}/{len(capped)}",
        n=len(samples),
    )


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    n, dev = args.size, torch.device("cuda")
    flops = 2.0 * n**3
    target = _smi_target(dev)
    torch.manual_seed(0)
    dy = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    x = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    _, a = quantize_rows_and_columns(dy, block=128, scale_format=ScaleFormat.FP32, rowwise=False)
    _, b = quantize_rows_and_columns(x, block=128, scale_format=ScaleFormat.FP32, rowwise=False)
    del dy, x
    main_grad = torch.zeros(n, n, device=dev)

    # correctness on a corner of the benchmark's own data before any timing
    s = 1024
    a8, b8 = a.data[:s].contiguous(), b.data[:s].contiguous()
    sa, sb = a.scale_t[:, :s].contiguous(), b.scale_t[:, :s].contiguous()
    start = torch.randn(s, s, device=dev)

    def deq(data, scale_t):
        return data.double() * scale_t.T.double().repeat_interleave(128, dim=1)

    err = rel_err(
        gluon_kernels.fp8_block_gemm(a8, sa, b8, sb, start.clone(), accumulate=True),
        start.double() + deq(a8, sa) @ deq(b8, sb).T,
    )
    err_aid = rel_err(
        gluon_kernels.fp8_block_gemm(a8, sa, b8, sb, start.clone(), accumulate=True, promote=False),
        start.double() + a8.double() @ b8.double().T,
    )
    if err > 1e-3 or err_aid > 1e-3:
        raise SystemExit(
            f"kernel check failed: rel err {err:.2e} (ours), {err_aid:.2e} (no-promotion aid)"
        )

    one = torch.ones((), device=dev)
    contenders = {
        "ours: FP8 1x128 wgrad GEMM, in place (Gluon)": lambda: scaled_gemm(
            a, b, main_grad, block=128, scale_format=ScaleFormat.FP32, accumulate=True
        ),
        "aid: the same kernel with the promotion left out (adds unscaled partials)": lambda: (
            gluon_kernels.fp8_block_gemm(
                a.data, a.scale_t, b.data, b.scale_t, main_grad, accumulate=True, promote=False
            )
        ),
        "peer: cuBLAS _scaled_mm fp8 per-tensor + add_": lambda: main_grad.add_(
            torch._scaled_mm(a.data, b.data.T, scale_a=one, scale_b=one, out_dtype=torch.float32)
        ),
        "peer: cuBLAS _scaled_mm fp8 1x128 blockwise + add_": lambda: main_grad.add_(
            torch._scaled_mm(
                a.data, b.data.T, scale_a=a.scale_t.T, scale_b=b.scale_t, out_dtype=torch.float32
            )
        ),
    }
    rates = {k: [] for k in contenders}
    for _ in range(args.rounds):
        for k, fn in contenders.items():
            rates[k].append(flops / do_bench(fn, warmup=100, rep=300) / 1e9)
    rows = [
        f"# fp8_power {datetime.date.today()} on {torch.cuda.get_device_name(dev)}, "
        f"torch {torch.__version__}",
        "",
        f"M = N = K = {n}, fp32 main_grad accumulated in place; check on a {s}^2 corner: rel err "
        f"{err:.1e} vs float64 (ours), {err_aid:.1e} (aid vs the unscaled product). do_bench "
        f"median per round, {args.rounds} interleaved rounds; then {args.seconds:.0f} s of each "
        "alone with nvidia-smi polled (medians).",
        "",
        "| what | TFLOP/s, median (min-max) | sustained TFLOP/s | SM MHz | board W (limit) "
        "| power-capped samples | TFLOP/s per W |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for k, fn in contenders.items():
        r = sustained(fn, flops, args.seconds, target)
        med = statistics.median(rates[k])
        rows.append(
            f"| {k} | {med:.0f} ({min(rates[k]):.0f}-{max(rates[k]):.0f}) | {r['tflops']:.0f} "
            f"| {r['mhz']:.0f} | {r['watts']:.0f} ({r['limit']}) | {r['capped']} "
            f"| {r['tflops'] / r['watts']:.2f} |"
        )
        print(rows[-1], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(rows) + "\n")
    else:
        print("\n".join(rows[:3]))


if __name__ == "__main__":
    main()
