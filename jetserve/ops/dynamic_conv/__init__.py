"""Dynamic convolution (JetBlock step 2): varlen prefill, decode, tree verify and commit on the conv-window pool.

Each public function runs the Triton variant where `use_triton(u)` says so, else the pure-PyTorch reference; both have
the same signature and state semantics (docs/kernels.md §dynamic_conv).
"""

from __future__ import annotations

import torch

from jetserve.ops.backend import use_triton
from jetserve.ops.dynamic_conv import commit as _commit
from jetserve.ops.dynamic_conv import decode as _decode
from jetserve.ops.dynamic_conv import prefill as _prefill
from jetserve.ops.dynamic_conv import reference
from jetserve.ops.dynamic_conv import verify as _verify

__all__ = ["dynamic_conv_commit", "dynamic_conv_decode", "dynamic_conv_prefill", "dynamic_conv_verify"]


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
    """Varlen prefill: u [T, D], h [T, G], w2_weight [D*W, G], w2_bias [D*W], conv_state [S, W-1, D] (final windows
    written in place), cu_seqlens [N+1] int32, state_indices [N] int32, has_initial_state [N] bool -> [T, D]."""
    impl = _prefill.dynamic_conv_prefill if use_triton(u) else reference.dynamic_conv_prefill
    return impl(u, h, w2_weight, w2_bias, conv_state, cu_seqlens, state_indices, has_initial_state)


def dynamic_conv_decode(
    u: torch.Tensor,
    h: torch.Tensor,
    w2_weight: torch.Tensor,
    w2_bias: torch.Tensor,
    conv_state: torch.Tensor,
    state_indices: torch.Tensor,
) -> torch.Tensor:
    """One decode step: u [N, D], h [N, G], w2_weight [D*W, G], w2_bias [D*W], conv_state [S, W-1, D] (windows
    shifted in place), state_indices [N] int32 -> [N, D]."""
    impl = _decode.dynamic_conv_decode if use_triton(u) else reference.dynamic_conv_decode
    return impl(u, h, w2_weight, w2_bias, conv_state, state_indices)


def dynamic_conv_verify(
    u: torch.Tensor,
    h: torch.Tensor,
    w2_weight: torch.Tensor,
    w2_bias: torch.Tensor,
    conv_state: torch.Tensor,
    state_indices: torch.Tensor,
    tree_parents: torch.Tensor,
) -> torch.Tensor:
    """Tree verify: u [N*T_d, D], h [N*T_d, G], w2_weight [D*W, G], w2_bias [D*W], conv_state [S, W-1, D] (read
    only), state_indices [N] int32, tree_parents [N, T_d] int32 -> [N*T_d, D]."""
    impl = _verify.dynamic_conv_verify if use_triton(u) else reference.dynamic_conv_verify
    return impl(u, h, w2_weight, w2_bias, conv_state, state_indices, tree_parents)


def dynamic_conv_commit(
    u: torch.Tensor,
    conv_state: torch.Tensor,
    state_indices: torch.Tensor,
    accepted_nodes: torch.Tensor,
    num_accepted: torch.Tensor,
) -> None:
    """Commit the accepted path: u [N*T_d, D], conv_state [S, W-1, D] (updated in place), state_indices [N] int32,
    accepted_nodes [N, T_d] int32 (root first), num_accepted [N] int32."""
    impl = _commit.dynamic_conv_commit if use_triton(u) else reference.dynamic_conv_commit
    impl(u, conv_state, state_indices, accepted_nodes, num_accepted)
