"""Argument validation shared by the dynamic_conv reference and Triton variants (ValueError on bad shapes)."""

from __future__ import annotations

import torch


def conv_width(w2_weight: torch.Tensor, conv_state: torch.Tensor) -> int:
    """The conv width W, checked against both the kernel generator [D*W, G] and the window [S, W-1, D]."""
    if conv_state.dim() != 3:
        raise ValueError(f"conv_state must be [S, W-1, D], got shape {tuple(conv_state.shape)}")
    width = conv_state.shape[1] + 1
    num_channels = conv_state.shape[2]
    if w2_weight.dim() != 2 or w2_weight.shape[0] != num_channels * width:
        raise ValueError(
            f"w2_weight must be [D*W, G] = [{num_channels * width}, G] for conv_state {tuple(conv_state.shape)}, "
            f"got {tuple(w2_weight.shape)}"
        )
    return width


def check_tokens(u: torch.Tensor, h: torch.Tensor, w2_weight: torch.Tensor, w2_bias: torch.Tensor, d: int) -> None:
    """Check u [T, D], h [T, G] and w2_bias [D*W] against w2_weight [D*W, G]."""
    if u.dim() != 2 or u.shape[1] != d:
        raise ValueError(f"u must be [T, D] with D = {d}, got shape {tuple(u.shape)}")
    if h.dim() != 2 or h.shape[0] != u.shape[0] or h.shape[1] != w2_weight.shape[1]:
        raise ValueError(f"h must be [T, G] = [{u.shape[0]}, {w2_weight.shape[1]}], got shape {tuple(h.shape)}")
    if w2_bias.shape != (w2_weight.shape[0],):
        raise ValueError(f"w2_bias must be [D*W] = [{w2_weight.shape[0]}], got shape {tuple(w2_bias.shape)}")


def check_prefill_args(
    u: torch.Tensor,
    h: torch.Tensor,
    w2_weight: torch.Tensor,
    w2_bias: torch.Tensor,
    conv_state: torch.Tensor,
    cu_seqlens: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
) -> int:
    """Validate `dynamic_conv_prefill` arguments; returns W."""
    width = conv_width(w2_weight, conv_state)
    check_tokens(u, h, w2_weight, w2_bias, conv_state.shape[2])
    num_seqs = state_indices.shape[0]
    if state_indices.dim() != 1 or cu_seqlens.shape != (num_seqs + 1,) or has_initial_state.shape != (num_seqs,):
        raise ValueError(
            f"state_indices must be [N], cu_seqlens [N+1] and has_initial_state [N], got {tuple(state_indices.shape)}, "
            f"{tuple(cu_seqlens.shape)} and {tuple(has_initial_state.shape)}"
        )
    return width


def check_decode_args(
    u: torch.Tensor,
    h: torch.Tensor,
    w2_weight: torch.Tensor,
    w2_bias: torch.Tensor,
    conv_state: torch.Tensor,
    state_indices: torch.Tensor,
) -> int:
    """Validate `dynamic_conv_decode` arguments; returns W."""
    width = conv_width(w2_weight, conv_state)
    check_tokens(u, h, w2_weight, w2_bias, conv_state.shape[2])
    if state_indices.shape != (u.shape[0],):
        raise ValueError(f"state_indices must be [N] = [{u.shape[0]}], got shape {tuple(state_indices.shape)}")
    return width


def check_verify_args(
    u: torch.Tensor,
    h: torch.Tensor,
    w2_weight: torch.Tensor,
    w2_bias: torch.Tensor,
    conv_state: torch.Tensor,
    state_indices: torch.Tensor,
    tree_parents: torch.Tensor,
) -> int:
    """Validate `dynamic_conv_verify` arguments; returns W."""
    width = conv_width(w2_weight, conv_state)
    check_tokens(u, h, w2_weight, w2_bias, conv_state.shape[2])
    if tree_parents.dim() != 2 or state_indices.shape != (tree_parents.shape[0],):
        raise ValueError(
            f"tree_parents must be [N, T_d] and state_indices [N], got {tuple(tree_parents.shape)} and "
            f"{tuple(state_indices.shape)}"
        )
    if u.shape[0] != tree_parents.numel():
        raise ValueError(f"u must hold N*T_d = {tree_parents.numel()} tokens, got {u.shape[0]}")
    return width


def check_commit_args(
    u: torch.Tensor,
    conv_state: torch.Tensor,
    state_indices: torch.Tensor,
    accepted_nodes: torch.Tensor,
    num_accepted: torch.Tensor,
) -> int:
    """Validate `dynamic_conv_commit` arguments; returns W."""
    if conv_state.dim() != 3:
        raise ValueError(f"conv_state must be [S, W-1, D], got shape {tuple(conv_state.shape)}")
    if accepted_nodes.dim() != 2 or state_indices.shape != (accepted_nodes.shape[0],):
        raise ValueError(
            f"accepted_nodes must be [N, T_d] and state_indices [N], got {tuple(accepted_nodes.shape)} and "
            f"{tuple(state_indices.shape)}"
        )
    if u.shape != (accepted_nodes.numel(), conv_state.shape[2]):
        raise ValueError(
            f"u must be [N*T_d, D] = [{accepted_nodes.numel()}, {conv_state.shape[2]}], got {tuple(u.shape)}"
        )
    if num_accepted.shape != (accepted_nodes.shape[0],):
        raise ValueError(f"num_accepted must be [N] = [{accepted_nodes.shape[0]}], got {tuple(num_accepted.shape)}")
    return conv_state.shape[1] + 1
