"""Gated delta rule ops (JetBlock linear attention): prefill, decode, tree verify and commit on pool state slots.

Each public function runs the Triton variant when `use_triton(q or k)` says so, else the pure-PyTorch reference.
"""

from __future__ import annotations

import torch

from jetserve.ops.backend import use_triton
from jetserve.ops.gated_delta_rule import decode, reference, tree
from jetserve.ops.gated_delta_rule.chunk_table import DeltaRuleChunks


def gated_delta_rule_prefill(
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
    """Varlen prefill: q, k [T, H, K], v [T, H, V], a, b [T, H] (raw), A_log, dt_bias [H] fp32, state [S, H, K, V]
    fp32 (final states written to the slots), cu_seqlens [N+1] int32, state_indices [N] int32, has_initial_state [N]
    bool, `chunks` the step's chunk table of these cu_seqlens (`chunk_table.DeltaRuleChunks`; the Triton variant
    builds it when not given, reading cu_seqlens back) -> [T, H, V] in v.dtype. See
    `reference.gated_delta_rule_prefill`."""
    if use_triton(q):
        # Imported on first use: importing fla takes seconds and is needed only by this variant.
        from jetserve.ops.gated_delta_rule.chunk import chunk_gated_delta_rule_prefill as fn
    else:
        fn = reference.gated_delta_rule_prefill
    return fn(q, k, v, a, b, A_log, dt_bias, state, cu_seqlens, state_indices, has_initial_state, scale, chunks)


def gated_delta_rule_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    state_indices: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """One token per sequence: q, k [N, H, K], v [N, H, V], a, b [N, H], A_log, dt_bias [H] fp32, state [S, H, K, V]
    fp32 (updated in place), state_indices [N] int32 -> [N, H, V]. See `reference.gated_delta_rule_decode`."""
    fn = decode.gated_delta_rule_decode if use_triton(q) else reference.gated_delta_rule_decode
    return fn(q, k, v, a, b, A_log, dt_bias, state, state_indices, scale)


NORM_MIN_PAIRS = decode.WALK_MIN_PAIRS  # the pairs from which the decode's programs already walk several V tiles


def decode_takes_norm(num_rows: int, num_heads: int, x: torch.Tensor) -> bool:
    """Whether a decode step of `num_rows` sequences should run the JetBlock's output norm in the gated delta rule's
    launch (`gated_delta_rule_decode_norm`): the Triton backend and at least NORM_MIN_PAIRS (sequence, head) pairs,
    where a program walking a whole head costs about what two tiles did (H200, session 24: batch 64 43.9 → 45.0 µs a
    layer, batch 256 162.8 → 163.4) and the norm's own launch (~4 µs) goes: the 2B step 3.325 → 3.273 ms at batch 64,
    7.461 → 7.405 at 256."""
    return use_triton(x) and num_rows * num_heads >= NORM_MIN_PAIRS


def gated_delta_rule_decode_norm(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    state_indices: torch.Tensor,
    gate: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    scale: float | None = None,
) -> torch.Tensor:
    """`gated_delta_rule_decode` then the JetBlock's output norm (`gated_rms_norm(o, norm_weight, gate, eps)`; gate
    [N, H, V], norm_weight [V]) -> [N, H, V]; the Triton variant in one launch, one program a head. See
    `reference.gated_delta_rule_decode_norm`."""
    if use_triton(q):
        norm = (gate, norm_weight, eps)
        return decode.gated_delta_rule_decode(q, k, v, a, b, A_log, dt_bias, state, state_indices, scale, norm=norm)
    return reference.gated_delta_rule_decode_norm(
        q, k, v, a, b, A_log, dt_bias, state, state_indices, gate, norm_weight, eps, scale
    )


def gated_delta_rule_verify(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    state_indices: torch.Tensor,
    tree_parents: torch.Tensor,
    scale: float | None = None,
    *,
    is_chain: bool = False,
) -> torch.Tensor:
    """Draft-tree outputs: q, k [N*T_d, H, K], v [N*T_d, H, V], a, b [N*T_d, H], A_log, dt_bias [H] fp32,
    state [S, H, K, V] fp32 (read only), state_indices [N] int32, tree_parents [N, T_d] int32 -> [N*T_d, H, V];
    `is_chain`: every row is a chain (topk = 1 drafts), the Triton kernel's faster form. See
    `reference.gated_delta_rule_verify`."""
    fn = tree.gated_delta_rule_verify if use_triton(q) else reference.gated_delta_rule_verify
    return fn(q, k, v, a, b, A_log, dt_bias, state, state_indices, tree_parents, scale, is_chain=is_chain)


def gated_delta_rule_commit(
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
    """Replay the accepted path into the slot: k [N*T_d, H, K], v [N*T_d, H, V], a, b [N*T_d, H] (the verify inputs),
    A_log, dt_bias [H] fp32, state [S, H, K, V] fp32 (updated in place), state_indices [N] int32,
    accepted_nodes [N, T_d] int32 (root first), num_accepted [N] int32. See `reference.gated_delta_rule_commit`."""
    fn = tree.gated_delta_rule_commit if use_triton(k) else reference.gated_delta_rule_commit
    fn(k, v, a, b, A_log, dt_bias, state, state_indices, accepted_nodes, num_accepted)


__all__ = [
    "NORM_MIN_PAIRS",
    "decode_takes_norm",
    "gated_delta_rule_commit",
    "gated_delta_rule_decode",
    "gated_delta_rule_decode_norm",
    "gated_delta_rule_prefill",
    "gated_delta_rule_verify",
]
