"""Decode-time linear layers: torch `F.linear` (cuBLAS) against jetserve's Triton skinny GEMM, at the 2B and 4B shapes.

Every projection of a decode step, separate and fused (JetBlock q|k|v|a|b|g|w1, attention q|k|v, MLP gate|up), and the
lm_head, for M = 1..64 rows of x, bf16. Each row: median time under CUDA-graph replay, bandwidth (weight + bias + x + y
bytes over the time) and its fraction of the copy bandwidth measured in the same run. Each timed call walks through
enough copies of the weight to exceed the L2 cache several times (as a decode step's layers do), so the weight is read
from HBM; a tiny weight still fits in L2 (its time is launch latency). One JSON line per row with --json FILE.
Usage: python bench/linear.py [--models 2b,4b] [--rows 1,2,4,8,16,32,64] [--only SUBSTRING] [--json FILE]
       python bench/linear.py --smoke   (the CPU, the Triton interpreter, the tiny preset: checks this script)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from timing import copy_bandwidth, smoke_or_gpu, time_ms, warm_clocks  # noqa: E402

Projection = tuple[str, int, int, bool]  # (name, N, K, has_bias)
L2_MULTIPLE = 4  # a timed call streams at least this many times the L2 size of weights
MAX_WEIGHT_COPIES = 32


def projections(preset: str) -> list[Projection]:
    """Every decode-time projection of a model preset, separate then fused, identical shapes merged into one row."""
    from jetserve.checkpoint import preset_config
    from jetserve.config import ModelConfig

    cfg = ModelConfig.from_dict(preset_config(preset))
    hidden, jet = cfg.hidden_size, cfg.jet
    q_dim, kv_dim = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    jet_parts = {"q": jet.key_dim, "k": jet.key_dim, "v": jet.value_dim, "a": jet.num_heads, "b": jet.num_heads,
                 "g": jet.value_dim, "w1": jet.generator_dim}  # fmt: skip
    separate: list[Projection] = [(f"jet {name}", n, hidden, False) for name, n in jet_parts.items()]
    separate += [("jet o", hidden, jet.value_dim, False)]
    separate += [("attn q", q_dim, hidden, cfg.attention_bias), ("attn k", kv_dim, hidden, cfg.attention_bias)]
    separate += [("attn v", kv_dim, hidden, cfg.attention_bias), ("attn o", hidden, q_dim, False)]
    separate += [("mlp gate", cfg.intermediate_size, hidden, False), ("mlp up", cfg.intermediate_size, hidden, False)]
    separate += [("mlp down", hidden, cfg.intermediate_size, False), ("lm_head", cfg.vocab_size, hidden, False)]
    merged: dict[tuple[int, int, bool], list[str]] = {}
    for name, n, k, has_bias in separate:
        merged.setdefault((n, k, has_bias), []).append(name)
    rows = [(" = ".join(names), n, k, has_bias) for (n, k, has_bias), names in merged.items()]
    rows += [
        ("fused jet q|k|v|a|b|g|w1", sum(jet_parts.values()), hidden, False),
        ("fused attn q|k|v", q_dim + 2 * kv_dim, hidden, cfg.attention_bias),
        ("fused mlp gate|up", 2 * cfg.intermediate_size, hidden, False),
    ]
    return rows


def _time_calls(
    op: Callable[..., torch.Tensor],
    x: torch.Tensor,
    weights: list[torch.Tensor],
    bias: torch.Tensor | None,
    device: str,
) -> float:
    """Median milliseconds of one `op(x, weight, bias)`, timed over calls that walk through every copy of the weight."""
    return time_ms(lambda: [op(x, w, bias) for w in weights], device) / len(weights)


def ceilings(device: str) -> tuple[float, float]:
    """(copy bandwidth: bytes/s of a large device-to-device copy, read + written; read bandwidth: bytes/s of a sum over
    the same tensor, a read-only stream like a GEMV's), after a second of work to raise the clocks."""
    n = (1 << 30) if device == "cuda" else (1 << 22)
    src = torch.randn(n // 4, device=device)
    dst = torch.empty_like(src)
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16) if device == "cuda" else None
    warm_clocks(device, lambda: dst.copy_(src), lambda: a @ a)
    copy_bw = copy_bandwidth(device)
    read_bw = n / (time_ms(lambda: src.sum(), device) / 1e3)
    return copy_bw, read_bw


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="2b,4b")
    parser.add_argument("--rows", default="1,2,4,8,16,32,64", help="the M values (rows of x)")
    parser.add_argument("--only", default="", help="run the projections whose name contains this")
    parser.add_argument("--json", default=None, help="append one JSON line per result to this file")
    parser.add_argument("--smoke", action="store_true", help="the CPU and the Triton interpreter, the tiny preset")
    args = parser.parse_args()
    device, dtype = smoke_or_gpu(args.smoke)
    from jetserve.ops.linear import GEMV_MAX_ROWS
    from jetserve.ops.linear import kernels as gemv

    models = ["tiny"] if args.smoke else args.models.split(",")
    row_counts = [int(m) for m in args.rows.split(",")]
    gen = torch.Generator(device=device).manual_seed(0)
    copy_bw, read_bw = ceilings(device)
    l2_bytes = torch.cuda.get_device_properties(device).L2_cache_size if device == "cuda" else 0
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu (Triton interpreter)"
    print(
        f"device {name}: copy {copy_bw / 1e9:.0f} GB/s (read + written), read {read_bw / 1e9:.0f} GB/s (a sum), "
        f"L2 {l2_bytes / 2**20:.0f} MiB; Triton dispatch M <= {GEMV_MAX_ROWS}; %copy = bandwidth / copy bandwidth"
    )
    header = (f"{'model':5} {'projection':26} {'N':>6} {'K':>5} {'M':>3} | {'torch us':>8} {'GB/s':>5} {'%copy':>5} | "
              f"{'triton us':>9} {'GB/s':>5} {'%copy':>5} | {'speedup':>7} {'err':>7}")  # fmt: skip
    print(header)
    print("-" * len(header))
    out = open(args.json, "a") if args.json else None
    for model in models:
        for proj, n, k, has_bias in projections(model):
            if args.only not in proj:
                continue
            weight_bytes = (n * k + (n if has_bias else 0)) * dtype.itemsize
            copies = min(MAX_WEIGHT_COPIES, max(1, -(-L2_MULTIPLE * l2_bytes // weight_bytes)))  # 1 off the GPU
            weights = [torch.randn(n, k, device=device, generator=gen).mul_(k**-0.5).to(dtype) for _ in range(copies)]
            bias = torch.randn(n, device=device, generator=gen).to(dtype) if has_bias else None
            for m in row_counts:
                x = torch.randn(m, k, device=device, generator=gen).to(dtype)
                nbytes = weight_bytes + (m * k + m * n) * dtype.itemsize
                b32 = bias.float() if bias is not None else None
                expected = torch.nn.functional.linear(x.float(), weights[0].float(), b32)
                err = (gemv.linear(x, weights[0], bias).float() - expected).norm() / expected.norm()
                times_ms = {
                    "torch": _time_calls(torch.nn.functional.linear, x, weights, bias, device),
                    "triton": _time_calls(gemv.linear, x, weights, bias, device),
                }
                bw = {op_name: nbytes / (ms / 1e3) for op_name, ms in times_ms.items()}
                row = {
                    "model": model, "projection": proj, "n": n, "k": k, "m": m, "bias": has_bias, "bytes": nbytes,
                    "torch_us": times_ms["torch"] * 1e3, "torch_gb_per_s": bw["torch"] / 1e9,
                    "torch_copy_fraction": bw["torch"] / copy_bw, "triton_us": times_ms["triton"] * 1e3,
                    "triton_gb_per_s": bw["triton"] / 1e9, "triton_copy_fraction": bw["triton"] / copy_bw,
                    "speedup": times_ms["torch"] / times_ms["triton"], "triton_rel_err": float(err),
                    "tiling": repr(gemv.choose_tiling(min(m, gemv.MAX_BLOCK_M), n, k, gemv.sm_count(x.device))),
                    "weight_copies": copies, "device": name, "copy_gb_per_s": copy_bw / 1e9,
                    "read_gb_per_s": read_bw / 1e9,
                    "date": time.strftime("%Y-%m-%d"),
                }  # fmt: skip
                print(
                    f"{model:5} {proj:26} {n:6} {k:5} {m:3} | {row['torch_us']:8.1f} {bw['torch'] / 1e9:5.0f} "
                    f"{100 * row['torch_copy_fraction']:4.0f}% | {row['triton_us']:9.1f} {bw['triton'] / 1e9:5.0f} "
                    f"{100 * row['triton_copy_fraction']:4.0f}% | {row['speedup']:6.2f}x {float(err):7.1e}"
                )
                if out:
                    out.write(json.dumps(row) + "\n")
                    out.flush()
            del weights
            if device == "cuda":
                torch.cuda.empty_cache()
    if out:
        out.close()


if __name__ == "__main__":
    main()
