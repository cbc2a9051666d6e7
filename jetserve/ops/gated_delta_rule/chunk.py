"""Varlen chunked prefill on the GPU: fla-core's `chunk_gated_delta_rule` behind our contract (raw gates, pool slots).

fla's in-kernel q/k l2 norm uses our eps (1e-6). Its chunk kernel keeps the per-chunk states in the input dtype and
uses TF32 on Hopper even for fp32 inputs (on an H200, fp32 agrees with the reference to ~2e-3 of the largest output).
"""

from __future__ import annotations

import torch
from fla.ops.gated_delta_rule import chunk_gated_delta_rule

from jetserve.ops.gated_delta_rule.reference import (
    check_gate_params,
    check_heads,
    check_state,
    check_varlen,
    compute_gates,
    initial_states,
)


def chunk_gated_delta_rule_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    cu_seqlens: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Varlen prefill: q, k `[T, H, K]`, v `[T, H, V]`, a, b `[T, H]` (raw), A_log, dt_bias `[H]` fp32,
    state `[S, H, K, V]` fp32, cu_seqlens `[N+1]`, state_indices `[N]`, has_initial_state `[N]` bool.

    Initial states are gathered from the slots (zeros where `has_initial_state` is false) and final states scattered
    back, all on the device. Returns o `[T, H, V]` in `v.dtype`.
    """
    check_heads(q, k, v, a, b)
    check_state(state, k, v)
    check_gate_params(A_log, dt_bias, k)
    check_varlen(cu_seqlens, state_indices, has_initial_state)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    idx = state_indices.long()
    h0 = initial_states(state, state_indices, has_initial_state)  # [N, H, K, V] fp32
    if q.shape[0] == 0 or idx.shape[0] == 0:
        state[idx] = h0
        return torch.empty(v.shape, dtype=v.dtype, device=v.device)
    g, beta = compute_gates(a, b, A_log, dt_bias)  # [T, H] fp32
    # A fresh cu_seqlens object on every call: fla memoises its chunk tables by tensor identity, and a caller may
    # refill one cu_seqlens buffer in place between steps.
    cu = cu_seqlens.to(torch.int64, copy=True)
    o, final = chunk_gated_delta_rule(
        q[None],
        k[None],
        v[None],
        g[None],
        beta[None],
        scale=scale,
        initial_state=h0,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
        cu_seqlens=cu,
    )
    state[idx] = final.float()
    return o[0].to(v.dtype)
