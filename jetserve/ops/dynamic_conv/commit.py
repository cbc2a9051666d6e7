"""Dynamic-conv commit in Triton: shift each window along its sequence's accepted draft path, in place."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from jetserve.ops.dynamic_conv.checks import check_commit_args
from jetserve.ops.layout import dense


@triton.jit
def window_after_commit(u, p_window, accepted_row, row, count, o_c, m_c, stride_u, stride_row, W: tl.constexpr,
                        WP: tl.constexpr):  # fmt: skip
    """The new window `[WP, BC]` (rows past W-1 masked) of channels o_c of one sequence: row r is entry count + r of
    (old window ++ u of its accepted nodes). p_window points at the slot's row 0 of those channels, accepted_row at
    the sequence's accepted nodes, `row` is its first token's row in u. Only loads: the caller stores it (after a
    barrier, since other threads may still read the rows it overwrites)."""
    o_r = tl.arange(0, WP)
    m_r = o_r < W - 1
    o_q = count + o_r
    from_u = o_q >= W - 1
    node = tl.load(accepted_row + o_q - (W - 1), mask=m_r & from_u, other=0)
    new_u = tl.load(u + (row + node)[:, None] * stride_u + o_c[None, :], mask=(m_r & from_u)[:, None] & m_c[None, :])
    old = tl.load(p_window + o_q[:, None] * stride_row, mask=(m_r & ~from_u)[:, None] & m_c[None, :])
    return tl.where(from_u[:, None], new_u.to(p_window.dtype.element_ty), old)


@triton.jit
def _commit_kernel(
    u,  # [N*T_d, D]
    conv_state,  # [S, W-1, D]
    state_indices,  # [N] int32
    accepted_nodes,  # [N, T_d] int32
    num_accepted,  # [N] int32
    num_nodes,
    num_channels,
    stride_u,
    stride_slot,
    stride_row,
    W: tl.constexpr,
    WP: tl.constexpr,  # next power of two >= W-1
    BD: tl.constexpr,
):
    # Program (i_n, i_d) owns sequence i_n's window in channels [i_d*BD, (i_d+1)*BD); all of it is read before any of
    # it is written.
    i_n = tl.program_id(0)
    i_d = tl.program_id(1)
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < num_channels
    o_r = tl.arange(0, WP)
    slot = tl.load(state_indices + i_n).to(tl.int64)
    count = tl.load(num_accepted + i_n)
    seq_first = i_n.to(tl.int64) * num_nodes
    p_window = conv_state + slot * stride_slot + o_d[None, :]
    new = window_after_commit(u, p_window, accepted_nodes + seq_first, seq_first, count, o_d, m_d, stride_u,
                              stride_row, W, WP)  # fmt: skip
    tl.debug_barrier()
    tl.store(p_window + o_r[:, None] * stride_row, new, mask=(o_r < W - 1)[:, None] & m_d[None, :])


def dynamic_conv_commit(
    u: torch.Tensor,
    conv_state: torch.Tensor,
    state_indices: torch.Tensor,
    accepted_nodes: torch.Tensor,
    num_accepted: torch.Tensor,
) -> None:
    """New window = last W-1 of (old window ++ u of the accepted nodes), in place, one program per window tile.

    u [T, D] with T = N*T_d (the verify inputs), conv_state [S, W-1, D], state_indices [N] int32,
    accepted_nodes [N, T_d] int32 (node indices, root first; entries past num_accepted are not read),
    num_accepted [N] int32 in [0, T_d] (0 leaves the window unchanged).
    """
    width = check_commit_args(u, conv_state, state_indices, accepted_nodes, num_accepted)
    u = u if u.stride(-1) == 1 else u.contiguous()
    accepted_nodes = accepted_nodes.contiguous()
    state_indices, num_accepted = dense(state_indices, num_accepted)
    assert conv_state.stride(2) == 1, "conv_state rows must be contiguous"
    num_seqs, num_nodes = accepted_nodes.shape
    if num_seqs == 0:
        return
    num_channels = u.shape[1]
    block_channels = 256 if u.is_cuda else 16  # a pure copy: wide tiles on the GPU, edge-crossing ones in tests
    _commit_kernel[(num_seqs, triton.cdiv(num_channels, block_channels))](
        u,
        conv_state,
        state_indices,
        accepted_nodes,
        num_accepted,
        num_nodes,
        num_channels,
        u.stride(0),
        conv_state.stride(0),
        conv_state.stride(1),
        W=width,
        WP=triton.next_power_of_2(width - 1),
        BD=block_channels,
    )
