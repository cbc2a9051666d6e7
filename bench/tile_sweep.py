"""Tile sweeps behind the fixed heuristics, at the 2B/4B decode shapes: the attention decode's launch plan
(`decode_plan`: splits and key tiles, N = 1, 64, 256 at 4K context, full and windowed), the gated-delta-rule decode's
V tiles (`decode_tiles`, N = 64, 256), the dynamic-conv decode kernel's tiles (`decode_tiles_for`, N = 1 and 16 by
default), the dynamic-conv verify kernel's (chains and trees of drafts) and the skinny GEMM's tilings
(`choose_tiling`; one row by default, or any number of rows against today's dispatch, cuBLAS past `ops.linear`'s row
limits) in the modes the model runs them (fused input projections with the SiLU epilogue, o_proj with the gated norm,
gate|up, down with SwiGLU). Weights rotate through copies larger than 4x the L2, so they come from HBM as in a decode
step. The JetBlock ops' inputs are row-strided views of one projection output of the model's width
(`common.jet_projection`), as the model passes them. Per tiling: µs per call (median of CUDA-graph replays), GB/s and
the fraction of the copy bandwidth measured in the same run (the roofline: the bytes a call must move over that
bandwidth), its error against the reference, and which tiling the heuristic picks now. One JSON line per tiling with
--json FILE.
Usage: python bench/tile_sweep.py [--models 2b] [--only conv|verify|gemm|attn|delta] [--rows 1,32,64]
       [--conv-rows 1,16,64] [--verify-trees 1x7c,64x8t] [--attn-rows 1,64,256] [--delta-rows 64,256] [--json FILE]
       [--cases NAMES] [--block-n 16,32] [--splits 1,4] [--tile-kind fma|dot]
       python bench/tile_sweep.py --smoke   (the CPU, the Triton interpreter, tiny shapes and a few tilings)
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from linear import ceilings  # noqa: E402
from timing import smoke_or_gpu, time_ms  # noqa: E402

L2_MULTIPLE = 4


def weight_copies(nbytes: int, device: str) -> int:
    """Copies of a weight whose sum passes L2_MULTIPLE times the L2 (1 off the GPU)."""
    if device != "cuda":
        return 1
    return max(2, -(-L2_MULTIPLE * torch.cuda.get_device_properties(device).L2_cache_size // nbytes))


def conv_weights(s, dtype: torch.dtype, device: str, seed: int) -> tuple[torch.Generator, list, torch.Tensor]:
    """(a generator, copies of the conv's w2 [D*W, G] past L2_MULTIPLE x the L2, its bias [D*W])."""
    d, g, width = s.channels, s.generator, s.conv
    gen = torch.Generator(device=device).manual_seed(seed)
    copies = weight_copies(d * width * g * dtype.itemsize, device)
    w2s = [(torch.randn(d * width, g, device=device, generator=gen) * g**-0.5).to(dtype) for _ in range(copies)]
    return gen, w2s, torch.randn(d * width, device=device, generator=gen).to(dtype)


def conv_cases(
    s, dtype: torch.dtype, device: str, smoke: bool, ns: tuple[int, ...] = (1, 16)
) -> list[tuple[str, list, Callable, object]]:
    """(case name, tilings, run(tiles) → (seconds per call, max error, bytes), the heuristic's pick) for the conv
    decode at each N of `ns` (token tiles of 16 rows up to N = 16, of 16, 32 and 64 past it);
    `s` is one of `common.SHAPES`."""
    from common import jet_projection

    from jetserve.ops.dynamic_conv import decode, reference
    from jetserve.ops.dynamic_conv.kernel_generator import Tiles

    d, width = s.channels, s.conv
    grid = itertools.product((8, 16, 32), (64, 128), (2, 4), (2, 3, 4)) if not smoke else [(8, 128, 2, 3)]
    small = [Tiles(16, bd, bg, warps, stages) for bd, bg, warps, stages in grid]
    grid = itertools.product((16, 32, 64), (8, 16, 32), (64, 128), (2, 4, 8)) if not smoke else [(32, 8, 64, 2)]
    large = [Tiles(bt, bd, bg, warps, 3) for bt, bd, bg, warps in grid]
    gen, w2s, bias = conv_weights(s, dtype, device, seed=0)
    cases = []
    for n in ns if not smoke else (1, 3, 20):
        tilings = small if n <= 16 else large
        _, _, h, u, _, _, _ = jet_projection(s, n, dtype, device)  # row-strided views, as the model passes them
        slots = torch.arange(1, n + 1, device=device, dtype=torch.int32)
        state = torch.randn(n + 1, width - 1, d, device=device, generator=gen).to(dtype)
        want = reference.dynamic_conv_decode(u, h, w2s[0], bias, state.clone(), slots)
        nbytes = (w2s[0].numel() + bias.numel() + 2 * u.numel() + h.numel() + 2 * n * (width - 1) * d) * dtype.itemsize

        def run(tiles, u=u, h=h, slots=slots, state=state, want=want, nbytes=nbytes) -> tuple[float, float, int]:
            original = decode.decode_tiles_for
            if tiles is not None:
                decode.decode_tiles_for = lambda x, rows: tiles
            try:
                got = decode.dynamic_conv_decode(u, h, w2s[0], bias, state.clone(), slots)  # a fresh window each
                err = float((got.float() - want.float()).abs().max())
                work = state.clone()  # the timed calls shift this one
                ms = time_ms(lambda: [decode.dynamic_conv_decode(u, h, w, bias, work, slots) for w in w2s], device)
            finally:
                decode.decode_tiles_for = original
            return ms / 1e3 / len(w2s), err, nbytes

        cases.append((f"{s.name} dynamic_conv decode N={n}", tilings, run, decode.decode_tiles_for(u, n)))
    return cases


def conv_verify_cases(
    s, dtype: torch.dtype, device: str, smoke: bool, trees: tuple[str, ...] = ("1x7c", "16x7c", "64x7c", "64x8t")
) -> list[tuple[str, list, Callable, object]]:
    """The conv verify kernel's tiles (`dynamic_conv_verify`'s `tiles`) for each tree batch of `trees`: "NxTc" is N
    sequences of T-node chains, "NxTt" of T-node binary trees. Tilings like the decode sweep's (16-row tiles of 1-4
    warps up to 16 rows, 16-64-row tiles past it); w2 rotates through copies past 4x the L2."""
    from common import jet_projection, tree_parents

    from jetserve.ops.dynamic_conv import reference, verify
    from jetserve.ops.dynamic_conv.kernel_generator import Tiles

    d, width = s.channels, s.conv
    grid = itertools.product((8, 16, 32), (64, 128), (1, 2, 4)) if not smoke else [(8, 128, 2)]
    small = [Tiles(16, bd, bg, warps, 3) for bd, bg, warps in grid]
    grid = itertools.product((16, 32, 64), (8, 16, 32), (64, 128), (2, 4)) if not smoke else [(32, 8, 64, 2)]
    large = [Tiles(bt, bd, bg, warps, 3) for bt, bd, bg, warps in grid]
    gen, w2s, bias = conv_weights(s, dtype, device, seed=4)
    cases = []
    for spec in trees if not smoke else ("1x3c", "3x7t"):
        n, nodes = map(int, spec[:-1].split("x"))
        rows = n * nodes
        _, _, h, u, _, _, _ = jet_projection(s, rows, dtype, device)  # row-strided views, as the model passes them
        slots = torch.arange(1, n + 1, device=device, dtype=torch.int32)
        state = torch.randn(n + 1, width - 1, d, device=device, generator=gen).to(dtype)
        parents = tree_parents(n, nodes, spec.endswith("c"), device)
        want = reference.dynamic_conv_verify(u, h, w2s[0], bias, state, slots, parents)
        nbytes = (w2s[0].numel() + bias.numel() + 2 * u.numel() + h.numel() + n * (width - 1) * d) * dtype.itemsize

        def run(tiles, u=u, h=h, slots=slots, state=state, parents=parents, want=want, nbytes=nbytes):
            got = verify.dynamic_conv_verify(u, h, w2s[0], bias, state, slots, parents, tiles=tiles)
            err = float((got.float() - want.float()).abs().max())
            ms = time_ms(
                lambda: [verify.dynamic_conv_verify(u, h, w, bias, state, slots, parents, tiles=tiles) for w in w2s],
                device,
            )
            return ms / 1e3 / len(w2s), err, nbytes

        tilings, picked = small if rows <= 16 else large, verify.verify_tiles_for(u, rows)
        cases.append((f"{s.name} dynamic_conv verify {spec} ({rows} rows)", tilings, run, picked))
    return cases


def attn_cases(
    s, dtype: torch.dtype, device: str, smoke: bool, ns: tuple[int, ...] = (1, 64, 256)
) -> list[tuple[str, list, Callable, object]]:
    """The paged attention decode's launch plan (`decode_plan`: key-range splits and tiles) at 4K context, full and
    under the model's window, for each N of `ns`; K/V caches rotate through copies past 4x the L2. Tilings are
    (splits, BLOCK_N, warps, stages)."""
    from common import PAGE_SIZE

    from jetserve.ops.attention import decode, reference

    heads, kv_heads, head_dim = s.heads, s.kv_heads, s.head_dim
    context = 4096 if not smoke else 40
    splits = (1, 2, 3, 4, 8, 16, 32, 64) if not smoke else (1, 3)
    tiles = ((64, 4, 3), (64, 4, 2), (128, 4, 2), (32, 4, 3)) if not smoke else ((16, 1, 1),)
    gen = torch.Generator(device=device).manual_seed(2)
    cases = []
    for n, window in itertools.product(ns if not smoke else (1, 3), (0, 1152 if not smoke else 24)):
        pages = -(-(context + 1) // PAGE_SIZE)
        cache_bytes = 2 * (1 + n * pages) * PAGE_SIZE * kv_heads * head_dim * dtype.itemsize
        copies = weight_copies(cache_bytes, device)
        caches = [
            [torch.randn(1 + n * pages, PAGE_SIZE, kv_heads, head_dim, device=device, generator=gen).to(dtype)
             for _ in range(2)]
            for _ in range(copies)
        ]  # fmt: skip
        tables = (1 + torch.arange(n * pages, device=device, dtype=torch.int32)).view(n, pages)
        q = torch.randn(n, heads, head_dim, device=device, generator=gen).to(dtype)
        k, v = (torch.randn(n, kv_heads, head_dim, device=device, generator=gen).to(dtype) for _ in range(2))
        lens = torch.full((n,), context + 1, dtype=torch.int32, device=device)
        slots = (tables[:, context // PAGE_SIZE].long() * PAGE_SIZE + context % PAGE_SIZE).contiguous()
        opts = dict(scale=head_dim**-0.5, window_tokens=window, ring_tokens=0)
        want = reference.attention_decode(q, k, v, *[c.clone() for c in caches[0]], lens, tables, slots, **opts)
        keys = min(context, window - 1) if window else context
        nbytes = 2 * n * (keys + 1) * kv_heads * head_dim * dtype.itemsize + 2 * q.numel() * dtype.itemsize
        capacity = min(pages * PAGE_SIZE, window) if window else pages * PAGE_SIZE
        cap = {t[0]: -(-capacity // t[0]) for t in tiles}
        tilings = [(sp, *t) for sp in splits for t in tiles if sp <= cap[t[0]] and n * kv_heads * sp <= 4096]

        def run(plan, q=q, k=k, v=v, caches=caches, lens=lens, tables=tables, slots=slots, opts=opts, want=want,
                nbytes=nbytes) -> tuple[float, float, int]:  # fmt: skip
            original = decode.decode_plan
            if plan is not None:
                decode.decode_plan = lambda *args, **kwargs: plan
            try:
                got = decode.attention_decode(q, k, v, *caches[0], lens, tables, slots, **opts)
                err = float((got.float() - want.float()).abs().max())
                ms = time_ms(lambda: [decode.attention_decode(q, k, v, *c, lens, tables, slots, **opts)
                                      for c in caches], device)  # fmt: skip
            finally:
                decode.decode_plan = original
            return ms / 1e3 / len(caches), err, nbytes

        picked = decode.decode_plan(n * kv_heads, capacity, q.device)
        cases.append((f"{s.name} attention decode N={n} ctx={context} window={window}", tilings, run, picked))
    return cases


def delta_cases(
    s, dtype: torch.dtype, device: str, smoke: bool, ns: tuple[int, ...] = (64, 256)
) -> list[tuple[str, list, Callable, object]]:
    """The gated-delta-rule decode's V tiles (`decode_tiles`: tile width, tiles a program walks) for each N of `ns`;
    the fp32 states rotate through copies past 4x the L2. Tilings are (BV, chunks)."""
    from common import jet_projection

    from jetserve.ops.gated_delta_rule import decode, reference

    heads, kd, vd = s.jet_heads, s.key_dim, s.value_dim
    tilings = [(bv, c) for bv in (32, 64, 128) for c in (1, 2, 4) if bv * c <= max(vd, 64)] if not smoke else [(8, 2)]
    gen = torch.Generator(device=device).manual_seed(3)
    cases = []
    for n in ns if not smoke else (2, 5):
        state_bytes = (n + 1) * heads * kd * vd * 4
        copies = weight_copies(state_bytes, device)
        states = [torch.randn(n + 1, heads, kd, vd, device=device, generator=gen) * 0.1 for _ in range(copies)]
        q, k, _, _, a, b, _ = jet_projection(s, n, dtype, device)  # row-strided views, as the model passes them
        v = torch.randn(n, heads, vd, device=device, generator=gen).to(dtype)
        A_log, dt_bias = torch.rand(heads, device=device), torch.rand(heads, device=device)
        idx = torch.arange(1, n + 1, device=device, dtype=torch.int32)
        want = reference.gated_delta_rule_decode(q, k, v, a, b, A_log, dt_bias, states[0].clone(), idx)
        nbytes = 2 * n * heads * kd * vd * 4 + 2 * v.numel() * dtype.itemsize

        def run(tiles, q=q, k=k, v=v, a=a, b=b, A_log=A_log, dt_bias=dt_bias, states=states, idx=idx, want=want,
                nbytes=nbytes) -> tuple[float, float, int]:  # fmt: skip
            kw = {} if tiles is None else {"block_v": tiles[0], "chunks": tiles[1]}
            args = (q, k, v, a, b, A_log, dt_bias)
            got = decode.gated_delta_rule_decode(*args, states[0].clone(), idx, **kw)
            err = float((got.float() - want.float()).abs().max())
            work = [st.clone() for st in states] if device != "cuda" else states  # the timed calls advance these
            ms = time_ms(lambda: [decode.gated_delta_rule_decode(*args, st, idx, **kw) for st in work], device)
            return ms / 1e3 / len(states), err, nbytes

        picked = decode.decode_tiles(n * heads, vd, None)
        cases.append((f"{s.name} gated_delta_rule decode N={n}", tilings, run, picked))
    return cases


def gemm_tilings(
    rows: int, smoke: bool, block_ns: tuple[int, ...] = (), splits: tuple[int, ...] = (), kind: str = ""
) -> list:
    """The tilings swept for `rows` rows of x: one-row FMA and 16-row tensor-core tiles for one row; tensor-core tiles
    holding all the rows (wider weight tiles, 8 warps, K splits) for more, and FMA tiles up to 8 rows. `block_ns` /
    `splits` / `kind` ("fma" or "dot"), when given, keep only the tilings with those weight-tile widths / K splits /
    that kind of tile."""
    tilings = _gemm_tilings(rows, smoke)
    if kind:
        tilings = [t for t in tilings if t.use_dot == (kind == "dot")]
    return [t for t in tilings if (not block_ns or t.block_n in block_ns) and (not splits or t.num_splits in splits)]


def _gemm_tilings(rows: int, smoke: bool) -> list:
    from jetserve.ops.linear.kernels import GemvTiling

    block_m = max(16, 1 << (rows - 1).bit_length())
    if smoke:
        return [GemvTiling(1, 4, 64, 1, False, 8, 1)] * (rows == 1) + [GemvTiling(block_m, 32, 32, 2, True, 4, 2)]
    if rows > 1:
        # narrow weight tiles (16, 32: more programs on a narrow N without splitting K) were not swept before session
        # 21; 10 and 12 splits were added in session 35 (the 2B down at 8 splits of 128-wide tiles fills 96 of 132
        # SMs, at 10 splits 120) and swept in session 36: within one tiling's spread at 2-16 rows
        dot = itertools.product((16, 32, 64, 128, 256), (64, 128), (3, 4), (1, 2, 3, 4, 6, 8, 10, 12, 16), (4, 8))
        tilings = [GemvTiling(block_m, bn, bk, sp, True, w, st) for bn, bk, st, sp, w in dot if w == 4 or bn >= 128]
        if rows > 8:
            return tilings
        # up to 8 rows, FMA tiles too (a verify step's 7 rows; not swept before session 29): the fp32 accumulator
        # [rows, BLOCK_N, BLOCK_K] kept at 4096 or 8192 values a program
        fma_m = 1 << (rows - 1).bit_length()
        fma = itertools.product(((1, 512), (1, 1024), (2, 256), (2, 512), (4, 256)), (4, 8), (1, 2, 4))
        return tilings + [GemvTiling(fma_m, bn, bk, sp, False, w, 1) for (bn, bk), w, sp in fma]
    # 2-4 stages made no change in session 20: the kernel's loop was not pipelined then (session 54's finding)
    fma = itertools.product((1, 2, 4, 8), (1024, 2048), (4, 8), (1, 2), (1, 2, 3))
    dot = itertools.product((32, 64), (128,), (3, 4), (1, 4, 16))
    tilings = [GemvTiling(1, bn, bk, sp, False, w, st) for bn, bk, w, sp, st in fma]
    return tilings + [GemvTiling(16, bn, bk, sp, True, 4, st) for bn, bk, st, sp in dot]


def gemm_cases(
    s,
    dtype: torch.dtype,
    device: str,
    smoke: bool,
    rows: int = 1,
    block_ns: tuple = (),
    splits: tuple = (),
    kind: str = "",
) -> list[tuple[str, list, Callable, object]]:
    """The four decode GEMMs of a JetBlock layer for `rows` rows of x, each in its model mode (past GEMV_MAX_ROWS rows
    o_proj and down plain too: the model's mode there). The untiled row is the public op (`jetserve.ops.linear`):
    today's dispatch (past its row limits, the separate prologue kernel and cuBLAS)."""
    from jetserve.ops import linear as public
    from jetserve.ops.linear import kernels, reference

    tilings = gemm_tilings(rows, smoke, block_ns, splits, kind)
    hidden, mlp, d_v = s.hidden, s.mlp, s.channels
    d_k = s.jet_heads * s.key_dim
    silu_cols = 2 * d_k + s.generator
    shapes = {"fused input": (s.jet_in, hidden), "o_proj gated norm": (hidden, d_v), "gate|up": (2 * mlp, hidden),
              "down SwiGLU": (hidden, mlp)}  # fmt: skip
    if rows > public.GEMV_MAX_ROWS:  # past the prologues' rows the model runs these two plain (its norm and SiLU
        shapes |= {"o_proj plain": (hidden, d_v), "down plain": (hidden, mlp)}  # come from their own kernels)
    gen = torch.Generator(device=device).manual_seed(1)
    cases = []
    for name, (n, k) in shapes.items():
        copies = weight_copies(n * k * dtype.itemsize, device)
        weights = [(torch.randn(n, k, device=device, generator=gen) * k**-0.5).to(dtype) for _ in range(copies)]
        x = torch.randn(rows, 2 * k if "SwiGLU" in name else k, device=device, generator=gen).to(dtype)
        gate = torch.randn(rows, k, device=device, generator=gen).to(dtype)
        norm_weight = torch.randn(s.value_dim, device=device, generator=gen).to(dtype)

        def call(module, w, tiling, name=name, x=x, gate=gate, norm_weight=norm_weight):
            if name == "fused input":
                return module.linear(x, w, silu_cols=silu_cols, **tiling)
            if name == "o_proj gated norm":
                return module.gated_norm_linear(x, gate, norm_weight, 1e-6, w, **tiling)
            if name == "down SwiGLU":
                return module.swiglu_linear(x, w, **tiling)
            return module.linear(x, w, **tiling)

        want = call(reference, weights[0], {}).float()
        nbytes = (n * k + x.numel() + rows * n) * dtype.itemsize

        def run(tiling, call=call, weights=weights, want=want, nbytes=nbytes) -> tuple[float, float, int]:
            module, kw = (public, {}) if tiling is None else (kernels, {"tiling": tiling})
            got = call(module, weights[0], kw).float()
            err = float((got - want).abs().max() / want.abs().max())
            ms = time_ms(lambda: [call(module, w, kw) for w in weights], device)
            return ms / 1e3 / len(weights), err, nbytes

        max_rows = public.WIDE_MAX_ROWS if n >= public.WIDE_MIN_N else public.GEMV_MAX_ROWS  # the public op's limit
        picked = "cuBLAS" if rows > max_rows else kernels.choose_tiling(rows, n, k, kernels.sm_count(x.device))
        if name == "o_proj gated norm" and picked != "cuBLAS":
            picked = kernels.widened_tiling(picked, s.value_dim, n, k, kernels.sm_count(x.device))
        if name == "down SwiGLU" and picked != "cuBLAS":
            picked = kernels.swiglu_tiling(picked, n, k, kernels.sm_count(x.device))
        cases.append((f"{s.name} {name} {n}x{k} M={rows}", tilings, run, picked))
    return cases


def ints(text: str) -> tuple[int, ...]:
    """'1,2,4' → (1, 2, 4); '' → ()."""
    return tuple(int(v) for v in text.split(",") if v)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="2b")
    p.add_argument("--only", default="", choices=["", "conv", "verify", "gemm", "attn", "delta"])
    p.add_argument("--rows", default="1", help="rows of x for the GEMM cases, comma-separated")
    p.add_argument("--conv-rows", default="1,16", help="sequences for the conv decode cases, comma-separated")
    p.add_argument(
        "--verify-trees",
        default="1x7c,16x7c,64x7c,64x8t",
        help="conv verify batches: NxTc (N chains of T nodes) or NxTt (N binary trees), comma-separated",
    )
    p.add_argument("--attn-rows", default="1,64,256", help="sequences for the attention decode cases")
    p.add_argument("--delta-rows", default="64,256", help="sequences for the gated-delta-rule decode cases")
    p.add_argument("--cases", default="", help="only GEMM cases whose name holds one of these, comma-separated")
    p.add_argument("--block-n", default="", help="only GEMM tilings of these weight-tile widths, comma-separated")
    p.add_argument("--splits", default="", help="only GEMM tilings of these K splits, comma-separated")
    p.add_argument("--tile-kind", default="", choices=["", "fma", "dot"], help="only GEMM tilings of this kind")
    p.add_argument("--json")
    p.add_argument("--smoke", action="store_true", help="the CPU and the Triton interpreter, tiny shapes")
    args = p.parse_args()
    device, dtype = smoke_or_gpu(args.smoke)
    from common import SHAPES  # imports the ops (and their kernels): after the interpreter is set

    copy_bw, _ = ceilings(device)
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu (Triton interpreter)"
    print(f"{name}: copy {copy_bw / 1e9:.0f} GB/s (read + written); %copy = bandwidth / copy bandwidth")
    out = open(args.json, "a") if args.json else None
    for model in ["smoke"] if args.smoke else args.models.split(","):
        s = SHAPES[model]
        cases = []
        if args.only in ("", "conv"):
            cases += conv_cases(s, dtype, device, args.smoke, tuple(map(int, args.conv_rows.split(","))))
        if args.only in ("", "verify"):
            cases += conv_verify_cases(s, dtype, device, args.smoke, tuple(args.verify_trees.split(",")))
        if args.only in ("", "gemm"):
            for rows in map(int, args.rows.split(",") if not args.smoke else (1, 3)):
                cases += gemm_cases(
                    s, dtype, device, args.smoke, rows, ints(args.block_n), ints(args.splits), args.tile_kind
                )
        if args.only in ("", "attn"):
            cases += attn_cases(s, dtype, device, args.smoke, tuple(map(int, args.attn_rows.split(","))))
        if args.only in ("", "delta"):
            cases += delta_cases(s, dtype, device, args.smoke, tuple(map(int, args.delta_rows.split(","))))
        wanted = [c for c in args.cases.split(",") if c]
        for case, tilings, run, picked in cases:
            if wanted and "M=" in case and not any(c in case for c in wanted):
                continue
            rows = []
            failed = []
            for tiles in [None, *tilings]:  # None: what the heuristic picks now
                try:
                    seconds, err, nbytes = run(tiles)
                except Exception as e:  # noqa: BLE001 - a tiling the GPU cannot run (e.g. out of shared memory) is skipped
                    if tiles is None:
                        raise
                    failed.append(f"{tiles!r}: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
                    continue
                rows.append((seconds, tiles, err, nbytes))
            rows.sort(key=lambda r: r[0])
            print(f"\n{case}: {len(rows)} tilings, fastest first (heuristic = today's pick: {picked})")
            for line in failed:
                print(f"  skipped {line}")
            print(f"{'µs':>8} {'GB/s':>6} {'%copy':>6} {'max err':>9}  tiling")
            for seconds, tiles, err, nbytes in rows:
                gbps = nbytes / seconds / 1e9
                label = "heuristic" if tiles is None else repr(tiles)
                print(f"{seconds * 1e6:8.2f} {gbps:6.0f} {gbps * 1e9 / copy_bw:6.1%} {err:9.2e}  {label}")
                if out:
                    row = {"case": case, "tiling": label, "us": seconds * 1e6, "gb_per_s": gbps, "bytes": nbytes,
                           "copy_fraction": gbps * 1e9 / copy_bw, "max_err": err, "device": name,
                           "copy_gb_per_s": copy_bw / 1e9}  # fmt: skip
                    out.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
