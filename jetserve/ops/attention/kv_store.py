"""Triton K/V cache writes: storing a prefill chunk's new K/V at its slots, and committing accepted draft nodes."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from jetserve.ops.attention.reference import check_commit
from jetserve.ops.attention.tiles import cache_slots
from jetserve.ops.layout import dense


@triton.jit
def _store_kernel(
    k,
    v,
    k_cache,
    v_cache,
    cu_seqlens,
    slot_mapping,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    RING: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    i_t, i_n = tl.program_id(0), tl.program_id(1)
    cu_lo = tl.load(cu_seqlens + i_n)
    q_len = tl.load(cu_seqlens + i_n + 1) - cu_lo
    if i_t * BLOCK_T >= q_len:
        return
    o_j = i_t * BLOCK_T + tl.arange(0, BLOCK_T)  # index within the sequence's new tokens
    m_j = o_j < q_len
    tok = (cu_lo + o_j).to(tl.int64)
    slot = tl.load(slot_mapping + tok, mask=m_j, other=-1).to(tl.int64)
    keep = m_j & (slot >= 0)
    if RING > 0:
        # only the last RING tokens survive the call; older ones would land on the same ring slots
        keep &= o_j >= q_len - RING
    o_c = tl.arange(0, BLOCK_C)  # flat (kv head, dim) index
    m_c = o_c < NUM_KV_HEADS * HEAD_DIM
    i_h, i_d = o_c // HEAD_DIM, o_c % HEAD_DIM
    m = keep[:, None] & m_c[None, :]
    p_dst = slot[:, None] * (NUM_KV_HEADS * HEAD_DIM) + o_c[None, :]
    b_k = tl.load(k + tok[:, None] * stride_kt + (i_h * stride_kh + i_d)[None, :], mask=m)
    tl.store(k_cache + p_dst, b_k.to(k_cache.dtype.element_ty), mask=m)
    b_v = tl.load(v + tok[:, None] * stride_vt + (i_h * stride_vh + i_d)[None, :], mask=m)
    tl.store(v_cache + p_dst, b_v.to(v_cache.dtype.element_ty), mask=m)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    ring_tokens: int,
    max_seqlen_q: int,
) -> None:
    """Write a varlen chunk's new K/V to the caches at `slot_mapping` (-1 skips); with a ring, only each sequence's
    last `ring_tokens` new tokens.

    k/v [T, HK, Dh] (last dim contiguous), k_cache/v_cache [num_pages, page_size, HK, Dh] contiguous,
    cu_seqlens [N+1] int32, slot_mapping [T] int.
    """
    num_seqs = cu_seqlens.shape[0] - 1
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    cu_seqlens, slot_mapping = dense(cu_seqlens, slot_mapping)
    if k.shape[0] == 0 or num_seqs == 0:
        return
    block_c = triton.next_power_of_2(num_kv_heads * head_dim)
    block_t = max(1, min(16, 4096 // block_c))
    grid = (triton.cdiv(max(1, max_seqlen_q), block_t), num_seqs)
    _store_kernel[grid](
        k, v, k_cache, v_cache, cu_seqlens, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, RING=ring_tokens, BLOCK_T=block_t, BLOCK_C=block_c,
    )  # fmt: skip


@triton.jit
def _commit_kernel(
    k_cache,
    v_cache,
    block_tables,
    prefix_lens,
    accepted_nodes,
    num_accepted,
    stride_bt,
    stride_an,
    NUM_NODES: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    RING: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    i_n, i_h = tl.program_id(0), tl.program_id(1)
    prefix = tl.load(prefix_lens + i_n)
    count = tl.load(num_accepted + i_n)
    o_a = tl.arange(0, BLOCK_T)  # depth along the accepted path
    m_a = (o_a < count) & (o_a < NUM_NODES)
    node = tl.load(accepted_nodes + i_n * stride_an + o_a, mask=m_a, other=0)
    m_a &= node != o_a  # a node already at its depth (a chain) stays put
    src = cache_slots(block_tables, i_n, stride_bt, prefix + node, PAGE_SIZE, RING, m_a)
    dst = cache_slots(block_tables, i_n, stride_bt, prefix + o_a, PAGE_SIZE, RING, m_a)
    o_d = tl.arange(0, BLOCK_D)
    m = m_a[:, None] & (o_d < HEAD_DIM)[None, :]
    offset = i_h * HEAD_DIM + o_d[None, :]
    p_src = src[:, None] * (NUM_KV_HEADS * HEAD_DIM) + offset
    p_dst = dst[:, None] * (NUM_KV_HEADS * HEAD_DIM) + offset
    b_k = tl.load(k_cache + p_src, mask=m)
    b_v = tl.load(v_cache + p_src, mask=m)
    # a destination may be another move's source (path 0-2-3: 2 -> 1 reads what 3 -> 2 writes): all reads first
    tl.debug_barrier()
    tl.store(k_cache + p_dst, b_k, mask=m)
    tl.store(v_cache + p_dst, b_v, mask=m)


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
    """Move accepted draft nodes' K/V to their final positions, in place, in one launch with no host sync.

    k_cache/v_cache [num_pages, page_size, HK, Dh] contiguous, block_tables [N, P] int32, prefix_lens [N] int32,
    accepted_nodes [N, T_d] int32 (root first; entries past num_accepted ignored), num_accepted [N] int32. Node
    `accepted_nodes[i, d]` moves from position prefix_i + node to prefix_i + d.
    """
    check_commit(k_cache, v_cache, block_tables, prefix_lens, accepted_nodes, num_accepted, ring_tokens)
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    num_seqs, num_nodes = accepted_nodes.shape
    if num_seqs == 0:
        return
    accepted_nodes = accepted_nodes if accepted_nodes.stride(-1) == 1 else accepted_nodes.contiguous()
    prefix_lens, num_accepted = dense(prefix_lens, num_accepted)
    _, page_size, num_kv_heads, head_dim = k_cache.shape
    _commit_kernel[(num_seqs, num_kv_heads)](
        k_cache, v_cache, block_tables, prefix_lens, accepted_nodes, num_accepted,
        block_tables.stride(0), accepted_nodes.stride(0),
        NUM_NODES=num_nodes, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, PAGE_SIZE=page_size, RING=ring_tokens,
        BLOCK_T=triton.next_power_of_2(num_nodes), BLOCK_D=triton.next_power_of_2(head_dim),
    )  # fmt: skip
