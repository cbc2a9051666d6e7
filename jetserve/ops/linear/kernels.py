"""Triton skinny GEMM (GEMV) for decode-time linear layers: `y = x @ weightᵀ + bias` with few rows in x, which streams
the weight once. Each program owns BLOCK_N output features and a range of K; it loads each [BLOCK_N, BLOCK_K] weight
tile once and multiplies it by all (≤ BLOCK_M) rows of x, accumulating in fp32: on tensor cores (tl.dot, the weight
tile as the wide operand, rows of x padded to 16) or, for one row, with FMAs reduced over K once after the loop. When
too few programs cover N to fill the GPU, K is split too: each split writes fp32 partial sums and a second launch adds
them in a fixed order (deterministic; no atomics, no host sync: the launch can be captured in a CUDA graph).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from jetserve.ops.backend import sm_count
from jetserve.ops.linear.reference import (
    AddNorm,
    check_add_norm,
    check_gated_norm_linear,
    check_linear,
    check_swiglu_linear,
)
from jetserve.ops.norm import reference as norm_reference
from jetserve.ops.pdl import pdl_enter, pdl_exit, pdl_launch

MAX_BLOCK_M = 64  # rows of x one launch holds; more rows are processed in row blocks
FMA_PROGRAMS_PER_SM = 2  # FMA tiles (one row): split K until about this many programs per SM exist
FMA_LONG_K = 4096  # one-row FMA tiles: up to this K, 8 warps per program; past it, 2 rows per program (4 warps)
FMA_STAGES = 1  # one-row FMA tiles: the loop's pipeline depth (1: none; occupancy keeps the loads in flight)
MIN_TILES_PER_SPLIT = 8  # a K split streams at least this many BLOCK_K tiles (its pipeline's start-up is amortised)
NORM_MIN_TILES_PER_SPLIT = 3  # ... and at least this many of the gated-norm mode's head-wide tiles (`widened_tiling`)
SWIGLU_BLOCK_N = 128  # the SwiGLU mode's tensor-core tiles (`swiglu_tiling`): an x tile's silu(gate)·up feeds this
SWIGLU_WARPS = 8  # many weight rows, with this many warps
# fp32 operands on tensor-core tiles (16-bit ones ignore it): three TF32 products per term, the split operands' low
# parts included. Session 40 (H200, 2B shapes, weights from HBM, µs per call, the largest error against an fp64 product
# over the largest output), `ieee` → `tf32x3` (cuBLAS fp32 without TF32 beside): at 7 rows the fused input 136.8 → 38.3
# (35.9), gate|up 200.3 → 45.3 (66.9), down 86.7 → 25.1 (87.0), o_proj 51.2 → 15.9 (31.2); errors 0.8-1.8e-6 →
# 3.5-4.2e-7 (cuBLAS 1.6-9.8e-7). One row's FMA tiles take no dot.
FP32_DOT_PRECISION = "tf32x3"
PIPELINE_SMEM_BYTES = 200 * 1024  # what a tensor-core tiling's stages may hold (H100/H200: 227 KiB per block, less
# Triton's own scratch); fp32 tiles of the gated-norm prologue overflowed 227 KiB at 4 stages


@dataclass(frozen=True)
class GemvTiling:
    """One launch's tile sizes; `num_splits` > 1 splits K (fp32 partials, then a second reduction launch)."""

    block_m: int
    block_n: int
    block_k: int
    num_splits: int
    use_dot: bool
    num_warps: int = 4
    num_stages: int = 3  # loads in flight per program (the software pipeline's depth)


