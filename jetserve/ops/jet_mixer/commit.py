"""The JetBlock's commit after a VERIFY step in one Triton launch: the gated delta rule's commit kernel (`ops.
gated_delta_rule.tree`) with its conv part on, so each program also shifts the conv window of the value channels its
head and V tile cover. One launch a JetBlock instead of two (the 2B's verify step: 24 fewer)."""

from __future__ import annotations

import torch

from jetserve.ops.dynamic_conv.checks import check_commit_args
from jetserve.ops.gated_delta_rule.tree import gated_delta_rule_commit
from jetserve.ops.jet_mixer.reference import check_commit_channels


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
    *,
    block_v: int | None = None,
    num_warps: int | None = None,
) -> None:
    """`reference.jet_mixer_commit` in one launch; block_v and num_warps as `gated_delta_rule_commit`'s."""
    check_commit_channels(u, k, v)
    check_commit_args(u, conv_state, state_indices, accepted_nodes, num_accepted)
    if conv_state.stride(2) != 1:
        raise ValueError("jet_mixer_commit: conv_state rows must be contiguous")
    gated_delta_rule_commit(
        k, v, a, b, A_log, dt_bias, state, state_indices, accepted_nodes, num_accepted, block_v=block_v,
        num_warps=num_warps, conv=(u, conv_state),
    )  # fmt: skip
