"""Paged GQA attention (prefill, decode, tree verify, KV commit) and RoPE, over the paged K/V cache."""

from __future__ import annotations

import torch

from jetserve.ops.attention import decode, kv_store, prefill, reference, rope
from jetserve.ops.attention.reference import rope_cos_sin
from jetserve.ops.backend import use_triton


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, Dh], k [T, HK, Dh], positions [T], cos_sin [max_pos, Dh] fp32 → new (q, k); see the reference."""
    if use_triton(q):
        return rope.apply_rope(q, k, positions, cos_sin)
    return reference.apply_rope(q, k, positions, cos_sin)


def attention_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    scale: float,
    window_tokens: int = 0,
    ring_tokens: int = 0,
    max_seqlen_q: int,
) -> torch.Tensor:
    """q [T, H, Dh], k/v [T, HK, Dh], paged caches, cu_seqlens [N+1], context_lens [N], block_tables [N, P],
    slot_mapping [T] → [T, H, Dh]; stores the new K/V. See `reference.attention_prefill`."""
    impl = prefill if use_triton(q) else reference
    return impl.attention_prefill(
        q, k, v, k_cache, v_cache, cu_seqlens, context_lens, block_tables, slot_mapping,
        scale=scale, window_tokens=window_tokens, ring_tokens=ring_tokens, max_seqlen_q=max_seqlen_q,
    )  # fmt: skip


def attention_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    scale: float,
    window_tokens: int = 0,
    ring_tokens: int = 0,
) -> torch.Tensor:
    """q [N, H, Dh], k/v [N, HK, Dh], paged caches, context_lens [N], block_tables [N, P], slot_mapping [N]
    → [N, H, Dh]; stores the new K/V. See `reference.attention_decode`."""
    impl = decode if use_triton(q) else reference
    return impl.attention_decode(
        q, k, v, k_cache, v_cache, context_lens, block_tables, slot_mapping,
        scale=scale, window_tokens=window_tokens, ring_tokens=ring_tokens,
    )  # fmt: skip


def attention_verify(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tree_mask: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    scale: float,
    window_tokens: int = 0,
    ring_tokens: int = 0,
) -> torch.Tensor:
    """q [N*T_d, H, Dh], k/v [N*T_d, HK, Dh], paged caches, tree_mask [N, T_d, T_d] bool, context_lens [N],
    block_tables [N, P], slot_mapping [N*T_d] → [N*T_d, H, Dh]; stores node K/V. See `reference.attention_verify`."""
    impl = decode if use_triton(q) else reference
    return impl.attention_verify(
        q, k, v, k_cache, v_cache, tree_mask, context_lens, block_tables, slot_mapping,
        scale=scale, window_tokens=window_tokens, ring_tokens=ring_tokens,
    )  # fmt: skip


def kv_cache_commit(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    prefix_lens: torch.Tensor,
    accepted_nodes: torch.Tensor,
    num_accepted: torch.Tensor,
    *,
    ring_tokens: int = 0,
) -> None:
    """Paged caches, block_tables [N, P], prefix_lens [N], accepted_nodes [N, T_d], num_accepted [N]: moves accepted
    nodes' K/V to their final positions in place. See `reference.kv_cache_commit`."""
    impl = kv_store if use_triton(k_cache) else reference
    impl.kv_cache_commit(
        k_cache, v_cache, block_tables, prefix_lens, accepted_nodes, num_accepted, ring_tokens=ring_tokens
    )


__all__ = [
    "apply_rope",
    "attention_decode",
    "attention_prefill",
    "attention_verify",
    "kv_cache_commit",
    "rope_cos_sin",
]
