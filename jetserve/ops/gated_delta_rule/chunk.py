"""Varlen chunked prefill on the GPU: fla-core's chunk kernels behind our contract (raw gates, pool slots).

q and k arrive l2-normalised (eps 1e-6) from `prefill_inputs`, with the gates. fla's chunk kernels keep the per-chunk
states in the input dtype and use TF32 on Hopper even for fp32 inputs (on an H200, fp32 agrees with the reference to
~2e-3 of the largest output).

The kernels are called below fla's public `chunk_gated_delta_rule`, whose wrappers (backend dispatch, an autograd
Function, input guards, and a device read to build the chunk table from cu_seqlens) made a call cost 1.40–1.47 ms of
host time on an H200's host whatever the length, against 0.86–0.91 ms below them (session 49): more than a 2B layer's
GPU work at 4K tokens. A step builds its chunk table once on the host (`chunk_table.DeltaRuleChunks`, in the step's
one upload) and every JetBlock layer shares it.
"""

from __future__ import annotations

import torch
from fla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule_fwd

from jetserve.ops.gated_delta_rule.chunk_table import CHUNK_SIZE, DeltaRuleChunks
from jetserve.ops.gated_delta_rule.prefill_inputs import prefill_inputs
from jetserve.ops.gated_delta_rule.reference import (
    check_gate_params,
    check_heads,
    check_state,
    check_varlen,
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
    chunks: DeltaRuleChunks | None = None,
) -> torch.Tensor:
    """Varlen prefill: q, k `[T, H, K]`, v `[T, H, V]`, a, b `[T, H]` (raw), A_log, dt_bias `[H]` fp32,
    state `[S, H, K, V]` fp32, cu_seqlens `[N+1]`, state_indices `[N]`, has_initial_state `[N]` bool; `chunks` the
    step's chunk table for these cu_seqlens (built here, with a device read, when not given); a `fresh` table is the
    caller's promise that every has_initial_state is false.

    Initial states are gathered from the slots (zeros where `has_initial_state` is false) and final states scattered
    back, all on the device. Returns o `[T, H, V]` in `v.dtype`.
    """
    check_heads(q, k, v, a, b)
    check_state(state, k, v)
    check_gate_params(A_log, dt_bias, k)
    check_varlen(cu_seqlens, state_indices, has_initial_state)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    idx = state_indices.long()
    if q.shape[0] == 0 or idx.shape[0] == 0:
        state[idx] = initial_states(state, state_indices, has_initial_state)
        return torch.empty(v.shape, dtype=v.dtype, device=v.device)
    if chunks is None:
        chunks = DeltaRuleChunks.from_cu_seqlens(cu_seqlens)
    # [N, H, K, V] fp32; None (zeros) when the host knows that no sequence continues from its slot
    h0 = None if chunks.fresh else initial_states(state, state_indices, has_initial_state)
    q, k, g, beta = prefill_inputs(q, k, a, b, A_log, dt_bias)  # dense [T, H, K] x2, normalised; [T, H] fp32 x2
    _, o, _, final, _, _ = chunk_gated_delta_rule_fwd(
        q=q[None],
        k=k[None],
        v=v.contiguous()[None],
        g=g[None],
        beta=beta[None],
        scale=scale,
        initial_state=h0,
        output_final_state=True,
        cu_seqlens=chunks.cu_seqlens,
        chunk_indices=chunks.chunk_indices,
        chunk_size=CHUNK_SIZE,
    )
    state[idx] = final  # [N, H, K, V] fp32
    return o[0].to(v.dtype)
