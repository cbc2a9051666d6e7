"""Dynamic-conv tree verify in Triton: each draft node convolves along its ancestry path; the pool is only read."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from jetserve.ops.dynamic_conv.checks import check_verify_args
from jetserve.ops.dynamic_conv.kernel_generator import Tiles, dot_precision, kernel_tile, verify_tiles_for
from jetserve.ops.layout import dense


@triton.jit
def _verify_kernel(
    u,  # [N*T_d, D]
    h,  # [N*T_d, G]
    w2_weight,  # [D*W, G]
    w2_bias,  # [D*W]
    conv_state,  # [S, W-1, D]
    out,  # [N*T_d, D]
    state_indices,  # [N] int32
    tree_parents,  # [N, T_d] int32
    num_rows,
    num_nodes,
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
):
    # Program (i_t, i_d) owns draft nodes [i_t*BN, (i_t+1)*BN) of the flattened batch and channels
    # [i_d*BD, (i_d+1)*BD). A node's taps are found by walking up the tree, newest tap first, in "local rows":
    # rows 0..W-2 are the committed window, row W-1+a is node a; a node's parent -1 lands on window row W-2 and a
    # window row steps to the row before it, so W-1 steps never leave the window.
    i_t = tl.program_id(0)
    i_d = tl.program_id(1)
    o_t = i_t * BN + tl.arange(0, BN)
    m_t = o_t < num_rows
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < num_channels
    seq = o_t // num_nodes
    seq_first = (seq * num_nodes).to(tl.int64)  # flattened row of node 0 of the node's sequence
    slots = tl.load(state_indices + seq, mask=m_t, other=0).to(tl.int64)
    rows = o_t.to(tl.int64)
    local = o_t - seq * num_nodes + (W - 1)

    kappa = kernel_tile(
        h,
        w2_weight,
        w2_bias,
        rows,
        m_t,
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
    o_j = tl.arange(0, WT)
    taps = tl.zeros((BN, WT), dtype=tl.int32) + (W - 1)  # local row of each tap; padded taps stay masked
    for jj in tl.static_range(W):
        taps = tl.where(o_j[None, :] == W - 1 - jj, local[:, None], taps)
        if jj < W - 1:
            is_node = local >= W - 1
            parent = tl.load(tree_parents + seq_first + local - (W - 1), mask=m_t & is_node, other=0)
            local = tl.where(is_node, parent + (W - 1), local - 1)
    taps = taps[:, None, :]  # [BN, 1, WT]
    is_node = taps >= W - 1
    m_x = m_t[:, None, None] & m_d[None, :, None] & (o_j < W)[None, None, :]
    x_u = tl.load(
        u + (seq_first[:, None, None] + taps - (W - 1)) * stride_u + o_d[None, :, None], mask=m_x & is_node, other=0.0
    )
    x_w = tl.load(
        conv_state + slots[:, None, None] * stride_slot + taps * stride_row + o_d[None, :, None],
        mask=m_x & ~is_node,
        other=0.0,
    )
    acc = tl.sum(kappa * (x_u.to(tl.float32) + x_w.to(tl.float32)), axis=2)  # [BN, BD]
    y = acc * tl.sigmoid(acc)
    tl.store(
        out + rows[:, None] * stride_out + o_d[None, :], y.to(out.dtype.element_ty), mask=m_t[:, None] & m_d[None, :]
    )


def dynamic_conv_verify(
    u: torch.Tensor,
    h: torch.Tensor,
    w2_weight: torch.Tensor,
    w2_bias: torch.Tensor,
    conv_state: torch.Tensor,
    state_indices: torch.Tensor,
    tree_parents: torch.Tensor,
    *,
    tiles: Tiles | None = None,
) -> torch.Tensor:
    """Dynamic conv over a draft tree per sequence; never writes `conv_state`. `tiles` overrides the launch's
    (`verify_tiles_for`), for tests and sweeps.

    u [T, D], h [T, G] (same dtype as w2_weight) with T = N*T_d (token i*T_d + j is node j of sequence i),
    w2_weight [D*W, G], w2_bias [D*W], conv_state [S, W-1, D], state_indices [N] int32, tree_parents [N, T_d] int32
    (node 0's parent is -1, every other parent a node of the same tree; a chain is parent j-1). Node j's window is its
    ancestry path, falling back into the committed window. Returns silu(v̂) [T, D] in u.dtype, fp32-accumulated.
    """
    width = check_verify_args(u, h, w2_weight, w2_bias, conv_state, state_indices, tree_parents)
    if h.dtype != w2_weight.dtype:
        raise ValueError(f"h ({h.dtype}) and w2_weight ({w2_weight.dtype}) must share a dtype")
    u = u if u.stride(-1) == 1 else u.contiguous()
    h = h if h.stride(-1) == 1 else h.contiguous()
    w2_weight = w2_weight.contiguous()
    tree_parents = tree_parents.contiguous()
    (state_indices,) = dense(state_indices)
    assert conv_state.stride(2) == 1, "conv_state rows must be contiguous"
    num_rows, num_channels = u.shape
    out = torch.empty_like(u, memory_format=torch.contiguous_format)  # [T, D]
    if num_rows == 0:
        return out
    tiles = tiles or verify_tiles_for(u, num_rows)
    grid = (triton.cdiv(num_rows, tiles.block_tokens), triton.cdiv(num_channels, tiles.block_channels))
    _verify_kernel[grid](
        u,
        h,
        w2_weight,
        w2_bias,
        conv_state,
        out,
        state_indices,
        tree_parents,
        num_rows,
        tree_parents.shape[1],
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
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    return out
