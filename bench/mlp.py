"""The fused SwiGLU MLP (`ops.mlp`) against the two GEMMs it replaces, as a decode step runs them: a chain of every
layer's MLP in one CUDA graph (each layer its own weights, so they come from HBM; each MLP's input the previous one's
normed output, its residual the previous one's sum, so every call waits for the one before, as in a decode step).
Per tiling and row count: µs per layer (median of graph replays), GB/s and the fraction of the copy bandwidth measured
in the same run (the roofline: a layer's gate|up and down weights over that bandwidth), the error of the chain's last
output against the two GEMMs', and which tiling `choose_tiling` picks. One JSON line per row with --json FILE.
Usage: python bench/mlp.py [--models 2b] [--rows 1,7] [--layers 28] [--sweep small|full|none] [--json FILE]
       python bench/mlp.py --smoke   (the CPU, the Triton interpreter, tiny shapes and a few tilings)
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from linear import ceilings  # noqa: E402
from timing import smoke_or_gpu, time_ms  # noqa: E402

SHAPES = {"2b": (1536, 8960, 28), "4b": (2048, 11008, 36), "smoke": (48, 100, 3)}  # hidden, intermediate, layers
EPS = 1e-6


def tilings(num_rows: int, sweep: str, smoke: bool) -> list:
    """The tilings swept at num_rows rows (tensor-core tiles, rows padded to 16; `full` adds one-row FMA tiles)."""
    from jetserve.ops.mlp.kernels import MlpTiling

    if sweep == "none":
        return []
    if smoke:
        return [MlpTiling(1, 16, 16, num_rows > 1, num_warps=2, num_stages=1 if num_rows == 1 else 2)]
    out = [
        MlpTiling(1, 128, 128, True, num_stages=4),
        MlpTiling(1, 64, 128, True, num_stages=4),
        MlpTiling(1, 128, 64, True, num_stages=3),
        MlpTiling(2, 128, 128, True, num_stages=3, align=64),  # 140 runs of 64 channels at the 2B
        MlpTiling(2, 128, 64, True, num_stages=3, align=64),
        MlpTiling(1, 128, 128, True, num_stages=3, sum_block_n=64),
    ]
    if sweep == "full":
        for pps, bk, warps in itertools.product((1, 2, 4), (64, 128), (4, 8)):
            if num_rows == 1:
                out.append(MlpTiling(pps, bk, 64, False, num_warps=warps, num_stages=1))
    return out


def describe(t) -> str:
    return (f"{'dot' if t.use_dot else 'fma'} {t.programs_per_sm}/SM k{t.block_k} n{t.block_n} w{t.num_warps} "
            f"s{t.num_stages} a{t.align} sum{t.sum_block_n}")  # fmt: skip


def make_layers(hidden: int, inter: int, num_layers: int, dtype: torch.dtype, device: str):
    """Per layer: the fused [gate; up] weight, the down weight and the next norm's weight."""
    gen = torch.Generator(device=device).manual_seed(0)

    def randn(*shape: int, scale: float) -> torch.Tensor:
        return (torch.randn(*shape, device=device, generator=gen) * scale).to(dtype)

    return [
        (randn(2 * inter, hidden, scale=hidden**-0.5), randn(hidden, inter, scale=inter**-0.5),
         1 + randn(hidden, scale=0.1))
        for _ in range(num_layers)
    ]  # fmt: skip


def chain(layers, x: torch.Tensor, residual: torch.Tensor, mlp_op):
    """Every layer's MLP in turn, the next norm in each: (normed, residual) of the last."""
    for gate_up, down, norm_w in layers:
        x, residual = mlp_op(x, gate_up, down, (residual, norm_w, EPS))
    return x, residual


