"""Dynamic convolution in pure PyTorch (fp32 math, any device): prefill, decode, tree verify and commit.

Vectorised over tokens, channels and sequences with no host synchronisation, so it also serves CPU inference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from jetserve.ops.dynamic_conv.checks import (
    check_commit_args,
    check_decode_args,
    check_prefill_args,
    check_verify_args,
)


def _kernels(h: torch.Tensor, w2_weight: torch.Tensor, w2_bias: torch.Tensor, width: int) -> torch.Tensor:
    """Per-token conv kernels κ = h @ w2ᵀ + bias in fp32, viewed [T, D, W] (tap fastest)."""
    kappa = torch.addmm(w2_bias.float(), h.float(), w2_weight.float().t())  # [T, D*W]
    return kappa.view(h.shape[0], w2_weight.shape[0] // width, width)


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
    """Varlen dynamic conv over packed sequences; writes each final window to its slot.

    u [T, D] raw conv inputs, h [T, G] kernel-generator hidden (silu(w1 x)), w2_weight [D*W, G], w2_bias [D*W],
    conv_state [S, W-1, D] (updated in place), cu_seqlens [N+1] int32, state_indices [N] int32,
    has_initial_state [N] bool. Returns silu(v̂) [T, D] in u.dtype.
    """
    width = check_prefill_args(u, h, w2_weight, w2_bias, conv_state, cu_seqlens, state_indices, has_initial_state)
    num_channels = conv_state.shape[2]
    num_seqs = state_indices.shape[0]
    num_tokens = u.shape[0]
    device = u.device
    cu = cu_seqlens.to(device=device, dtype=torch.long)  # [N+1]
    slots = state_indices.to(device=device, dtype=torch.long)  # [N]

    # One buffer holding each sequence's initial window followed by its tokens: sequence i's window occupies rows
    # [cu[i] + i*(W-1), cu[i] + (i+1)*(W-1)) and its tokens follow, so no host-side lengths are needed.
    seq_of_token = torch.searchsorted(cu[1:], torch.arange(num_tokens, device=device), right=True)  # [T]
    token_rows = torch.arange(num_tokens, device=device) + (width - 1) * (seq_of_token + 1)  # [T]
    taps = torch.arange(width - 1, device=device)  # [W-1]
    window_rows = (cu[:-1] + torch.arange(num_seqs, device=device) * (width - 1))[:, None] + taps  # [N, W-1]
    has_initial = has_initial_state.to(device)[:, None, None]  # [N, 1, 1]
    initial = torch.where(has_initial, conv_state[slots].float(), 0.0)  # [N, W-1, D]; unused slots may hold NaN
    buffer = u.new_zeros(num_tokens + num_seqs * (width - 1), num_channels, dtype=torch.float32)
    buffer[token_rows] = u.float()
    buffer[window_rows.reshape(-1)] = initial.reshape(-1, num_channels)

    kappa = _kernels(h, w2_weight, w2_bias, width)  # [T, D, W]
    gather_rows = token_rows[:, None] - (width - 1) + torch.arange(width, device=device)  # [T, W]
    inputs = buffer[gather_rows]  # [T, W, D]
    v_hat = torch.einsum("tcw,twc->tc", kappa, inputs)  # [T, D]

    final_rows = (cu[1:] + torch.arange(num_seqs, device=device) * (width - 1))[:, None] + taps  # [N, W-1]
    conv_state[slots] = buffer[final_rows].to(conv_state.dtype)
    return F.silu(v_hat).to(u.dtype)


def dynamic_conv_decode(
    u: torch.Tensor,
    h: torch.Tensor,
    w2_weight: torch.Tensor,
    w2_bias: torch.Tensor,
    conv_state: torch.Tensor,
    state_indices: torch.Tensor,
) -> torch.Tensor:
    """One token per sequence; the window in `conv_state[state_indices[i]]` is shifted in place.

    u [N, D], h [N, G], w2_weight [D*W, G], w2_bias [D*W], conv_state [S, W-1, D], state_indices [N] int32.
    Returns silu(v̂) [N, D] in u.dtype.
    """
    width = check_decode_args(u, h, w2_weight, w2_bias, conv_state, state_indices)
    slots = state_indices.to(device=u.device, dtype=torch.long)  # [N]
    inputs = torch.cat([conv_state[slots].float(), u.float()[:, None, :]], dim=1)  # [N, W, D]
    kappa = _kernels(h, w2_weight, w2_bias, width)  # [N, D, W]
    v_hat = torch.einsum("ncw,nwc->nc", kappa, inputs)  # [N, D]
    conv_state[slots] = inputs[:, 1:].to(conv_state.dtype)
    return F.silu(v_hat).to(u.dtype)


def dynamic_conv_verify(
    u: torch.Tensor,
    h: torch.Tensor,
    w2_weight: torch.Tensor,
    w2_bias: torch.Tensor,
    conv_state: torch.Tensor,
    state_indices: torch.Tensor,
    tree_parents: torch.Tensor,
) -> torch.Tensor:
    """Dynamic conv over a draft tree per sequence; never writes `conv_state`.

    u [T, D], h [T, G] with T = N*T_d (token i*T_d + j is node j of sequence i), w2_weight [D*W, G], w2_bias [D*W],
    conv_state [S, W-1, D], state_indices [N] int32, tree_parents [N, T_d] int32 (node 0's parent is -1). Node j's
    window is its ancestry path, falling back into the committed window. Returns silu(v̂) [T, D] in u.dtype.
    """
    width = check_verify_args(u, h, w2_weight, w2_bias, conv_state, state_indices, tree_parents)
    num_channels = conv_state.shape[2]
    num_seqs, num_nodes = tree_parents.shape
    device = u.device
    slots = state_indices.to(device=device, dtype=torch.long)  # [N]
    parents = tree_parents.to(device=device, dtype=torch.long)  # [N, T_d]

    # Per sequence, rows [0, W-1) of `local` are the committed window and row W-1+j is node j. One step back from a
    # node row goes to its parent's row (parent -1 lands on the newest window row W-2); from a window row, to the row
    # before it. W-1 steps from any node row stay >= 0.
    local = torch.cat([conv_state[slots].float(), u.float().view(num_seqs, num_nodes, num_channels)], dim=1)
    parent_rows = parents + (width - 1)  # [N, T_d]
    rows = [torch.arange(num_nodes, device=device).expand(num_seqs, num_nodes) + (width - 1)]  # tap W-1: the node
    for _ in range(width - 1):
        cur = rows[-1]  # [N, T_d]
        is_node = cur >= width - 1
        from_node = torch.gather(parent_rows, 1, (cur - (width - 1)).clamp(min=0))
        rows.append(torch.where(is_node, from_node, cur - 1))
    gather_rows = torch.stack(rows[::-1], dim=-1)  # [N, T_d, W], tap 0 the oldest
    inputs = torch.gather(
        local[:, None].expand(-1, num_nodes, -1, -1),
        2,
        gather_rows[..., None].expand(-1, -1, -1, num_channels),
    )  # [N, T_d, W, D]
    kappa = _kernels(h, w2_weight, w2_bias, width)  # [T, D, W]
    v_hat = torch.einsum("tcw,twc->tc", kappa, inputs.reshape(-1, width, num_channels))  # [T, D]
    return F.silu(v_hat).to(u.dtype)


def dynamic_conv_commit(
    u: torch.Tensor,
    conv_state: torch.Tensor,
    state_indices: torch.Tensor,
    accepted_nodes: torch.Tensor,
    num_accepted: torch.Tensor,
) -> None:
    """Shift each sequence's window along its accepted path: new window = last W-1 of (old window ++ accepted u).

    u [T, D] with T = N*T_d (the verify inputs), conv_state [S, W-1, D] (updated in place), state_indices [N] int32,
    accepted_nodes [N, T_d] int32 (node indices, root first; entries past num_accepted are ignored),
    num_accepted [N] int32 (0 leaves the window unchanged).
    """
    width = check_commit_args(u, conv_state, state_indices, accepted_nodes, num_accepted)
    num_channels = conv_state.shape[2]
    num_seqs, num_nodes = accepted_nodes.shape
    device = u.device
    slots = state_indices.to(device=device, dtype=torch.long)  # [N]
    nodes = accepted_nodes.to(device=device, dtype=torch.long).clamp(0, num_nodes - 1)  # [N, T_d]
    count = num_accepted.to(device=device, dtype=torch.long)  # [N]
    path = torch.gather(
        u.view(num_seqs, num_nodes, num_channels), 1, nodes[..., None].expand(-1, -1, num_channels)
    )  # [N, T_d, D]
    extended = torch.cat([conv_state[slots], path.to(conv_state.dtype)], dim=1)  # [N, W-1+T_d, D]
    rows = count[:, None] + torch.arange(width - 1, device=device)  # [N, W-1]
    conv_state[slots] = torch.gather(extended, 1, rows[..., None].expand(-1, -1, num_channels))
