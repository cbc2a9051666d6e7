"""Triton variants of the norm ops: one-pass RMSNorm (optionally fused with the residual add), per-head gated RMSNorm,
and silu_and_mul. Same signatures and numerics as `reference.py` (fp32 inside, one rounding per output).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from jetserve.ops.norm.reference import (
    check_embed_norm_pair,
    check_gated_rms_norm,
    check_rms_norm,
    check_silu_and_mul,
)
from jetserve.ops.pdl import pdl_enter, pdl_exit, pdl_launch

MAX_BLOCK_D = 32768  # a whole row lives in registers: one pass, no second read of x
TILE_ELEMENTS = 4096  # rows per program are chosen so a tile holds about this many elements


@triton.jit
def _rms_norm_kernel(
    x,
    r,
    w,
    y,
    h,
    stride_x,
    stride_r,
    num_rows,
    D,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr = False,  # programmatic dependent launch (`jetserve.ops.pdl`)
):
    pdl_enter(PDL)
    i_r = tl.program_id(0)
    o_r = (i_r * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < D
    m_x = (o_r < num_rows)[:, None] & m_d[None, :]
    b_x = tl.load(x + o_r[:, None] * stride_x + o_d[None, :], mask=m_x, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        b_x += tl.load(r + o_r[:, None] * stride_r + o_d[None, :], mask=m_x, other=0.0).to(tl.float32)
        # the new residual stream is rounded to the model dtype, and the norm reads the rounded value
        b_h = b_x.to(h.dtype.element_ty)
        tl.store(h + o_r[:, None] * D + o_d[None, :], b_h, mask=m_x)
        b_x = b_h.to(tl.float32)
    b_rstd = 1.0 / tl.sqrt(tl.sum(b_x * b_x, axis=1) / D + eps)  # [BLOCK_R]
    b_w = tl.load(w + o_d, mask=m_d, other=0.0).to(tl.float32)
    b_y = b_w[None, :] * (b_x * b_rstd[:, None])
    tl.store(y + o_r[:, None] * D + o_d[None, :], b_y.to(y.dtype.element_ty), mask=m_x)
    pdl_exit(PDL)


@triton.jit
def _embed_norm_pair_kernel(
    ids,
    table,
    hidden,
    w_e,
    w_h,
    y,
    stride_ids,
    stride_table,
    stride_hidden,
    H,
    eps,
    BLOCK_H: tl.constexpr,
    PDL: tl.constexpr = False,  # programmatic dependent launch (`jetserve.ops.pdl`)
):
    """One row per program: y[t, :H] = rms_norm(table[ids[t]]), y[t, H:] = rms_norm(hidden[t])."""
    pdl_enter(PDL)  # ids and hidden are earlier kernels' outputs
    i_t = tl.program_id(0).to(tl.int64)
    o_h = tl.arange(0, BLOCK_H)
    m_h = o_h < H
    row = tl.load(ids + i_t * stride_ids).to(tl.int64)
    b_e = tl.load(table + row * stride_table + o_h, mask=m_h, other=0.0).to(tl.float32)
    b_x = tl.load(hidden + i_t * stride_hidden + o_h, mask=m_h, other=0.0).to(tl.float32)
    b_we = tl.load(w_e + o_h, mask=m_h, other=0.0).to(tl.float32)
    b_wh = tl.load(w_h + o_h, mask=m_h, other=0.0).to(tl.float32)
    rstd_e = 1.0 / tl.sqrt(tl.sum(b_e * b_e, axis=0) / H + eps)
    rstd_x = 1.0 / tl.sqrt(tl.sum(b_x * b_x, axis=0) / H + eps)
    p_y = y + i_t * 2 * H + o_h
    tl.store(p_y, (b_we * (b_e * rstd_e)).to(y.dtype.element_ty), mask=m_h)
    tl.store(p_y + H, (b_wh * (b_x * rstd_x)).to(y.dtype.element_ty), mask=m_h)
    pdl_exit(PDL)


@triton.jit
def _gated_rms_norm_kernel(
    o,
    g,
    w,
    y,
    stride_ot,
    stride_oh,
    stride_gt,
    stride_gh,
    num_rows,
    H,
    V,
    eps,
    BLOCK_R: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    i_r = tl.program_id(0)
    o_r = (i_r * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)  # row = token * H + head
    i_t = o_r // H
    i_h = o_r % H
    o_v = tl.arange(0, BLOCK_V)
    m_v = o_v < V
    m_x = (o_r < num_rows)[:, None] & m_v[None, :]
    p_o = o + (i_t * stride_ot + i_h * stride_oh)[:, None] + o_v[None, :]
    p_g = g + (i_t * stride_gt + i_h * stride_gh)[:, None] + o_v[None, :]
    b_o = tl.load(p_o, mask=m_x, other=0.0).to(tl.float32)
    b_g = tl.load(p_g, mask=m_x, other=0.0).to(tl.float32)
    b_rstd = 1.0 / tl.sqrt(tl.sum(b_o * b_o, axis=1) / V + eps)  # [BLOCK_R]
    b_w = tl.load(w + o_v, mask=m_v, other=0.0).to(tl.float32)
    b_y = b_o * b_rstd[:, None] * b_w[None, :] * (b_g * tl.sigmoid(b_g))
    tl.store(y + o_r[:, None] * V + o_v[None, :], b_y.to(y.dtype.element_ty), mask=m_x)


@triton.jit
def _silu_and_mul_kernel(x, y, stride_x, I, BLOCK_I: tl.constexpr):
    i_t = tl.program_id(0).to(tl.int64)
    o_i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    m_i = o_i < I
    b_a = tl.load(x + i_t * stride_x + o_i, mask=m_i, other=0.0).to(tl.float32)
    b_b = tl.load(x + i_t * stride_x + I + o_i, mask=m_i, other=0.0).to(tl.float32)
    b_y = b_a * tl.sigmoid(b_a) * b_b
    tl.store(y + i_t * I + o_i, b_y.to(y.dtype.element_ty), mask=m_i)


def _row_tiling(num_rows: int, row_elements: int) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_D, num_warps) for one-row-in-registers kernels."""
    block_d = triton.next_power_of_2(row_elements)
    if block_d > MAX_BLOCK_D:
        raise ValueError(f"rows of {row_elements} elements exceed the one-pass kernel's limit of {MAX_BLOCK_D}")
    block_r = max(1, min(TILE_ELEMENTS // block_d, triton.next_power_of_2(max(num_rows, 1))))
    num_warps = 4 if block_r * block_d <= TILE_ELEMENTS else 8
    return block_r, block_d, num_warps


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t as a 2-D [rows, D] tensor with unit stride along D (a view where possible)."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm in one pass; see `reference.rms_norm`. x [T, D], weight [D], residual [T, D] or None.

    Returns y [T, D] in x.dtype, or with `residual` the pair (y, h = x + residual), h written by the same kernel.
    """
    check_rms_norm(x, weight, residual)
    x2 = _rows(x)  # [T, D]
    num_rows, d = x2.shape
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # [T, D]
    h = torch.empty_like(y) if residual is not None else None
    r2 = _rows(residual) if residual is not None else x2
    block_r, block_d, num_warps = _row_tiling(num_rows, d)
    if num_rows > 0:
        _rms_norm_kernel[(triton.cdiv(num_rows, block_r),)](
            x2,
            r2,
            weight,
            y,
            h if h is not None else y,
            x2.stride(0),
            r2.stride(0),
            num_rows,
            d,
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK_R=block_r,
            BLOCK_D=block_d,
            num_warps=num_warps,
            **pdl_launch(x),
        )
    return y if h is None else (y, h)


def embed_norm_pair(
    ids: torch.Tensor, table: torch.Tensor, hidden: torch.Tensor, weights: tuple[torch.Tensor, torch.Tensor], eps: float
) -> torch.Tensor:
    """The embedding gather and both RMSNorms of EAGLE-3's draft-layer input in one launch; see
    `reference.embed_norm_pair`. ids [T] (any stride: a column of a chain's tokens), table [V, H] and hidden [T, H]
    (unit stride on H; any row strides), weights (the embedding's norm weight, the hidden state's) [H] each →
    [T, 2H]."""
    check_embed_norm_pair(ids, table, hidden, weights)
    num_rows, width = hidden.shape
    y = torch.empty(num_rows, 2 * width, dtype=table.dtype, device=table.device)  # [T, 2H]
    if num_rows == 0:
        return y
    table = table if table.stride(-1) == 1 else table.contiguous()
    hidden = hidden if hidden.stride(-1) == 1 else hidden.contiguous()
    block_h = triton.next_power_of_2(width)
    if block_h > MAX_BLOCK_D:
        raise ValueError(f"rows of {width} elements exceed the one-pass kernel's limit of {MAX_BLOCK_D}")
    _embed_norm_pair_kernel[(num_rows,)](
        ids,
        table,
        hidden,
        *weights,
        y,
        ids.stride(0),
        table.stride(0),
        hidden.stride(0),
        width,
        eps,
        BLOCK_H=block_h,
        num_warps=max(1, min(8, block_h // 256)),
        **pdl_launch(hidden),
    )
    return y


def gated_rms_norm(o: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor, eps: float) -> torch.Tensor:
    """Per-head RMSNorm · weight · silu(gate); see `reference.gated_rms_norm`. o, gate [T, H, V] (unit stride on V;
    any token and head strides, so `gate` may be a view of a fused projection), weight [V]. Returns [T, H, V].
    """
    check_gated_rms_norm(o, weight, gate)
    if o.stride(-1) != 1:
        o = o.contiguous()
    if gate.stride(-1) != 1:
        gate = gate.contiguous()
    num_tokens, num_heads, v = o.shape
    y = torch.empty(o.shape, dtype=o.dtype, device=o.device)  # [T, H, V]
    num_rows = num_tokens * num_heads
    block_r, block_v, num_warps = _row_tiling(num_rows, v)
    if num_rows > 0:
        _gated_rms_norm_kernel[(triton.cdiv(num_rows, block_r),)](
            o,
            gate,
            weight,
            y,
            o.stride(0),
            o.stride(1),
            gate.stride(0),
            gate.stride(1),
            num_rows,
            num_heads,
            v,
            eps,
            BLOCK_R=block_r,
            BLOCK_V=block_v,
            num_warps=num_warps,
        )
    return y


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """`silu(x[:, :I]) * x[:, I:]`: x [T, 2I] (unit stride on the last dim) → [T, I] in x.dtype."""
    check_silu_and_mul(x)
    x2 = _rows(x)  # [T, 2I]
    num_rows, inner = x2.shape[0], x2.shape[1] // 2
    y = torch.empty(*x.shape[:-1], inner, dtype=x.dtype, device=x.device)  # [T, I]
    block_i = min(1024, triton.next_power_of_2(max(inner, 1)))
    if num_rows > 0 and inner > 0:
        _silu_and_mul_kernel[(num_rows, triton.cdiv(inner, block_i))](x2, y, x2.stride(0), inner, BLOCK_I=block_i)
    return y
