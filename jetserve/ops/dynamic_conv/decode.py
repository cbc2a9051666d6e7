"""Dynamic-conv decode step in Triton: kernel-generator GEMM fused with the conv, windows shifted in place."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from jetserve.ops.dynamic_conv.checks import check_decode_args
from jetserve.ops.dynamic_conv.kernel_generator import decode_tiles_for, dot_precision, kernel_tile
from jetserve.ops.layout import dense
from jetserve.ops.pdl import pdl_enter, pdl_exit, pdl_launch


@triton.jit
def _decode_kernel(
    u,  # [N, D]
    h,  # [N, G]
    w2_weight,  # [D*W, G]
    w2_bias,  # [D*W]
    conv_state,  # [S, W-1, D]
    out,  # [N, D]
    state_indices,  # [N] int32
    num_rows,
    num_channels,
    num_g,
    stride_u,
    stride_h,
    stride_out,
    stride_slot,
    stride_row,
    W: tl.constexpr,
    WP: tl.constexpr,  # next power of two >= W-1
    WT: tl.constexpr,  # next power of two >= W
    BN: tl.constexpr,
    BD: tl.constexpr,
    BG: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr = False,  # programmatic dependent launch (`jetserve.ops.pdl`)
):
    pdl_enter(PDL)
    # Program (i_n, i_d) owns sequences [i_n*BN, (i_n+1)*BN) and channels [i_d*BD, (i_d+1)*BD): one w2 tile serves BN
    # sequences. Each (slot, channel) belongs to one program, which reads its whole window before it writes any of it.
    i_n = tl.program_id(0)
    i_d = tl.program_id(1)
    o_n = i_n * BN + tl.arange(0, BN)
    m_n = o_n < num_rows
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < num_channels
    m_nd = m_n[:, None] & m_d[None, :]
    slots = tl.load(state_indices + o_n, mask=m_n, other=0).to(tl.int64)
    p_state = conv_state + slots[:, None] * stride_slot + o_d[None, :]  # [BN, BD]: row 0 of each window
    rows = o_n.to(tl.int64)

    kappa = kernel_tile(
        h,
        w2_weight,
        w2_bias,
        rows,
        m_n,
        i_d * BD,
        num_channels,
        num_g,
        num_g,
        stride_h,
        W,
        WT,
        BN,
        BD,
        BG,
        DOT_PRECISION,
    )  # [BN, BD, WT]
    o_j = tl.arange(0, WT)[None, None, :]
    m_x = m_nd[:, :, None]
    x_w = tl.load(p_state[:, :, None] + o_j * stride_row, mask=m_x & (o_j < W - 1), other=0.0)
    x_u = tl.load(u + rows[:, None, None] * stride_u + o_d[None, :, None], mask=m_x & (o_j == W - 1), other=0.0)
    acc = tl.sum(kappa * (x_u.to(tl.float32) + x_w.to(tl.float32)), axis=2)  # [BN, BD]
    y = acc * tl.sigmoid(acc)
    tl.store(out + rows[:, None] * stride_out + o_d[None, :], y.to(out.dtype.element_ty), mask=m_nd)

    # Shift: new row r is old row r+1, the last new row is u.
    o_r = tl.arange(0, WP)
    m_r = o_r < W - 1
    from_u = o_r == W - 2
    m_3 = m_nd[:, None, :] & m_r[None, :, None]  # [BN, WP, BD]
    p_window = p_state[:, None, :] + o_r[None, :, None] * stride_row  # [BN, WP, BD]
    shifted = tl.load(p_window + stride_row, mask=m_3 & ~from_u[None, :, None], other=0.0)
    newest = tl.load(u + rows[:, None] * stride_u + o_d[None, :], mask=m_nd, other=0.0)
    new = tl.where(from_u[None, :, None], newest.to(conv_state.dtype.element_ty)[:, None, :], shifted)
    tl.debug_barrier()
    tl.store(p_window, new, mask=m_3)
    pdl_exit(PDL)


def dynamic_conv_decode(
    u: torch.Tensor,
    h: torch.Tensor,
    w2_weight: torch.Tensor,
    w2_bias: torch.Tensor,
    conv_state: torch.Tensor,
    state_indices: torch.Tensor,
) -> torch.Tensor:
    """One token per sequence; each window `conv_state[state_indices[i]]` is shifted in place by the kernel.

    u [N, D], h [N, G] (same dtype as w2_weight), w2_weight [D*W, G], w2_bias [D*W], conv_state [S, W-1, D],
    state_indices [N] int32 (padded rows point at slot 0, which they may clobber). Returns silu(v̂) [N, D] in
    u.dtype, accumulated in fp32 straight from the pool (no gathered copy of the windows).
    """
    width = check_decode_args(u, h, w2_weight, w2_bias, conv_state, state_indices)
    if h.dtype != w2_weight.dtype:
        raise ValueError(f"h ({h.dtype}) and w2_weight ({w2_weight.dtype}) must share a dtype")
    u = u if u.stride(-1) == 1 else u.contiguous()
    h = h if h.stride(-1) == 1 else h.contiguous()
    w2_weight = w2_weight.contiguous()
    (state_indices,) = dense(state_indices)
    assert conv_state.stride(2) == 1, "conv_state rows must be contiguous"
    num_rows, num_channels = u.shape
    out = torch.empty_like(u, memory_format=torch.contiguous_format)  # [N, D]
    if num_rows == 0:
        return out
    tiles = decode_tiles_for(u, num_rows)
    grid = (triton.cdiv(num_rows, tiles.block_tokens), triton.cdiv(num_channels, tiles.block_channels))
    _decode_kernel[grid](
        u,
        h,
        w2_weight,
        w2_bias,
        conv_state,
        out,
        state_indices,
        num_rows,
        num_channels,
        h.shape[1],
        u.stride(0),
        h.stride(0),
        out.stride(0),
        conv_state.stride(0),
        conv_state.stride(1),
        W=width,
        WP=triton.next_power_of_2(width - 1),
        WT=triton.next_power_of_2(width),
        BN=tiles.block_tokens,
        BD=tiles.block_channels,
        BG=tiles.block_g,
        DOT_PRECISION=dot_precision(h),
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
        **pdl_launch(u),
    )
    return out
