"""The narrow projections past GEMV_MAX_ROWS rows: the public `ops.linear` op with JETSERVE_NARROW_GEMM=1 (the Triton
skinny GEMM up to NARROW_MAX_ROWS rows, a K split's sum launch taking the next RMSNorm) against =0 (cuBLAS, then the
norm op), in the model's calls: the JetBlock's o_proj and the MLP's down with the residual add and the next RMSNorm,
the attention's o with its norm, its q|k|v and the EAGLE-3 draft's fc without. 2B/4B shapes, bf16, weights rotated
through copies past 4x the L2 (from HBM, as in a decode step). Per case and row count: µs per call for each path
(median of CUDA-graph replays), its share of the roofline (the call's bytes — weight, x and y, or with a norm the
residual read and h and the normed rows written in y's place — over the copy bandwidth measured in the same run) and
the two paths' largest difference. One JSON line per case with --json FILE. Session 31's figures (docs/kernels.md,
linear) came from this script's first form, a `.dev` probe; this form has run in its smoke mode only (the session's
GPU time was spent).
Usage: python bench/narrow_gemm.py [--models 2b] [--rows 17,24,32,48,64] [--json FILE]
       python bench/narrow_gemm.py --smoke   (the CPU, the Triton interpreter, the smoke shapes)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from linear import ceilings  # noqa: E402
from tile_sweep import ints, weight_copies  # noqa: E402
from timing import smoke_or_gpu, time_ms  # noqa: E402

FLAG = "JETSERVE_NARROW_GEMM"


def shapes(s) -> dict[str, tuple[int, int, bool]]:
    """name → (N, K, whether the next RMSNorm follows) for `common.SHAPES[...]` s."""
    q_kv = (s.heads + 2 * s.kv_heads) * s.head_dim
    return {"o_proj": (s.hidden, s.channels, True), "down": (s.hidden, s.mlp, True),
            "attn o": (s.hidden, s.heads * s.head_dim, True), "attn q|k|v": (q_kv, s.hidden, False),
            "draft fc": (s.hidden, 3 * s.hidden, False)}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="2b")
    p.add_argument("--rows", default="17,24,32,48,64")
    p.add_argument("--json", default=None, help="append one JSON line per result to this file")
    p.add_argument("--smoke", action="store_true", help="the CPU and the Triton interpreter, the smoke shapes")
    args = p.parse_args()
    device, dtype = smoke_or_gpu(args.smoke)
    from common import SHAPES

    from jetserve.ops import linear as public
    from jetserve.ops.backend import set_backend

    set_backend("triton")
    copy_bw, _ = ceilings(device)
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu (Triton interpreter)"
    print(f"device {name}: copy {copy_bw / 1e9:.0f} GB/s; Triton up to {public.NARROW_MAX_ROWS} rows with {FLAG}=1")
    out = open(args.json, "a") if args.json else None
    gen = torch.Generator(device=device).manual_seed(0)
    saved = os.environ.get(FLAG)
    try:
        for model in ["smoke"] if args.smoke else args.models.split(","):
            s = SHAPES[model]
            for case, (n, k, norm) in shapes(s).items():
                weights = [(torch.randn(n, k, device=device, generator=gen) * k**-0.5).to(dtype)
                           for _ in range(weight_copies(n * k * dtype.itemsize, device))]  # fmt: skip
                norm_w = torch.randn(n, device=device, generator=gen).to(dtype)
                for rows in ints(args.rows) if not args.smoke else (17, 33):
                    x = torch.randn(rows, k, device=device, generator=gen).to(dtype)
                    residual = torch.randn(rows, n, device=device, generator=gen).to(dtype)
                    add = (residual, norm_w, 1e-6) if norm else None
                    nbytes = (n * k + rows * k + rows * n * (3 if norm else 1)) * dtype.itemsize
                    roof_us = nbytes / copy_bw * 1e6
                    us, got = {}, {}
                    for flag in ("0", "1"):
                        os.environ[FLAG] = flag

                        def call(w, x=x, add=add):
                            return public.linear(x, w, add_norm=add)

                        got[flag] = call(weights[0])
                        us[flag] = time_ms(lambda call=call, weights=weights: [call(w) for w in weights], device)
                        us[flag] *= 1e3 / len(weights)
                    pairs = zip(*(got[f] if norm else (got[f],) for f in ("0", "1")), strict=True)
                    diff = max(float((a.float() - b.float()).abs().max()) for a, b in pairs)
                    base = "cuBLAS then norm" if norm else "cuBLAS"
                    print(f"{model} {case:10} {n:5}x{k:<5} M={rows:3}: {base:16} {us['0']:7.2f} us "
                          f"({roof_us / us['0']:6.1%}), Triton {us['1']:7.2f} us ({roof_us / us['1']:6.1%}), "
                          f"roofline {roof_us:.2f} us, max |diff| {diff:.3g}")  # fmt: skip
                    if out:
                        row = {"model": model, "case": case, "n": n, "k": k, "rows": rows, "norm": norm,
                               "bytes": nbytes, "roofline_us": roof_us, "cublas_us": us["0"], "triton_us": us["1"],
                               "max_diff": diff, "device": name, "copy_gb_per_s": copy_bw / 1e9,
                               "date": time.strftime("%Y-%m-%d")}  # fmt: skip
                        out.write(json.dumps(row) + "\n")
    finally:
        if saved is None:
            os.environ.pop(FLAG, None)
        else:
            os.environ[FLAG] = saved
        if out:
            out.close()


if __name__ == "__main__":
    main()
