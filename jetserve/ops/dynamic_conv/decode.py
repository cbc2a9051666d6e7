"""Dynamic-conv decode step in Triton: kernel-generator GEMM fused with the conv, windows shifted in place."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from jetserve.ops.dynamic_conv.checks import check_decode_args
from jetserve.ops.dynamic_conv.kernel_generator import decode_tiles_for, dot_precision, kernel_tile
from jetserve.ops.layout import dense
from jetserve.ops.pdl import pdl_enter, pdl_exit, pdl_launch

# Up to this many rows (the 16 x 8 decode tiles) the taps are loaded before the kernel generator's GEMM, their latency
# hidden behind its w2 stream; past it the larger tiles would hold them in registers through the GEMM, so they load
# after it. H200, 2B shape, in a CUDA graph behind the input projection (session 23), taps after → before the GEMM:
# 8 rows 5.98 → 5.51 µs; taps before → after, 64 x 16 tiles: 64 rows 8.00 → 7.63, 256 rows 18.89 → 15.04 µs.
EARLY_LOADS_MAX_ROWS = 16


@triton.jit
def _load_taps(u, p_state, rows, o_d, m_nd, stride_u, stride_row, W: tl.constexpr, WT: tl.constexpr):
    """A program's conv taps, channels fastest (coalesced): window rows 0..W-2 as [BN, WT, BD] (tap W-1 and any
    padding zero) and the new input u [BN, BD]."""
    o_j = tl.arange(0, WT)[None, :, None]  # [1, WT, 1]
    window = tl.load(p_state[:, None, :] + o_j * stride_row, mask=m_nd[:, None, :] & (o_j < W - 1), other=0.0)
    newest = tl.load(u + rows[:, None] * stride_u + o_d[None, :], mask=m_nd, other=0.0)
    return window, newest


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
    WT: tl.constexpr,  # next power of two >= W
    BN: tl.constexpr,
    BD: tl.constexpr,
    BG: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    EARLY_LOADS: tl.constexpr,  # the taps loaded before the GEMM (small tiles) or after it (fewer registers held)
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

    if EARLY_LOADS:
        window, newest = _load_taps(u, p_state, rows, o_d, m_nd, stride_u, stride_row, W, WT)
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
    if not EARLY_LOADS:
        window, newest = _load_taps(u, p_state, rows, o_d, m_nd, stride_u, stride_row, W, WT)
    o_j = tl.arange(0, WT)[None, :, None]  # [1, WT, 1]
    m_x = m_nd[:, None, :]
    p_taps = p_state[:, None, :] + o_j * stride_row  # [BN, WT, BD]
    is_u = o_j == W - 1
    x = tl.where(is_u, newest.to(tl.float32)[:, None, :], window.to(tl.float32))  # [BN, WT, BD]
    acc = tl.sum(tl.permute(kappa, (0, 2, 1)) * x, axis=1)  # [BN, BD]
    y = acc * tl.sigmoid(acc)
    tl.store(out + rows[:, None] * stride_out + o_d[None, :], y.to(out.dtype.element_ty), mask=m_nd)

    # Shift from the registers: new row r is tap r+1 (old row r+1, and u for the last). Every thread of the program
    # has loaded its taps before any writes a row.
    new = tl.where(is_u, newest.to(conv_state.dtype.element_ty)[:, None, :], window)
    tl.debug_barrier()
    tl.store(p_taps - stride_row, new, mask=m_x & (o_j >= 1) & (o_j < W))
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
        WT=triton.next_power_of_2(width),
        BN=tiles.block_tokens,
        BD=tiles.block_channels,
        BG=tiles.block_g,
        DOT_PRECISION=dot_precision(h),
        EARLY_LOADS=num_rows <= EARLY_LOADS_MAX_ROWS,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
        **pdl_launch(u),
    )
    return out
