"""Kernel benchmark: every op at the 2B and 4B shapes, with its roofline beside each figure.

The ceilings are measured in the same run: copy bandwidth (a large device-to-device copy, bytes read + written) and
the bf16 GEMM rate (8192³). Each row: median time, achieved bandwidth and its fraction of the copy bandwidth, and for
GEMM-heavy kernels the FLOP rate and its fraction of the GEMM rate. One JSON line per row with --json FILE.
Usage: python bench/kernels.py [--models 2b,4b] [--only SUBSTRING] [--json FILE]   (--smoke: CPU, tiny shapes)
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from common import SHAPES, all_cases
from timing import copy_bandwidth, time_ms, warm_clocks


def measure_ceilings(device: str) -> tuple[float, float]:
    """(copy bandwidth in bytes/s, bf16 GEMM rate in FLOP/s)."""
    n = (1 << 30) if device == "cuda" else (1 << 22)
    src = torch.randn(n // 4, device=device)
    dst = torch.empty_like(src)
    m = 8192 if device == "cuda" else 256
    a = torch.randn(m, m, device=device, dtype=torch.bfloat16)
    b = torch.randn(m, m, device=device, dtype=torch.bfloat16)
    warm_clocks(device, lambda: dst.copy_(src), lambda: a @ b)
    t_gemm = time_ms(lambda: a @ b, device) / 1e3
    return copy_bandwidth(device), 2 * m**3 / t_gemm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="2b,4b")
    parser.add_argument("--only", default="", help="run the cases whose name contains this")
    parser.add_argument("--json", default=None, help="append one JSON line per result to this file")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU reference backend")
    args = parser.parse_args()
    device = "cpu" if args.smoke else "cuda"
    dtype = torch.float32 if args.smoke else torch.bfloat16
    models = ["smoke"] if args.smoke else args.models.split(",")
    copy_bw, gemm_rate = measure_ceilings(device)
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(f"device {name}: copy {copy_bw / 1e9:.0f} GB/s, bf16 GEMM {gemm_rate / 1e12:.0f} TFLOP/s")
    header = f"{'model':6} {'kernel':44} {'time us':>10} {'GB/s':>8} {'%copy':>6} {'TFLOP/s':>8} {'%gemm':>6}"
    print(header)
    print("-" * len(header))
    out = open(args.json, "a") if args.json else None
    for model in models:
        for case_name, build in all_cases(SHAPES[model], dtype, device, small=args.smoke).items():
            if args.only not in case_name:
                continue
            fn, nbytes, flops = build()
            ms = time_ms(fn, device)
            bw, rate = nbytes / (ms / 1e3), flops / (ms / 1e3)
            row = {
                "model": model, "kernel": case_name, "time_us": ms * 1e3, "bytes": nbytes, "flops": flops,
                "gb_per_s": bw / 1e9, "copy_fraction": bw / copy_bw, "tflop_per_s": rate / 1e12,
                "gemm_fraction": rate / gemm_rate, "device": name, "copy_gb_per_s": copy_bw / 1e9,
                "gemm_tflop_per_s": gemm_rate / 1e12, "date": time.strftime("%Y-%m-%d"),
            }  # fmt: skip
            flop_cols = f"{rate / 1e12:8.1f} {100 * rate / gemm_rate:5.1f}%" if flops else f"{'':8} {'':6}"
            print(f"{model:6} {case_name:44} {ms * 1e3:10.1f} {bw / 1e9:8.0f} {100 * bw / copy_bw:5.1f}% {flop_cols}")
            if out:
                out.write(json.dumps(row) + "\n")
                out.flush()
            del fn
            if device == "cuda":
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