@triton.jit
def _linear_kernel(
    x,
    w,
    bias,
    y,
    partial,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    tiles_per_split,
    silu_cols,
    gate,
    stride_gm,
    norm_w,
    eps,
    residual,  # ADD_NORM: [M, N], the residual stream added to the output
    stride_rm,
    h,  # ADD_NORM: [M, N] out, output + residual (the new residual stream)
    sumsq,  # ADD_NORM: [M, programs along N] fp32 scratch, each program's sum of h² over its columns
    ticket,  # ADD_NORM: [1] int32, 0 between launches
    out_w,  # ADD_NORM: [N], the RMSNorm's weight
    out_eps,
    HAS_BIAS: tl.constexpr,
    HAS_SILU: tl.constexpr,  # SiLU on output columns [0, silu_cols), after the bias
    GATED: tl.constexpr,  # x holds [gate | up] (K columns each): the GEMM's input is silu(gate) * up
    NORM_HEAD: tl.constexpr,  # > 0: the input is gated_rms_norm(x, norm_w, gate) over heads of NORM_HEAD columns
    ADD_NORM: tl.constexpr,  # y = rms_norm(output + residual, out_w): the last program to finish normalises the rows
    BLOCK_ROW: tl.constexpr,  # ADD_NORM: next power of two ≥ N (a whole row in one tile)
    BLOCK_P: tl.constexpr,  # ADD_NORM: next power of two ≥ the programs along N
    IS_SPLIT: tl.constexpr,
    USE_DOT: tl.constexpr,
    EVEN_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,  # the loop's software pipeline: without it on the loop, loads feeding no dot (FMA tiles)
    # are never pipelined whatever the launch's num_stages (sm_90 PTX, session 54)
    PDL: tl.constexpr = False,  # programmatic dependent launch (`jetserve.ops.pdl`)
):
    i_n, i_s = tl.program_id(0), tl.program_id(1)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    o_m = tl.arange(0, BLOCK_M)
    m_n = o_n < N
    m_m = o_m < M
    num_tiles = tl.minimum(tiles_per_split, tl.cdiv(K, BLOCK_K) - i_s * tiles_per_split)
    o_k = i_s * tiles_per_split * BLOCK_K + tl.arange(0, BLOCK_K)
    # Weight rows past N read row N-1 instead of being masked (valid memory; those outputs are dropped at the store), so
    # the weight loads carry no mask at all when BLOCK_K divides K. Rows of x past M are masked to zero.
    r_n = tl.minimum(o_n, N - 1).to(tl.int64)
    p_w = w + r_n[:, None] * stride_wn + o_k[None, :]  # [BLOCK_N, BLOCK_K]
    p_x = x + o_m.to(tl.int64)[:, None] * stride_xm + o_k[None, :]  # [BLOCK_M, BLOCK_K]
    pdl_enter(PDL)  # x is the previous kernel's output
    if USE_DOT:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)  # yᵀ: the weight tile is the MMA's wide operand
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)  # reduced over K once, after the loop
    for i in tl.range(num_tiles, num_stages=NUM_STAGES):
        if EVEN_K:
            b_w = tl.load(p_w)
            if EVEN_M:
                b_x = tl.load(p_x)
                if GATED:
                    b_up = tl.load(p_x + K)
            else:
                b_x = tl.load(p_x, mask=m_m[:, None], other=0.0)
                if GATED:
                    b_up = tl.load(p_x + K, mask=m_m[:, None], other=0.0)
        else:
            m_k = (o_k + i * BLOCK_K) < K
            b_w = tl.load(p_w, mask=m_k[None, :], other=0.0)
            b_x = tl.load(p_x, mask=m_m[:, None] & m_k[None, :], other=0.0)
            if GATED:
                b_up = tl.load(p_x + K, mask=m_m[:, None] & m_k[None, :], other=0.0)
        if GATED:  # silu_and_mul's math and rounding: fp32, one rounding to x's dtype (0 where masked)
            b_gate = b_x.to(tl.float32)
            b_x = (b_gate * tl.sigmoid(b_gate) * b_up.to(tl.float32)).to(x.dtype.element_ty)
        if NORM_HEAD > 0:  # gated_rms_norm's math and rounding; a tile holds whole heads (BLOCK_K % NORM_HEAD == 0)
            o_kk = o_k + i * BLOCK_K
            m_g = m_m[:, None] & (o_kk < K)[None, :]
            b_g = tl.load(gate + o_m.to(tl.int64)[:, None] * stride_gm + o_kk[None, :], mask=m_g, other=0.0)
            b_g = b_g.to(tl.float32)
            b_nw = tl.load(norm_w + o_kk % NORM_HEAD, mask=o_kk < K, other=0.0).to(tl.float32)  # [BLOCK_K]
            b_o = tl.reshape(b_x.to(tl.float32), (BLOCK_M, BLOCK_K // NORM_HEAD, NORM_HEAD))
            b_ms = tl.sum(b_o * b_o, axis=2) / NORM_HEAD  # [BLOCK_M, heads in the tile]
            b_o = tl.reshape(b_o * tl.rsqrt(b_ms + eps)[:, :, None], (BLOCK_M, BLOCK_K))
            b_x = (b_o * b_nw[None, :] * (b_g * tl.sigmoid(b_g))).to(x.dtype.element_ty)
        if USE_DOT:
            acc = tl.dot(b_w, tl.trans(b_x), acc, input_precision=INPUT_PRECISION)
        else:
            acc += b_x.to(tl.float32)[:, None, :] * b_w.to(tl.float32)[None, :, :]
        p_w += BLOCK_K
        p_x += BLOCK_K
    pdl_exit(PDL)  # the next kernel's programs may start during this one's epilogue and tail
    if USE_DOT:
        b_y = tl.trans(acc)  # [BLOCK_M, BLOCK_N]
    else:
        b_y = tl.sum(acc, axis=2)  # [BLOCK_M, BLOCK_N]
    m_y = m_m[:, None] & m_n[None, :]
    o_y = o_m.to(tl.int64)[:, None] * N + o_n[None, :]
    if IS_SPLIT:
        tl.store(partial + i_s.to(tl.int64) * M * N + o_y, b_y, mask=m_y)
    else:
        if HAS_BIAS:
            b_y += tl.load(bias + o_n, mask=m_n, other=0.0).to(tl.float32)[None, :]
        if HAS_SILU:
            b_y = tl.where(o_n[None, :] < silu_cols, b_y * tl.sigmoid(b_y), b_y)
        if ADD_NORM:
            _add_norm_epilogue(b_y, residual, stride_rm, h, sumsq, ticket, out_w, out_eps, y, o_m, o_n, m_m, m_y, M,
                               N, BLOCK_ROW, BLOCK_P)  # fmt: skip
        else:
            tl.store(y + o_y, b_y.to(y.dtype.element_ty), mask=m_y)


@triton.jit
def _add_norm_epilogue(
    b_y, residual, stride_rm, h, sumsq, ticket, out_w, out_eps, y, o_m, o_n, m_m, m_y, M, N,
    BLOCK_ROW: tl.constexpr, BLOCK_P: tl.constexpr,
):  # fmt: skip
    """`rms_norm(b_y, out_w, out_eps, residual)` for the rows of a launch whose programs each hold BLOCK_N columns
    of b_y [BLOCK_M, BLOCK_N] (fp32, before its rounding). Each program writes its columns of h = round(b_y) + residual
    (rounded, as the norm's add) and its rows' sums of h² over them, then takes a ticket; the last program to take one
    sums each row's partial sums in program order (deterministic: no float atomics), writes the normalised rows and
    puts the ticket counter back to 0. The ticket's acquire-release makes every program's stores visible to the last."""
    i_n = tl.program_id(0)
    num_pn = tl.num_programs(0)
    o_y = o_m.to(tl.int64)[:, None] * N + o_n[None, :]
    b_r = tl.load(residual + o_m.to(tl.int64)[:, None] * stride_rm + o_n[None, :], mask=m_y, other=0.0)
    b_h = (b_y.to(y.dtype.element_ty).to(tl.float32) + b_r.to(tl.float32)).to(y.dtype.element_ty)
    tl.store(h + o_y, b_h, mask=m_y)
    b_h32 = tl.where(m_y, b_h.to(tl.float32), 0.0)
    tl.store(sumsq + o_m * num_pn + i_n, tl.sum(b_h32 * b_h32, axis=1), mask=m_m)
    # every thread's stores done before the one thread that takes the ticket releases them (the classic "last block"
    # pattern: the barrier, then a gpu-scope release; the last program's loads bypass L1)
    tl.debug_barrier()
    if tl.atomic_add(ticket, 1, sem="acq_rel", scope="gpu") == num_pn - 1:
        o_p = tl.arange(0, BLOCK_P)
        o_c = tl.arange(0, BLOCK_ROW)
        m_c = o_c < N
        b_w = tl.load(out_w + o_c, mask=m_c, other=0.0).to(tl.float32)
        for row in range(M):  # row * N fits 32 bits: a launch holds at most MAX_BLOCK_M rows
            b_ss = tl.load(sumsq + row * num_pn + o_p, mask=o_p < num_pn, other=0.0, cache_modifier=".cg")
            rstd = tl.rsqrt(tl.sum(b_ss, axis=0) / N + out_eps)
            b_row = tl.load(h + row * N + o_c, mask=m_c, other=0.0, cache_modifier=".cg")
            b_out = b_w * (b_row.to(tl.float32) * rstd)
            tl.store(y + row * N + o_c, b_out.to(y.dtype.element_ty), mask=m_c)
        tl.atomic_xchg(ticket, 0)


@triton.jit
def _split_sum_kernel(
    partial,
    bias,
    y,
    M,
    N,
    num_splits,
    silu_cols,
    residual,  # ADD_NORM: as `_linear_kernel`'s
    stride_rm,
    h,
    out_w,
    out_eps,
    HAS_BIAS: tl.constexpr,
    HAS_SILU: tl.constexpr,
    ADD_NORM: tl.constexpr,  # a program holds a whole row (BLOCK_N ≥ N): it normalises the row itself
    BLOCK_N: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_enter(PDL)
    i_m, i_n = tl.program_id(0).to(tl.int64), tl.program_id(1)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < N
    b_y = tl.zeros([BLOCK_N], dtype=tl.float32)
    for i_s in range(num_splits):  # a fixed order: the result does not depend on which split finished first
        b_y += tl.load(partial + (i_s * M + i_m) * N + o_n, mask=m_n, other=0.0)
    if HAS_BIAS:
        b_y += tl.load(bias + o_n, mask=m_n, other=0.0).to(tl.float32)
    if HAS_SILU:
        b_y = tl.where(o_n < silu_cols, b_y * tl.sigmoid(b_y), b_y)
    if ADD_NORM:  # rms_norm's add (rounded) and its fp32 normalisation, with the row in registers
        b_r = tl.load(residual + i_m * stride_rm + o_n, mask=m_n, other=0.0).to(tl.float32)
        b_h = (b_y.to(y.dtype.element_ty).to(tl.float32) + b_r).to(y.dtype.element_ty)
        tl.store(h + i_m * N + o_n, b_h, mask=m_n)
        b_h32 = tl.where(m_n, b_h.to(tl.float32), 0.0)
        rstd = tl.rsqrt(tl.sum(b_h32 * b_h32, axis=0) / N + out_eps)
        b_y = tl.load(out_w + o_n, mask=m_n, other=0.0).to(tl.float32) * (b_h32 * rstd)
    tl.store(y + i_m * N + o_n, b_y.to(y.dtype.element_ty), mask=m_n)
    pdl_exit(PDL)


@triton.jit
def _silu_columns_kernel(y, cols, stride_m, BLOCK_N: tl.constexpr, PDL: tl.constexpr = False):
    """Row i_m, columns [i_n·BLOCK_N, +BLOCK_N) ∩ [0, cols): y ← silu(y) in fp32, one rounding (torch's formula)."""
    pdl_enter(PDL)
    i_m, i_n = tl.program_id(0).to(tl.int64), tl.program_id(1)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < cols
    p_y = y + i_m * stride_m + o_n
    b_y = tl.load(p_y, mask=m_n, other=0.0).to(tl.float32)
    tl.store(p_y, (b_y / (1.0 + tl.exp(-b_y))).to(y.dtype.element_ty), mask=m_n)
    pdl_exit(PDL)


SILU_BLOCK_N = 1024  # columns a program of `silu_columns_` takes


def silu_columns_(y: torch.Tensor, cols: int) -> torch.Tensor:
    """In place, `y[..., :cols] = silu(y[..., :cols])` (fp32 inside, one rounding): the SiLU of the JetBlock's fused
    input projection where cuBLAS ran the GEMM (past the Triton GEMM's rows), one launch over the rows' leading
    columns where torch's in-place SiLU on that strided slice takes its generic strided kernel. y [..., N], rows may
    be strided, unit stride along N. Returns y."""
    if not 0 <= cols <= y.shape[-1] or y.stride(-1) != 1:
        raise ValueError(f"silu_columns_: cols {cols} must be in [0, {y.shape[-1]}] of a y with unit last stride")
    rows = y.view(-1, y.shape[-1]) if y.dim() != 2 else y  # [M, N]
    if rows.shape[0] and cols:
        grid = (rows.shape[0], triton.cdiv(cols, SILU_BLOCK_N))
        _silu_columns_kernel[grid](rows, cols, rows.stride(0), BLOCK_N=SILU_BLOCK_N, **pdl_launch(rows))
    return y


BATCHED_MIN_ROWS = 128  # rows from which `batched_splits` splits (fewer: cuBLAS's own choice was as fast or faster)
BATCHED_MAX_ROWS = 512  # ... and up to which (decode batches; a prefill's GEMMs fill the GPU)
BATCHED_MAX_SPLITS = 4  # at most this many splits ...
BATCHED_MIN_CHUNK = 1536  # ... each a run of K at least this long


def batched_splits(num_rows: int, k: int) -> int:
    """How many K splits `batched_split_linear` takes for num_rows rows of a narrow projection over K (0: none —
    cuBLAS then the norm op): the largest divisor of K up to BATCHED_MAX_SPLITS whose runs are at least
    BATCHED_MIN_CHUNK long, for BATCHED_MIN_ROWS to BATCHED_MAX_ROWS rows; none when one split would do.

    Session 29's sweep (H200, bf16, weights from HBM, µs against cuBLAS then the norm op; .dev probe): the 2B's down
    (1536 x 8960) at 256 rows 20.28 → 17.58 with 4 splits (5: 18.80, 10: 23.25), at 128 14.48 → 14.49, at 64 13.44 →
    13.90 (10 splits: 16.74); o_proj (1536 x 3072) at 256 / 128 / 64 rows 10.44 / 9.72 / 9.19 → 9.94 / 9.03 / 8.55 with
    2 splits (8: 14.08 / 11.71 / 11.22); the attention's o (1536 x 1536) within ±0.1 unsplit, slower split."""
    if not BATCHED_MIN_ROWS <= num_rows <= BATCHED_MAX_ROWS:
        return 0
    wanted = min(BATCHED_MAX_SPLITS, k // BATCHED_MIN_CHUNK)
    splits = max((s for s in range(1, wanted + 1) if k % s == 0), default=1)
    return splits if splits > 1 else 0


def batched_split_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, add_norm: AddNorm, num_splits: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`linear(x, weight, bias, add_norm=add_norm)` for rows past the Triton GEMM's (the narrow projections that
    cuBLAS runs, each followed by the next RMSNorm): K cut into `num_splits` equal runs, their fp32 partial products
    [S, M, N] as one batched GEMM (`torch.bmm`, cuBLAS on a GPU, fp32 out for fp16/bf16), then `_split_sum_kernel`
    sums them in a fixed order, adds the bias, rounds once, adds the residual and normalises each row in registers
    — where cuBLAS's own split-K sum, the norm's launch and its reads of y were. num_splits must divide K. x [M, K]
    (any leading dims, unit stride along K or copied), weight [N, K] → (normed, y + residual), as `linear`'s pair."""
    check_linear(x, weight, bias)
    lead, k = x.shape[:-1], weight.shape[1]
    n = weight.shape[0]
    check_add_norm(add_norm, (*lead, n), x.dtype)
    if num_splits < 1 or k % num_splits:
        raise ValueError(f"batched_split_linear: num_splits {num_splits} must divide K = {k}")
    num_rows = math.prod(lead)
    residual, out_w, out_eps = add_norm
    if num_rows == 0 or n == 0 or k == 0:  # no kernel: the reference's composition
        return norm_reference.rms_norm(_linear(x, weight, bias, None, gated=False), out_w, out_eps, residual)
    x2 = x.reshape(num_rows, k)  # [M, K]
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    residual = residual.reshape(num_rows, n)
    if residual.stride(-1) != 1:
        residual = residual.contiguous()
    chunk = k // num_splits
    xs = x2.as_strided((num_splits, num_rows, chunk), (chunk, x2.stride(0), 1))  # [S, M, K/S]
    ws = weight.as_strided((num_splits, chunk, n), (chunk, 1, weight.stride(0)))  # [S, K/S, N]
    partial = _batched_product(xs, ws)  # [S, M, N] fp32
    y = torch.empty(num_rows, n, dtype=x.dtype, device=x.device)  # [M, N]
    h = torch.empty_like(y)  # [M, N]
    _split_sum_kernel[(num_rows, 1)](
        partial, bias if bias is not None else y, y, num_rows, n, num_splits, 0, residual, residual.stride(0), h,
        out_w, float(out_eps), HAS_BIAS=bias is not None, HAS_SILU=False, ADD_NORM=True,
        BLOCK_N=triton.next_power_of_2(n), **pdl_launch(x),
    )  # fmt: skip
    return y.view(*lead, n), h.view(*lead, n)


def _batched_product(xs: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:
    """xs [S, M, K'] @ ws [S, K', N] → [S, M, N] fp32: cuBLAS's fp32-out batched GEMM for fp16/bf16 on CUDA (fp32
    accumulation, no rounding to the inputs' dtype), else the product of the widened operands."""
    if xs.is_cuda and xs.dtype in (torch.float16, torch.bfloat16):
        return torch.bmm(xs, ws, out_dtype=torch.float32)
    return torch.bmm(xs.float(), ws.float())


def choose_tiling(num_rows: int, n: int, k: int, num_sms: int) -> GemvTiling:
    """Tiles for a [num_rows, k] x [n, k]ᵀ product (num_rows ≤ MAX_BLOCK_M) on a GPU of `num_sms` SMs.

    From a sweep of tiles, pipeline depths and splits on an H200 (bf16, the 2B/4B decode shapes, weights read from HBM):
    - Tensor-core tiles of 64 x 128 (rows padded to 16) are best from 2 rows on, and for one row once N alone gives
      every SM a tile. One program per SM with a 4-stage pipeline keeps enough bytes in flight; more programs than fit
      at once (2 per SM at 4 stages, 3 at 3 stages) cost a second wave, so a wide N takes 3 stages.
    - One row with a narrower N takes FMA tiles (no shared memory, many programs per SM) of 1024 columns of K, and
      twice the warps in flight of the first sweep's 4 x 1024 with 4 warps: 8 warps for K ≤ FMA_LONG_K, half the
      rows (2, so twice the programs) past it. Session 17's sweep at the 2B shapes in the model's modes, weights from
      HBM: the gated-norm o_proj (1536 x 3072) 6.83 → 6.27 µs, the SwiGLU down projection (1536 x 8960) 13.27 →
      11.72 µs; the decode graph at batch 1 1.831 → 1.771 ms. (The 4B shapes follow the rule, not measured.)
      Session 21 swept 2048-column steps too: faster in the plain mode (o_proj 5.38 → 5.05 µs, down 10.51 → 9.75)
      but slower in the model's (gated-norm o_proj 5.78 → 6.03, SwiGLU down 11.34 → 12.33), so the rule stayed.
    - K is split (fp32 partials and a second launch) only to give each SM a program, and only into runs of at least
      MIN_TILES_PER_SPLIT tiles: shorter runs lose to their pipeline's start-up and the extra launch.
    - Past 32 rows (a 64-row tile), 64-wide K steps at 4 stages: session 20's sweep at 64 rows (2B, weights from HBM),
      fused input 15.02 → 12.97 µs and gate|up 20.97 → 17.54 µs against the 32-row rule's tiles (cuBLAS: 13.33, 18.85).
    """
    assert 0 < num_rows <= MAX_BLOCK_M
    use_dot = num_rows > 1 or triton.cdiv(n, 64) >= num_sms
    if use_dot:
        block_m = max(16, triton.next_power_of_2(num_rows))
        block_n = min(64, max(16, triton.next_power_of_2(n)))
        block_k = min(64 if block_m > 32 else 128, max(16, triton.next_power_of_2(k)))
        programs_n = triton.cdiv(n, block_n)
        num_stages = 4 if programs_n <= 2 * num_sms or block_m > 32 else 3
        wanted_splits = num_sms // programs_n
        num_warps = 4
    else:
        long_k = k > FMA_LONG_K
        block_m, block_n, num_stages = 1, min(2 if long_k else 4, triton.next_power_of_2(n)), FMA_STAGES
        block_k = min(1024, triton.next_power_of_2(k))
        programs_n = triton.cdiv(n, block_n)
        wanted_splits = FMA_PROGRAMS_PER_SM * num_sms // programs_n
        num_warps = 4 if long_k else 8
    num_splits = _splits(triton.cdiv(k, block_k), wanted_splits, MIN_TILES_PER_SPLIT)
    return GemvTiling(block_m, block_n, block_k, num_splits, use_dot, num_warps=num_warps, num_stages=num_stages)


def _splits(num_tiles: int, wanted: int, min_tiles: int) -> int:
    """K splits of num_tiles tiles: up to `wanted` (the programs that fill the GPU), each a run of at least
    `min_tiles` tiles, and no split left without a tile."""
    num_splits = max(1, min(wanted, num_tiles // min_tiles))
    return triton.cdiv(num_tiles, triton.cdiv(num_tiles, num_splits))


def widened_tiling(t: GemvTiling, head: int, n: int, k: int, num_sms: int) -> GemvTiling:
    """`t` with K tiles holding whole heads of `head` columns (the gated-norm prologue), its K split chosen again for
    the wider tiles: every SM a program, down to runs of NORM_MIN_TILES_PER_SPLIT of them. The 2B's o_proj (1536 x
    3072, heads of 256) at 7 and 16 rows: 3 splits of 4 tiles (the 128-wide rule's count) 10.82 / 10.59 µs, 4 of 3
    tiles 8.74-9.46 / 9.31-9.44 (session 28, H200, weights from HBM)."""
    if t.block_k % head == 0:
        return t
    block_k = max(t.block_k, head)
    if not t.use_dot:
        return dataclasses.replace(t, block_k=block_k)
    num_splits = _splits(triton.cdiv(k, block_k), num_sms // triton.cdiv(n, t.block_n), NORM_MIN_TILES_PER_SPLIT)
    return dataclasses.replace(t, block_k=block_k, num_splits=num_splits)


def swiglu_tiling(t: GemvTiling, n: int, k: int, num_sms: int) -> GemvTiling:
    """`t` for the SwiGLU mode (`swiglu_linear`): tensor-core tiles take SWIGLU_BLOCK_N weight rows with SWIGLU_WARPS
    warps, so each x tile's silu(gate)·up prologue, computed in registers by every program, feeds twice the weight of
    the 64-wide tiles; the K split is chosen again for the wider tiles (every SM a program). FMA tiles (one row) and
    an N no wider than t's tile are kept. Session 35's sweep (`bench/tile_sweep.py --only gemm --rows 7 --tile-kind
    dot`, H200, bf16, weights from HBM, 97 tilings): the 2B's down (1536 x 8960) at 7 rows 16.71 µs with 64-wide tiles
    and 5 splits, 12.57 with 128-wide tiles, 8 warps and 8 splits (the fastest; 4 warps 14.34 with 64-wide K steps)."""
    if not t.use_dot or n <= t.block_n or t.block_n >= SWIGLU_BLOCK_N:
        return t
    num_splits = _splits(triton.cdiv(k, t.block_k), num_sms // triton.cdiv(n, SWIGLU_BLOCK_N), MIN_TILES_PER_SPLIT)
    return dataclasses.replace(t, block_n=SWIGLU_BLOCK_N, num_warps=SWIGLU_WARPS, num_splits=num_splits)


def fit_pipeline(t: GemvTiling, element_size: int, gated: bool, norm: tuple | None) -> GemvTiling:
    """Fewer pipeline stages where one stage's tiles (a weight tile, the rows' x tile, and the gate tile of a gated or
    normed prologue) times the stages would not fit PIPELINE_SMEM_BYTES: fp32 tiles are twice bf16's."""
    if not t.use_dot:
        return t
    x_tiles = 1 + (gated or norm is not None)
    stage_bytes = (t.block_n + x_tiles * t.block_m) * t.block_k * element_size
    stages = max(1, min(t.num_stages, PIPELINE_SMEM_BYTES // stage_bytes))
    return t if stages == t.num_stages else dataclasses.replace(t, num_stages=stages)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    silu_cols: int = 0,
    tiling: GemvTiling | None = None,
    add_norm: AddNorm | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`y = x @ weightᵀ + bias`, fp32 accumulation, one rounding to x.dtype; see `reference.linear`. With `add_norm`
    = (residual [M, N], norm_weight [N], eps): `rms_norm(y, norm_weight, eps, residual)`'s pair in the same launch.

    x [M, K] (any leading dims; rows may be strided, K must have unit stride or x is copied), weight [N, K], bias [N] or
    None → y [M, N] in x.dtype. `silu_cols` > 0 applies SiLU to output columns [0, silu_cols) before the rounding.
    Meant for few rows (decode); more than MAX_BLOCK_M rows run as several launches. `tiling` overrides the heuristic
    (`choose_tiling`), for tests and tuning.
    """
    check_linear(x, weight, bias, silu_cols)
    return _linear(x, weight, bias, tiling, gated=False, silu_cols=silu_cols, add_norm=add_norm)


def swiglu_linear(
    x: torch.Tensor, weight: torch.Tensor, *, tiling: GemvTiling | None = None, add_norm: AddNorm | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`silu(x[:, :K]) * x[:, K:]` (rounded to x.dtype, as `silu_and_mul`) times weightᵀ in one launch: the MLP's
    activation and down projection, without the [M, K] activation written and read back. x [M, 2K] (any leading
    dims), weight [N, K] → [M, N] in x.dtype; see `reference.swiglu_linear`. `add_norm` as `linear`'s."""
    check_swiglu_linear(x, weight)
    num_rows = min(MAX_BLOCK_M, math.prod(x.shape[:-1]))
    if tiling is None and num_rows and weight.numel():  # (no launch without rows, or over an empty weight)
        (n, k), num_sms = weight.shape, sm_count(x.device)
        tiling = swiglu_tiling(choose_tiling(num_rows, n, k, num_sms), n, k, num_sms)
    return _linear(x, weight, None, tiling, gated=True, add_norm=add_norm)


def gated_norm_linear(
    o: torch.Tensor,
    gate: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    *,
    tiling: GemvTiling | None = None,
    add_norm: AddNorm | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`gated_rms_norm` over heads of V = norm_weight's size, then times weightᵀ, in one launch: the JetBlock's output
    norm and o_proj. o and gate [M, H·V] (gate may be a strided view), norm_weight [V] (a power of two), weight
    [N, H·V] → [M, N] in o.dtype; see `reference.gated_norm_linear`. `add_norm` as `linear`'s."""
    check_gated_norm_linear(o, gate, norm_weight, weight)
    head = norm_weight.shape[0]
    num_rows, k = o.shape
    if tiling is None:
        n, num_sms = weight.shape[0], sm_count(o.device)
        t = widened_tiling(choose_tiling(num_rows, n, k, num_sms), head, n, k, num_sms)
    else:
        t = tiling if tiling.block_k % head == 0 else dataclasses.replace(tiling, block_k=max(tiling.block_k, head))
    norm = (gate if gate.stride(-1) == 1 else gate.contiguous(), norm_weight.contiguous(), float(eps), head)
    return _linear(o, weight, None, t, gated=False, norm=norm, add_norm=add_norm)


def _linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    tiling: GemvTiling | None,
    gated: bool,
    silu_cols: int = 0,
    norm: tuple[torch.Tensor, torch.Tensor, float, int] | None = None,
    add_norm: AddNorm | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    lead, k = x.shape[:-1], weight.shape[1]
    n = weight.shape[0]
    num_rows = math.prod(lead)
    x2 = x.reshape(num_rows, x.shape[-1])  # [M, K] ([M, 2K] gated), a view where x's layout allows
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    y = torch.empty(num_rows, n, dtype=x.dtype, device=x.device)  # [M, N]
    if add_norm is not None:
        check_add_norm(add_norm, (*lead, n), x.dtype)
        residual, out_w, out_eps = add_norm
        residual = residual.reshape(num_rows, n)
        if residual.stride(-1) != 1:
            residual = residual.contiguous()
        if num_rows == 0 or n == 0 or k == 0:  # no kernel: the reference's composition
            y = _linear(x, weight, bias, tiling, gated, silu_cols, norm).reshape(num_rows, n)
            out, h = norm_reference.rms_norm(y, out_w, out_eps, residual)
            return out.view(*lead, n), h.view(*lead, n)
        h = torch.empty_like(y)  # [M, N]
        for start in range(0, num_rows, MAX_BLOCK_M):
            rows = min(MAX_BLOCK_M, num_rows - start)
            rows_norm = None if norm is None else (norm[0][start : start + rows], *norm[1:])
            rows_add = (residual[start : start + rows], out_w, float(out_eps), h[start : start + rows])
            _launch(x2[start : start + rows], weight, bias, y[start : start + rows], tiling, gated, silu_cols,
                    rows_norm, rows_add)  # fmt: skip
        return y.view(*lead, n), h.view(*lead, n)
    if num_rows == 0 or n == 0:
        return y.view(*lead, n)
    if k == 0:  # an empty sum: the kernels' addressing assumes at least one column
        y.copy_(bias.expand(num_rows, n) if bias is not None else torch.zeros_like(y))
        if silu_cols:
            y[:, :silu_cols] = torch.nn.functional.silu(y[:, :silu_cols].float()).to(y.dtype)
        return y.view(*lead, n)
    for start in range(0, num_rows, MAX_BLOCK_M):
        rows = min(MAX_BLOCK_M, num_rows - start)
        rows_norm = None if norm is None else (norm[0][start : start + rows], *norm[1:])
        _launch(x2[start : start + rows], weight, bias, y[start : start + rows], tiling, gated, silu_cols, rows_norm)
    return y.view(*lead, n)


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    y: torch.Tensor,
    tiling: GemvTiling | None,
    gated: bool,
    silu_cols: int,
    norm: tuple[torch.Tensor, torch.Tensor, float, int] | None,
    add: tuple[torch.Tensor, torch.Tensor, float, torch.Tensor] | None = None,  # (residual, out_w, out_eps, h)
) -> None:
    num_rows = x.shape[0]
    n, k = weight.shape
    t = fit_pipeline(tiling or choose_tiling(num_rows, n, k, sm_count(x.device)), x.element_size(), gated, norm)
    if t.block_m < num_rows:
        raise ValueError(f"tiling: block_m {t.block_m} holds fewer than the {num_rows} rows of x")
    num_tiles = triton.cdiv(k, t.block_k)
    tiles_per_split = triton.cdiv(num_tiles, t.num_splits)
    num_splits = triton.cdiv(num_tiles, tiles_per_split)
    is_split = num_splits > 1
    partial = torch.empty(num_splits, num_rows, n, dtype=torch.float32, device=x.device) if is_split else y
    programs_n = triton.cdiv(n, t.block_n)
    add_in_gemm = add is not None and not is_split  # split: the sum's launch holds whole rows and adds instead
    if add_in_gemm:
        residual, out_w, out_eps, h = add
        sumsq = torch.empty(num_rows, programs_n, dtype=torch.float32, device=x.device)  # [M, programs along N]
        ticket = _ticket(x.device)
    else:
        residual, out_w, out_eps, h, sumsq, ticket = y, y, 0.0, y, partial, y
    pdl = pdl_launch(x)
    _linear_kernel[(programs_n, num_splits)](
        x,
        weight,
        bias if bias is not None else y,
        y,
        partial,
        num_rows,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        tiles_per_split,
        silu_cols,
        norm[0] if norm else x,
        norm[0].stride(0) if norm else 0,
        norm[1] if norm else x,
        norm[2] if norm else 0.0,
        residual,
        residual.stride(0),
        h,
        sumsq,
        ticket,
        out_w,
        out_eps,
        HAS_BIAS=bias is not None,
        HAS_SILU=silu_cols > 0,
        GATED=gated,
        NORM_HEAD=norm[3] if norm else 0,
        ADD_NORM=add_in_gemm,
        BLOCK_ROW=triton.next_power_of_2(n) if add_in_gemm else 1,
        BLOCK_P=triton.next_power_of_2(programs_n) if add_in_gemm else 1,
        IS_SPLIT=is_split,
        USE_DOT=t.use_dot,
        EVEN_M=num_rows == t.block_m,
        EVEN_K=k % t.block_k == 0,
        INPUT_PRECISION=FP32_DOT_PRECISION if x.dtype == torch.float32 else "tf32",
        BLOCK_M=t.block_m,
        BLOCK_N=t.block_n,
        BLOCK_K=t.block_k,
        NUM_STAGES=t.num_stages,
        num_warps=t.num_warps,
        num_stages=t.num_stages,
        **pdl,
    )
    if is_split:
        # a whole row per program to normalise it; else up to 1024 columns
        block_n = triton.next_power_of_2(n) if add is not None else min(1024, triton.next_power_of_2(n))
        residual, out_w, out_eps, h = add if add is not None else (y, y, 0.0, y)
        _split_sum_kernel[(num_rows, triton.cdiv(n, block_n))](
            partial,
            bias if bias is not None else y,
            y,
            num_rows,
            n,
            num_splits,
            silu_cols,
            residual,
            residual.stride(0),
            h,
            out_w,
            out_eps,
            HAS_BIAS=bias is not None,
            HAS_SILU=silu_cols > 0,
            ADD_NORM=add is not None,
            BLOCK_N=block_n,
            **pdl,
        )


@functools.cache
def _ticket(device: torch.device) -> torch.Tensor:
    """The add-norm epilogue's ticket counter on `device`: [1] int32, allocated (zeroed) once, eagerly — a first use
    inside a CUDA graph capture would allocate it in the graph's pool — and put back to 0 by every launch that uses
    it. Launches on one stream run one after another, so they share it."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("linear add_norm: run it once eagerly before capturing a CUDA graph (its ticket counter)")
    return torch.zeros(1, dtype=torch.int32, device=device)