def two_gemms(x, gate_up, down, add_norm):
    """Today's path without the fused op: the gate|up GEMM, then the SwiGLU down GEMM and the norm (ops.linear)."""
    from jetserve.ops.linear import linear, swiglu_linear

    return swiglu_linear(linear(x, gate_up), down, add_norm=add_norm)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="2b")
    parser.add_argument("--rows", default="1,7")
    parser.add_argument("--layers", type=int, default=0, help="layers in the chain (0: the model's)")
    parser.add_argument("--sweep", choices=("small", "full", "none"), default="small")
    parser.add_argument("--json", default=None)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    device, dtype = smoke_or_gpu(args.smoke)
    from jetserve.ops.backend import set_backend, sm_count
    from jetserve.ops.mlp import kernels

    set_backend("triton")
    copy_bw, _ = ceilings(device)
    models = ["smoke"] if args.smoke else args.models.split(",")
    out = open(args.json, "a") if args.json else None
    print(f"copy bandwidth {copy_bw / 1e9:.0f} GB/s")
    print(f"{'model':<6} {'rows':>4} {'variant':<70} {'µs/layer':>9} {'GB/s':>6} {'%copy':>6} {'err':>8}")
    for model in models:
        hidden, inter, num_layers = SHAPES[model]
        num_layers = args.layers or num_layers
        layers = make_layers(hidden, inter, num_layers, dtype, device)
        # the down weight stored [I, D] (its rows the runs' channels: each run one contiguous block), viewed as [D, I]
        transposed = [(gate_up, down.t().contiguous().t(), norm_w) for gate_up, down, norm_w in layers]
        layer_bytes = 3 * hidden * inter * dtype.itemsize
        for num_rows in (int(r) for r in (args.rows if not args.smoke else "1,3").split(",")):
            gen = torch.Generator(device=device).manual_seed(num_rows)
            x = torch.randn(num_rows, hidden, device=device, generator=gen).to(dtype)
            residual = torch.randn(num_rows, hidden, device=device, generator=gen).to(dtype)
            want = chain(layers, x, residual, two_gemms)[0].float()
            picked = kernels.choose_tiling(num_rows) if num_rows <= kernels.MAX_BLOCK_M else None
            variants = [("two GEMMs (JETSERVE_FUSED_MLP=0)", two_gemms, layers)]
            fused = [(f"picked: {describe(picked)}", picked)]
            fused += [(describe(t), t) for t in tilings(num_rows, args.sweep, args.smoke) if t != picked]
            for label, tiling in fused:
                variants += [(f"fused {label}", tiling, layers), (f"fused, down [I, D] {label}", tiling, transposed)]
            for name, variant, weights in variants:
                if variant is two_gemms:
                    op = two_gemms
                else:

                    def op(x, gate_up, down, add_norm, tiling=variant):
                        return kernels.swiglu_mlp(x, gate_up, down, tiling=tiling, add_norm=add_norm)

                try:
                    got = chain(weights, x, residual, op)[0].float()
                    err = ((got - want).norm() / want.norm()).item()
                    run = functools.partial(chain, weights, x, residual, op)
                    seconds = time_ms(run, device) / 1e3 / num_layers
                except Exception as exc:  # a tiling that does not compile or fit: reported, the sweep goes on
                    print(f"{model:<6} {num_rows:>4} {name[:70]:<70} failed: {type(exc).__name__}: {exc}"[:200])
                    continue
                gbps = layer_bytes / seconds / 1e9
                print(f"{model:<6} {num_rows:>4} {name[:70]:<70} {seconds * 1e6:>9.2f} {gbps:>6.0f} "
                      f"{layer_bytes / seconds / copy_bw:>6.1%} {err:>8.1e}")  # fmt: skip
                if out:
                    row = {"model": model, "rows": num_rows, "variant": name, "us_per_layer": seconds * 1e6,
                           "gbps": gbps, "copy_fraction": layer_bytes / seconds / copy_bw, "error": err,
                           "roofline_us": layer_bytes / copy_bw * 1e6,
                           "sms": sm_count(torch.device(device))}  # fmt: skip
                    out.write(json.dumps(row) + "\n")
                    out.flush()


if __name__ == "__main__":
    main()
