"""The skinny GEMM's L2 prefetch hint, alone: a decode layer's GEMM chain at the 2B/4B shapes (M = 1), each GEMM
prefetching the first BUDGET bytes of the next one's weight, with idle gaps where the model runs its small kernels
(a spin kernel of about the conv + gated delta rule's time after the input projections, a shorter one after o_proj
and after down_proj). Layers are distinct weight copies, more than 4x the L2 in all, so every weight comes from HBM
unless prefetched. Per budget: µs per layer (median of CUDA-graph replays), the layer's roofline (its weight bytes over
the copy bandwidth measured here; the gaps are time prefetching can hide under), and the output checked bit for bit
against no prefetch.
Usage: python bench/l2_prefetch.py [--models 2b,4b] [--budgets-mb 0,4,8,16,32,64] [--gap-us 8,2] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from linear import ceilings  # noqa: E402
from timing import time_ms  # noqa: E402

L2_MULTIPLE = 4


def layer_shapes(preset: str) -> dict[str, tuple[int, int]]:
    """(N, K) of a JetBlock layer's four decode GEMMs."""
    from jetserve.checkpoint import preset_config
    from jetserve.config import ModelConfig

    cfg = ModelConfig.from_dict(preset_config(preset))
    hidden, jet = cfg.hidden_size, cfg.jet
    n_in = 2 * jet.key_dim + jet.generator_dim + 2 * jet.value_dim + 2 * jet.num_heads
    return {"in": (n_in, hidden), "o": (hidden, jet.value_dim), "gate_up": (2 * cfg.intermediate_size, hidden),
            "down": (hidden, cfg.intermediate_size)}  # fmt: skip


def spin_cycles(us: float) -> int:
    """Cycles of `torch.cuda._sleep` for about `us` at an H200's 1.98 GHz (the gaps' real length is measured)."""
    return int(us * 1.98e3)


def run_chain(x, layers, o_cols, hints, cycles) -> torch.Tensor:
    """The GEMM chain over every layer: in, gap, o, gap, gate|up, SwiGLU down, gap; GEMM i prefetches hints[i]."""
    from jetserve.ops.linear import kernels as gemv

    h = x
    for i, layer in enumerate(layers):
        hint = hints[4 * i : 4 * i + 4]
        y = gemv.linear(h, layer["in"], prefetch=hint[0])
        torch.cuda._sleep(cycles[0])  # noqa: SLF001
        o = gemv.linear(y[:, :o_cols], layer["o"], prefetch=hint[1])
        torch.cuda._sleep(cycles[1])  # noqa: SLF001
        gu = gemv.linear(o, layer["gate_up"], prefetch=hint[2])
        h = gemv.swiglu_linear(gu, layer["down"], prefetch=hint[3])
        torch.cuda._sleep(cycles[1])  # noqa: SLF001
    return h


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="2b,4b")
    p.add_argument("--budgets-mb", default="0,4,8,16,32,64")
    p.add_argument("--gap-us", default="8,2", help="spin after the input GEMM, and after o_proj and down_proj")
    p.add_argument("--json")
    args = p.parse_args()
    device, dtype = "cuda", torch.bfloat16
    copy_bw, _ = ceilings(device)
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    gap_long, gap_short = (float(g) for g in args.gap_us.split(","))
    cycles = (spin_cycles(gap_long), spin_cycles(gap_short))
    gaps_ms = [time_ms(lambda c=c: torch.cuda._sleep(c), device) for c in cycles]  # noqa: SLF001
    name = torch.cuda.get_device_name()
    print(f"{name}: copy {copy_bw / 1e9:.0f} GB/s, L2 {l2 / 2**20:.0f} MiB; gaps {gaps_ms[0] * 1e3:.1f} and "
          f"{gaps_ms[1] * 1e3:.1f} µs (spin kernels)")  # fmt: skip
    print(f"{'model':5} {'budget MiB':>10} | {'µs/layer':>8} {'roofline µs':>11} {'of roofline':>11} | {'exact':>5}")
    out = open(args.json, "a") if args.json else None
    gen = torch.Generator(device=device).manual_seed(0)
    for preset in args.models.split(","):
        shapes = layer_shapes(preset)
        layer_bytes = sum(n * k for n, k in shapes.values()) * dtype.itemsize
        num_layers = max(2, -(-L2_MULTIPLE * l2 // layer_bytes))
        layers = [{key: torch.randn(n, k, device=device, generator=gen).mul_(k**-0.5).to(dtype)
                   for key, (n, k) in shapes.items()} for _ in range(num_layers)]  # fmt: skip
        order = [w for layer in layers for w in layer.values()]  # every GEMM's weight, in the chain's order
        x = torch.randn(1, shapes["in"][1], device=device, generator=gen).to(dtype)
        roofline_us = layer_bytes / copy_bw * 1e6  # the weights at the copy bandwidth: the gaps could hide under it
        reference = None
        for budget in (int(b) << 20 for b in args.budgets_mb.split(",")):
            hints = [w.reshape(-1)[: budget // dtype.itemsize] if budget else None for w in order[1:] + order[:1]]
            run = (x, layers, shapes["o"][1], hints, cycles)
            result = run_chain(*run)
            reference = result if reference is None else reference
            exact = bool(torch.equal(result, reference))
            us = time_ms(lambda run=run: run_chain(*run), device) * 1e3 / num_layers
            row = {"model": preset, "budget_mib": budget >> 20, "us_per_layer": us, "roofline_us": roofline_us,
                   "roofline_fraction": roofline_us / us, "exact": exact, "layer_bytes": layer_bytes,
                   "num_layers": num_layers, "gap_us": [g * 1e3 for g in gaps_ms], "copy_gb_per_s": copy_bw / 1e9,
                   "device": name}  # fmt: skip
            fraction = roofline_us / us
            print(f"{preset:5} {budget >> 20:>10} | {us:8.1f} {roofline_us:11.1f} {fraction:11.1%} | {exact!s:>5}")
            if out:
                out.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
