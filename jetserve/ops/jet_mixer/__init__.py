"""The JetBlock mixer's decode core: the dynamic conv of the values, then the gated delta rule, for one token per
sequence; and its commit after a VERIFY step (`jet_mixer_commit`: both states along the accepted path, one Triton
launch, `commit.py`). `jet_mixer_decode` runs the fused Triton kernel (`decode.py`: one launch, the conv's output
kept in registers) when `use_triton(u)` says so, the batch has at most FUSED_MAX_ROWS sequences and
`JETSERVE_FUSED_MIXER` is not 0; otherwise the two public ops one after the other (each picking its own variant).

On by default. Predicted to save the gated-delta-rule launch and the conv output's round trip, ~3 µs of each of the
2B's 24 JetBlock layers at batch 1 (~70 µs a step). Measured on an H200 (session 22): timed alone (w2 from HBM) 6.54
µs a layer against 7.69 for the two kernels; in the 2B's batch-1 decode (4K context) TPOT 1.622 / 1.625 → 1.553 /
1.554 ms, two pairs. Its first launch (2 warps) took 15.3 µs a layer and made that step slower (1.617 → 1.755 ms).
"""

from __future__ import annotations

import torch

from jetserve import envs
from jetserve.ops.backend import use_triton
from jetserve.ops.dynamic_conv import dynamic_conv_decode
from jetserve.ops.gated_delta_rule import gated_delta_rule_decode
from jetserve.ops.jet_mixer import commit, decode, reference
from jetserve.ops.jet_mixer.reference import one_after_the_other

FUSED_MAX_ROWS = 1  # the fused kernel reads w2 once per sequence; the conv kernel once per step for up to 16


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
    """u [N, H*V] (raw values), h [N, G], w2_weight [H*V*W, G], w2_bias [H*V*W], conv_state [S, W-1, H*V] (shifted in
    place), q, k [N, H, K], a, b [N, H] (raw), A_log, dt_bias [H] fp32, state [S, H, K, V] fp32 (advanced in place),
    state_indices [N] int32 -> o [N, H, V] in u.dtype. See `reference.jet_mixer_decode`."""
    args = (u, h, w2_weight, w2_bias, conv_state, q, k, a, b, A_log, dt_bias, state, state_indices, scale)
    if use_triton(u) and u.shape[0] <= FUSED_MAX_ROWS and envs.fused_mixer():
        return decode.jet_mixer_decode(*args)
    return one_after_the_other(dynamic_conv_decode, gated_delta_rule_decode, *args)


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
    """Advance a JetBlock's conv window and recurrent state along each sequence's accepted path of the last VERIFY
    step, in place: u [T, H*V] (the conv's raw inputs), conv_state [S, W-1, H*V], k [T, H, K], v [T, H, V] (the
    conv's outputs), a, b [T, H], A_log, dt_bias [H] fp32, state [S, H, K, V] fp32, state_indices [N] int32,
    accepted_nodes [N, T_d] (root first), num_accepted [N] (0: the row is left as it is). See
    `reference.jet_mixer_commit`."""
    fn = commit.jet_mixer_commit if use_triton(u) else reference.jet_mixer_commit
    fn(u, conv_state, k, v, a, b, A_log, dt_bias, state, state_indices, accepted_nodes, num_accepted)
