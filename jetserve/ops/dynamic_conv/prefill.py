"""Varlen dynamic-conv prefill in Triton: the w2 GEMM, W-tap conv and SiLU fused; final windows written in-kernel."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from jetserve.ops.dynamic_conv.checks import check_prefill_args
from jetserve.ops.dynamic_conv.kernel_generator import dot_precision, kernel_tile, tiles_for
from jetserve.ops.layout import dense


@triton.jit
def _prefill_kernel(
    u,  # [T, D]
    h,  # [T, G]
    w2_weight,  # [D*W, G]
    w2_bias,  # [D*W]
    conv_state,  # [S, W-1, D]
    out,  # [T, D]
    cu_seqlens,  # [N+1] int32
    state_indices,  # [N] int32
    has_initial_state,  # [N] bool
    num_seqs,
    search_steps,  # iterations of the sequence search: N.bit_length()
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
    BT: tl.constexpr,
    BD: tl.constexpr,
    BG: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # Program (i_b, i_d) owns token block i_k of one sequence i_n and channels [i_d*BD, (i_d+1)*BD). Sequence i owns
    # the virtual blocks [cu[i] // BT + i, cu[i+1] // BT + i + 1), enough for its ceil(L_i / BT) blocks, so the grid
    # T // BT + N needs no host-side lengths. Block 0 of a sequence alone reads the old window and writes the new one.
    i_b = tl.program_id(0)
    i_d = tl.program_id(1)
    lo = i_b * 0
    hi = lo + num_seqs - 1
    for _ in range(search_steps):
        mid = (lo + hi + 1) // 2
        go_up = tl.load(cu_seqlens + mid) // BT + mid <= i_b
        lo = tl.where(go_up, mid, lo)
        hi = tl.where(go_up, hi, mid - 1)
    i_n = lo
    seq_start = tl.load(cu_seqlens + i_n)
    seq_len = tl.load(cu_seqlens + i_n + 1) - seq_start
    i_k = i_b - (seq_start // BT + i_n)
    slot = tl.load(state_indices + i_n).to(tl.int64)
    has_init = tl.load(has_initial_state + i_n) != 0
    p_state = conv_state + slot * stride_slot

    o_t = i_k * BT + tl.arange(0, BT)  # position within the sequence
    m_t = o_t < seq_len
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < num_channels
    rows = (seq_start + o_t).to(tl.int64)
    g_end = tl.where(i_k * BT < seq_len, num_g, 0)  # empty blocks skip the GEMM

    kappa = kernel_tile(
        h,
        w2_weight,
        w2_bias,
        rows,
        m_t,
        i_d * BD,
        num_channels,
        num_g,
        g_end,
        stride_h,
        W,
        WT,
        BT,
        BD,
        BG,
        DOT_PRECISION,
    )  # [BT, BD, WT]
    # Tap j reads position t-(W-1)+j; negative positions are rows of the old window.
    o_j = tl.arange(0, WT)
    o_src = o_t[:, None, None] - (W - 1) + o_j[None, None, :]  # [BT, 1, WT]
    m_x = m_t[:, None, None] & m_d[None, :, None] & (o_j < W)[None, None, :]
    x_u = tl.load(
        u + (seq_start + o_src).to(tl.int64) * stride_u + o_d[None, :, None], mask=m_x & (o_src >= 0), other=0.0
    )
    x_w = tl.load(
        p_state + (W - 1 + o_src) * stride_row + o_d[None, :, None], mask=m_x & (o_src < 0) & has_init, other=0.0
    )
    acc = tl.sum(kappa * (x_u.to(tl.float32) + x_w.to(tl.float32)), axis=2)  # [BT, BD]
    y = acc * tl.sigmoid(acc)
    tl.store(
        out + rows[:, None] * stride_out + o_d[None, :], y.to(out.dtype.element_ty), mask=m_t[:, None] & m_d[None, :]
    )

    # New window row r is position L-(W-1)+r of (old window ++ tokens). Every program that may read the old window
    # (block 0's) reaches the barrier before any of its threads overwrites it; no other program reads it.
    o_r = tl.arange(0, WP)
    o_q = seq_len - (W - 1) + o_r
    m_r = (o_r < W - 1) & (i_k == 0)
    from_u = o_q >= 0
    new_u = tl.load(
        u + (seq_start + o_q).to(tl.int64)[:, None] * stride_u + o_d[None, :],
        mask=(m_r & from_u)[:, None] & m_d[None, :],
        other=0.0,
    )
    new_w = tl.load(
        p_state + (W - 1 + o_q)[:, None] * stride_row + o_d[None, :],
        mask=(m_r & ~from_u & has_init)[:, None] & m_d[None, :],
        other=0.0,
    )
    new = tl.where(from_u[:, None], new_u.to(conv_state.dtype.element_ty), new_w)
    tl.debug_barrier()
    tl.store(p_state + o_r[:, None] * stride_row + o_d[None, :], new, mask=m_r[:, None] & m_d[None, :])


def dynamic_conv_prefill(
    u: torch.Tensor,
    h: torch.Tensor,
    w2_weight: torch.Tensor,
    w2_bias: torch.Tensor,
    conv_state: torch.Tensor,
    cu_seqlens: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
) -> torch.Tensor:
    """Varlen dynamic conv over packed sequences; writes each sequence's final window to its slot in the kernel.

    u [T, D] raw conv inputs, h [T, G] kernel-generator hidden (silu(w1 x), same dtype as w2_weight),
    w2_weight [D*W, G], w2_bias [D*W], conv_state [S, W-1, D] (updated in place), cu_seqlens [N+1] int32,
    state_indices [N] int32, has_initial_state [N] bool. Returns silu(v̂) [T, D] in u.dtype, accumulated in fp32.
    κ = h @ w2ᵀ + bias is computed tap by tap in registers and never written to memory. Sequences of any length
    (0 included) are fine; one shorter than W-1 keeps the newest rows of its old window.
    """
    width = check_prefill_args(u, h, w2_weight, w2_bias, conv_state, cu_seqlens, state_indices, has_initial_state)
    if h.dtype != w2_weight.dtype:
        raise ValueError(f"h ({h.dtype}) and w2_weight ({w2_weight.dtype}) must share a dtype")
    u = u if u.stride(-1) == 1 else u.contiguous()
    h = h if h.stride(-1) == 1 else h.contiguous()
    w2_weight = w2_weight.contiguous()
    cu_seqlens, state_indices, has_initial_state = dense(cu_seqlens, state_indices, has_initial_state)
    assert conv_state.stride(2) == 1, "conv_state rows must be contiguous"
    num_tokens, num_channels = u.shape
    num_seqs = state_indices.shape[0]
    out = torch.empty_like(u, memory_format=torch.contiguous_format)  # [T, D]
    if num_seqs == 0:
        return out
    tiles = tiles_for(u, num_tokens)
    grid = (num_tokens // tiles.block_tokens + num_seqs, triton.cdiv(num_channels, tiles.block_channels))
    _prefill_kernel[grid](
        u,
        h,
        w2_weight,
        w2_bias,
        conv_state,
        out,
        cu_seqlens,
        state_indices,
        has_initial_state,
        num_seqs,
        num_seqs.bit_length(),
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
        BT=tiles.block_tokens,
        BD=tiles.block_channels,
        BG=tiles.block_g,
        DOT_PRECISION=dot_precision(h),
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    return out
