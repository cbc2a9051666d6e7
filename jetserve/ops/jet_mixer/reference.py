"""The JetBlock mixer's decode core as the two reference ops it fuses: the dynamic conv of the values, then the gated
delta rule over them. The contract of `jet_mixer_decode` (and of its Triton variant)."""

from __future__ import annotations

import torch

from jetserve.ops.dynamic_conv import reference as conv
from jetserve.ops.gated_delta_rule import reference as delta


def check_mixer_args(u: torch.Tensor, q: torch.Tensor, k: torch.Tensor, state: torch.Tensor) -> tuple[int, int]:
    """(H, V) of a mixer decode call; u [N, H*V] must cover the heads the state holds."""
    num_rows, num_heads = q.shape[0], q.shape[1]
    head_v = state.shape[-1]
    if u.dim() != 2 or u.shape != (num_rows, num_heads * head_v):
        raise ValueError(f"jet_mixer_decode: u {tuple(u.shape)} must be [{num_rows}, {num_heads} * {head_v}]")
    if k.shape != q.shape:
        raise ValueError(f"jet_mixer_decode: q {tuple(q.shape)} and k {tuple(k.shape)} differ")
    return num_heads, head_v


def jet_mixer_decode(
    u: torch.Tensor,
    h: torch.Tensor,
    w2_weight: torch.Tensor,
    w2_bias: torch.Tensor,
    conv_state: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    state_indices: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """One token per sequence: `v = dynamic_conv_decode(u, h, w2_weight, w2_bias, conv_state, state_indices)` (the
    window shifted in place; v rounded to u.dtype) viewed as [N, H, V], then `gated_delta_rule_decode(q, k, v, a, b,
    A_log, dt_bias, state, state_indices, scale)` (the state advanced in place). Returns o [N, H, V] in u.dtype."""
    args = (u, h, w2_weight, w2_bias, conv_state, q, k, a, b, A_log, dt_bias, state, state_indices, scale)
    return one_after_the_other(conv.dynamic_conv_decode, delta.gated_delta_rule_decode, *args)


def one_after_the_other(conv_decode, delta_decode, u, h, w2_weight, w2_bias, conv_state, q, k, a, b, A_log, dt_bias,
                        state, state_indices, scale):  # fmt: skip
    """`jet_mixer_decode` as the two ops given (the references here; the public ops where the fused kernel does not
    run): the conv's output viewed as [N, H, V] is the gated delta rule's v."""
    num_heads, head_v = check_mixer_args(u, q, k, state)
    v = conv_decode(u, h, w2_weight, w2_bias, conv_state, state_indices)  # [N, H*V]
    v = v.view(u.shape[0], num_heads, head_v)  # [N, H, V]
    return delta_decode(q, k, v, a, b, A_log, dt_bias, state, state_indices, scale)


def jet_mixer_commit(
    u: torch.Tensor,
    conv_state: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    state_indices: torch.Tensor,
    accepted_nodes: torch.Tensor,
    num_accepted: torch.Tensor,
) -> None:
    """After a VERIFY step, a JetBlock's whole commit: `dynamic_conv_commit(u, conv_state, state_indices,
    accepted_nodes, num_accepted)` (u [T, H*V] the conv's raw inputs, conv_state [S, W-1, H*V]), then
    `gated_delta_rule_commit(k, v, a, b, A_log, dt_bias, state, state_indices, accepted_nodes, num_accepted)` (k
    [T, H, K], v [T, H, V]); both in place, a row with num_accepted 0 left as it is."""
    check_commit_channels(u, k, v)
    conv.dynamic_conv_commit(u, conv_state, state_indices, accepted_nodes, num_accepted)
    delta.gated_delta_rule_commit(k, v, a, b, A_log, dt_bias, state, state_indices, accepted_nodes, num_accepted)


def check_commit_channels(u: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """u's channels are the heads' values, head-major (the conv's output viewed as [T, H, V] is v)."""
    if v.dim() != 3 or u.dim() != 2 or u.shape != (v.shape[0], v.shape[1] * v.shape[2]) or k.shape[:2] != v.shape[:2]:
        raise ValueError(
            f"jet_mixer_commit: u {tuple(u.shape)} must be [T, H*V] for v {tuple(v.shape)} [T, H, V], k "
            f"{tuple(k.shape)} [T, H, K]"
        )
