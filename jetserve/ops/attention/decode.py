"""Triton paged decode and tree-masked verify: one kernel, split over sequences x KV heads x key ranges.

A program owns every query row (draft node x query head) that reads one KV head, so GQA groups share each K/V tile
load; long contexts are split over programs (split-K) and merged by a second launch. The new tokens' K/V are read
from k/v and stored by the split-0 program (no other program reads those slots: see the ring rule in kernels.md).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from jetserve.ops.attention.reference import check_decode, check_verify, check_window
from jetserve.ops.attention.tiles import LOG2E, attend_tile, cache_slots
from jetserve.ops.layout import dense

INTERPRET_TARGET_PROGRAMS = 8  # the CPU interpreter still splits small batches, so tests cover the merge


@triton.jit
def _decode_kernel(
    q,
    k,
    v,
    k_cache,
    v_cache,
    o,
    o_part,
    lse_part,
    context_lens,
    block_tables,
    slot_mapping,
    tree_mask,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_bt,
    scale_log2,
    NUM_NODES: tl.constexpr,
    GROUP: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    WINDOW: tl.constexpr,
    RING: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    NUM_ROW_BLOCKS: tl.constexpr,
    IS_TREE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    i_nr, i_hk, i_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n = i_nr // NUM_ROW_BLOCKS
    i_rb = i_nr % NUM_ROW_BLOCKS
    prefix = tl.load(context_lens + i_n) - NUM_NODES  # positions before this are cached
    o_r = i_rb * BLOCK_R + tl.arange(0, BLOCK_R)  # row = node * GROUP + head within the group
    m_r = o_r < NUM_NODES * GROUP
    node_r = o_r // GROUP
    head_r = i_hk * GROUP + o_r % GROUP
    tok_r = (i_n * NUM_NODES + node_r).to(tl.int64)
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < HEAD_DIM
    m_q = m_r[:, None] & m_d[None, :]
    b_q = tl.load(q + tok_r[:, None] * stride_qt + head_r[:, None] * stride_qh + o_d[None, :], mask=m_q, other=0.0)

    o_a = tl.arange(0, BLOCK_T)  # the new tokens (draft nodes) of this sequence
    m_a = o_a < NUM_NODES
    p_tree = tree_mask + i_n * NUM_NODES * NUM_NODES
    if IS_TREE:
        b_tree = tl.load(p_tree + node_r[:, None] * NUM_NODES + o_a[None, :], mask=m_r[:, None] & m_a[None, :], other=0)
        b_tree = b_tree != 0  # [BLOCK_R, BLOCK_T]: node a is the row's node or an ancestor
        depth_r = tl.sum(b_tree.to(tl.int32), axis=1) - 1
    else:
        b_tree = node_r[:, None] >= o_a[None, :]  # causal among the new tokens
        depth_r = node_r
    q_pos = prefix + depth_r  # [BLOCK_R]

    b_m = tl.full([BLOCK_R], -1.0e30, dtype=tl.float32)  # running max (log2 units); finite so empty rows stay 0
    b_l = tl.zeros([BLOCK_R], dtype=tl.float32)
    b_acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)

    # Cached keys [lo, prefix), this program's share of them.
    if WINDOW > 0:
        lo = tl.maximum(prefix - WINDOW + 1, 0)  # the shallowest row's window; deeper rows mask more
    else:
        lo = 0
    split_len = tl.cdiv(tl.cdiv(prefix - lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
    s_lo = lo + i_s * split_len
    s_hi = tl.minimum(prefix, s_lo + split_len)
    cache_off = i_hk * HEAD_DIM
    for n0 in range(s_lo, s_hi, BLOCK_N):
        p = n0 + tl.arange(0, BLOCK_N)
        m_key = p < s_hi
        slot = cache_slots(block_tables, i_n, stride_bt, p, PAGE_SIZE, RING, m_key)
        p_row = slot * (NUM_KV_HEADS * HEAD_DIM) + cache_off
        b_kt = tl.load(k_cache + p_row[None, :] + o_d[:, None], mask=m_key[None, :] & m_d[:, None], other=0.0)
        b_v = tl.load(v_cache + p_row[:, None] + o_d[None, :], mask=m_key[:, None] & m_d[None, :], other=0.0)
        visible = m_key[None, :]
        if WINDOW > 0:
            visible = visible & (p[None, :] > q_pos[:, None] - WINDOW)
        b_m, b_l, b_acc = attend_tile(b_q, b_kt, b_v, visible, b_m, b_l, b_acc, scale_log2)

    # The new tokens themselves, from k/v, in the last split (every other split masks them out).
    is_last = i_s == NUM_SPLITS - 1
    m_new = m_a & is_last
    tok_a = (i_n * NUM_NODES + o_a).to(tl.int64)
    b_kt = tl.load(
        k + tok_a[None, :] * stride_kt + i_hk * stride_kh + o_d[:, None], mask=m_new[None, :] & m_d[:, None], other=0.0
    )  # [BLOCK_D, BLOCK_T]
    b_v = tl.load(
        v + tok_a[:, None] * stride_vt + i_hk * stride_vh + o_d[None, :], mask=m_new[:, None] & m_d[None, :], other=0.0
    )
    visible = b_tree & m_new[None, :]
    if WINDOW > 0:
        if IS_TREE:
            b_path = tl.load(
                p_tree + o_a[:, None] * NUM_NODES + o_a[None, :], mask=m_a[:, None] & m_a[None, :], other=0
            )
            depth_a = tl.sum((b_path != 0).to(tl.int32), axis=1) - 1
        else:
            depth_a = o_a
        visible = visible & (depth_a[None, :] > depth_r[:, None] - WINDOW)
    b_m, b_l, b_acc = attend_tile(b_q, b_kt, b_v, visible, b_m, b_l, b_acc, scale_log2)

    num_heads = NUM_KV_HEADS * GROUP
    has_keys = b_l > 0  # false for padding rows and for a split past the context
    b_l_safe = tl.where(has_keys, b_l, 1.0)
    if NUM_SPLITS == 1:
        b_o = b_acc / b_l_safe[:, None]
        tl.store(
            o + (tok_r * num_heads + head_r)[:, None] * HEAD_DIM + o_d[None, :], b_o.to(o.dtype.element_ty), mask=m_q
        )
    else:
        part = (tok_r * num_heads + head_r) * NUM_SPLITS + i_s  # [BLOCK_R]
        tl.store(o_part + part[:, None] * HEAD_DIM + o_d[None, :], b_acc / b_l_safe[:, None], mask=m_q)
        tl.store(lse_part + part, tl.where(has_keys, b_m + tl.log2(b_l_safe), float("-inf")), mask=m_r)

    if (i_s == 0) & (i_rb == 0):
        # Store this KV head's rows of the new tokens; no program of this launch reads their slots.
        slot = tl.load(slot_mapping + tok_a, mask=m_a, other=-1).to(tl.int64)
        m_st = (m_a & (slot >= 0))[:, None] & m_d[None, :]
        p_dst = slot[:, None] * (NUM_KV_HEADS * HEAD_DIM) + cache_off + o_d[None, :]
        b_k = tl.load(k + tok_a[:, None] * stride_kt + i_hk * stride_kh + o_d[None, :], mask=m_st)
        tl.store(k_cache + p_dst, b_k.to(k_cache.dtype.element_ty), mask=m_st)
        b_v = tl.load(v + tok_a[:, None] * stride_vt + i_hk * stride_vh + o_d[None, :], mask=m_st)
        tl.store(v_cache + p_dst, b_v.to(v_cache.dtype.element_ty), mask=m_st)


@triton.jit
def _merge_kernel(
    o_part,
    lse_part,
    o,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    i_th = tl.program_id(0).to(tl.int64)  # token * H + head
    o_s = tl.arange(0, BLOCK_S)
    m_s = o_s < NUM_SPLITS
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < HEAD_DIM
    b_lse = tl.load(lse_part + i_th * NUM_SPLITS + o_s, mask=m_s, other=float("-inf"))
    b_w = tl.exp2(b_lse - tl.max(b_lse, axis=0))  # the last split always holds the token itself: max is finite
    b_w = b_w / tl.sum(b_w, axis=0)
    p = o_part + (i_th * NUM_SPLITS + o_s)[:, None] * HEAD_DIM + o_d[None, :]
    b_o = tl.sum(tl.load(p, mask=m_s[:, None] & m_d[None, :], other=0.0) * b_w[:, None], axis=0)
    tl.store(o + i_th * HEAD_DIM + o_d, b_o.to(o.dtype.element_ty), mask=m_d)


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def decode_plan(
    num_programs: int, capacity_tokens: int, device: torch.device, verify: bool = False
) -> tuple[int, int, int, int]:
    """(splits, BLOCK_N, num_warps, num_stages) for `num_programs` (sequence, KV head, row block) programs; `verify`:
    a tree of draft nodes, whose programs hold up to 64 query rows — 64-key tiles always (H200, session 24: at batch
    64, 4K prefix, chain 6 / tree 8: 126 / 131 → 92 / 93 µs, window 1152 62 / 66 → 39 / 40; batch 1 11.3 / 11.8 →
    10.4 / 10.7, against splits rounded up and 3 stages).

    Splits: as many as keep the grid within two programs per SM (8 in all on the CPU interpreter), rounded down —
    a third program on some SMs costs the whole launch a second wave — and at most 64. Tiles: 128 keys, 4 warps and 2
    stages when each split keeps at least two such tiles of the largest context the cache can hold, 64 keys
    otherwise; never more splits than tiles. H200 sweep (session 24, 2B shape, 4K and 16K context, CUDA graph):
    batch 256 full attention 338 → 251 µs, sliding window 102 → 80; batch 64 74 → 71 and 40 → 29; batch 1 9.6 → 8.9.
    """
    if device.type != "cuda":
        splits = INTERPRET_TARGET_PROGRAMS // max(1, num_programs)
        return max(1, min(splits, triton.cdiv(capacity_tokens, 16))), 16, 1, 1
    splits = max(1, min(2 * _num_sms(device.index or 0) // max(1, num_programs), 64))
    block_n = 128 if capacity_tokens >= splits * 2 * 128 and not verify else 64
    return max(1, min(splits, triton.cdiv(capacity_tokens, block_n))), block_n, 4, 2


def _launch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tree_mask: torch.Tensor | None,
    num_nodes: int,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    slot_mapping: torch.Tensor,
    scale: float,
    window_tokens: int,
    ring_tokens: int,
) -> torch.Tensor:
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and block_tables.stride(-1) == 1
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    context_lens, slot_mapping = dense(context_lens, slot_mapping)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    num_seqs = context_lens.shape[0]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return out
    interpret = not q.is_cuda
    num_rows = num_nodes * group
    block_r = 16 if interpret else max(16, min(64, triton.next_power_of_2(num_rows)))
    num_row_blocks = triton.cdiv(num_rows, block_r)
    page_size = k_cache.shape[1]
    capacity = block_tables.shape[1] * page_size
    if window_tokens:
        capacity = min(capacity, window_tokens)
    num_programs = num_seqs * num_kv_heads * num_row_blocks
    splits, block_n, num_warps, num_stages = decode_plan(num_programs, capacity, q.device, verify=num_nodes > 1)
    if splits > 1:
        o_part = torch.empty(num_tokens, num_heads, splits, head_dim, dtype=torch.float32, device=q.device)
        lse_part = torch.empty(num_tokens, num_heads, splits, dtype=torch.float32, device=q.device)
    else:
        o_part = lse_part = out  # unused
    is_tree = tree_mask is not None
    mask_arg = tree_mask.view(torch.uint8) if is_tree else out
    _decode_kernel[(num_seqs * num_row_blocks, num_kv_heads, splits)](
        q, k, v, k_cache, v_cache, out, o_part, lse_part, context_lens, block_tables, slot_mapping, mask_arg,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), block_tables.stride(0),
        scale * LOG2E,
        NUM_NODES=num_nodes, GROUP=group, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, PAGE_SIZE=page_size,
        WINDOW=window_tokens, RING=ring_tokens, NUM_SPLITS=splits, NUM_ROW_BLOCKS=num_row_blocks, IS_TREE=is_tree,
        BLOCK_R=block_r, BLOCK_T=max(16, triton.next_power_of_2(num_nodes)), BLOCK_N=block_n,
        BLOCK_D=triton.next_power_of_2(head_dim), num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    if splits > 1:
        _merge_kernel[(num_tokens * num_heads,)](
            o_part, lse_part, out, HEAD_DIM=head_dim, NUM_SPLITS=splits, BLOCK_S=triton.next_power_of_2(splits),
            BLOCK_D=triton.next_power_of_2(head_dim),
        )  # fmt: skip
    return out


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
    """One new token per sequence (position context_lens[i] - 1) over its cached prefix; stores its K/V.

    q [N, H, Dh], k/v [N, HK, Dh] (last dims contiguous), k_cache/v_cache [num_pages, page_size, HK, Dh] contiguous
    (updated in place), context_lens [N] int32, block_tables [N, P] int32, slot_mapping [N] int (-1 skips).
    Returns [N, H, Dh] in q.dtype. Semantics: `reference.attention_decode`.
    """
    check_decode(q, k, v, k_cache, v_cache, context_lens, block_tables, slot_mapping)
    check_window(window_tokens, ring_tokens)
    return _launch(
        q, k, v, k_cache, v_cache, None, 1, context_lens, block_tables, slot_mapping, scale, window_tokens, ring_tokens
    )


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
    """Tree-masked attention of T_d draft nodes per sequence over the prefix and their ancestors; stores node K/V.

    q [T, H, Dh], k/v [T, HK, Dh] with T = N*T_d (token i*T_d + j is node j of sequence i; last dims contiguous),
    k_cache/v_cache [num_pages, page_size, HK, Dh] contiguous (updated in place), tree_mask [N, T_d, T_d] bool
    contiguous, context_lens [N] int32 (prefix + T_d), block_tables [N, P] int32, slot_mapping [T] int (-1 skips).
    Returns [T, H, Dh] in q.dtype. Semantics: `reference.attention_verify`.
    """
    check_verify(q, k, v, k_cache, v_cache, tree_mask, context_lens, block_tables, slot_mapping)
    check_window(window_tokens, ring_tokens)
    tree_mask = tree_mask if tree_mask.is_contiguous() else tree_mask.contiguous()
    return _launch(
        q, k, v, k_cache, v_cache, tree_mask, tree_mask.shape[1], context_lens, block_tables, slot_mapping, scale,
        window_tokens, ring_tokens,
    )  # fmt: skip
