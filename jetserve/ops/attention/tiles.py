"""Triton helpers shared by the attention kernels: paged slot lookup and one online-softmax step over a K/V tile."""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634  # the kernels fold it into the softmax scale and use exp2


@triton.jit
def cache_slots(block_tables, i_n, stride_bt, positions, PAGE_SIZE: tl.constexpr, RING: tl.constexpr, mask):
    """Physical slots (int64) of sequence i_n's logical `positions` (plain, or modulo RING for a ring)."""
    if RING > 0:
        logical = positions % RING
    else:
        logical = positions
    page = tl.load(block_tables + i_n * stride_bt + logical // PAGE_SIZE, mask=mask, other=0).to(tl.int64)
    return page * PAGE_SIZE + logical % PAGE_SIZE


@triton.jit
def attend_tile(b_q, b_kt, b_v, visible, b_m, b_l, b_acc, scale_log2):
    """Fold one tile into the running softmax: b_q [R, D], b_kt [D, N], b_v [N, D], visible [R, N] bool; b_m/b_l [R]
    running max (log2 units) and sum, b_acc [R, D] fp32. Returns the updated (b_m, b_l, b_acc)."""
    b_s = tl.dot(b_q, b_kt.to(b_q.dtype), input_precision="ieee") * scale_log2
    b_s = tl.where(visible, b_s, float("-inf"))
    b_m_new = tl.maximum(b_m, tl.max(b_s, axis=1))
    b_alpha = tl.exp2(b_m - b_m_new)
    b_p = tl.exp2(b_s - b_m_new[:, None])
    b_l = b_l * b_alpha + tl.sum(b_p, axis=1)
    b_acc = b_acc * b_alpha[:, None] + tl.dot(b_p.to(b_v.dtype), b_v, input_precision="ieee")
    return b_m_new, b_l, b_acc
