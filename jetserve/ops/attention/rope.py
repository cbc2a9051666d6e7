"""Triton RoPE: one launch rotates q and k of every token (rotate-half over all head dims, fp32 inside)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from jetserve.ops.attention.reference import check_rope
from jetserve.ops.layout import dense


@triton.jit
def _rope_kernel(
    q,
    k,
    q_out,
    k_out,
    positions,
    cos_sin,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cs,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    i_t = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions + i_t).to(tl.int64)
    o_d = tl.arange(0, BLOCK_HALF)
    m_d = o_d < HALF
    b_cos = tl.load(cos_sin + pos * stride_cs + o_d, mask=m_d, other=0.0)[None, :]  # [1, BLOCK_HALF] fp32
    b_sin = tl.load(cos_sin + pos * stride_cs + HALF + o_d, mask=m_d, other=0.0)[None, :]
    o_h = tl.arange(0, BLOCK_H)

    m_q = (o_h < NUM_HEADS)[:, None] & m_d[None, :]
    p_q = q + i_t * stride_qt + o_h[:, None] * stride_qh + o_d[None, :]
    b_x1 = tl.load(p_q, mask=m_q, other=0.0).to(tl.float32)
    b_x2 = tl.load(p_q + HALF, mask=m_q, other=0.0).to(tl.float32)
    p_y = q_out + i_t * NUM_HEADS * 2 * HALF + o_h[:, None] * 2 * HALF + o_d[None, :]
    tl.store(p_y, (b_x1 * b_cos - b_x2 * b_sin).to(q_out.dtype.element_ty), mask=m_q)
    tl.store(p_y + HALF, (b_x2 * b_cos + b_x1 * b_sin).to(q_out.dtype.element_ty), mask=m_q)

    m_k = (o_h < NUM_KV_HEADS)[:, None] & m_d[None, :]
    p_k = k + i_t * stride_kt + o_h[:, None] * stride_kh + o_d[None, :]
    b_x1 = tl.load(p_k, mask=m_k, other=0.0).to(tl.float32)
    b_x2 = tl.load(p_k + HALF, mask=m_k, other=0.0).to(tl.float32)
    p_y = k_out + i_t * NUM_KV_HEADS * 2 * HALF + o_h[:, None] * 2 * HALF + o_d[None, :]
    tl.store(p_y, (b_x1 * b_cos - b_x2 * b_sin).to(k_out.dtype.element_ty), mask=m_k)
    tl.store(p_y + HALF, (b_x2 * b_cos + b_x1 * b_sin).to(k_out.dtype.element_ty), mask=m_k)


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half RoPE, returning new contiguous tensors in the input dtypes.

    q [T, H, Dh], k [T, HK, Dh] (last dim contiguous), positions [T] int, cos_sin [max_pos, Dh] fp32 (`[cos, sin]`
    halves, from `rope_cos_sin`). Returns (q_rot [T, H, Dh], k_rot [T, HK, Dh]).
    """
    check_rope(q, k, positions, cos_sin)
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    cos_sin = cos_sin if cos_sin.stride(-1) == 1 else cos_sin.contiguous()
    (positions,) = dense(positions)
    num_tokens, num_heads, head_dim = q.shape
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if num_tokens == 0:
        return q_out, k_out
    _rope_kernel[(num_tokens,)](
        q, k, q_out, k_out, positions, cos_sin,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin.stride(0),
        NUM_HEADS=num_heads, NUM_KV_HEADS=k.shape[1], HALF=head_dim // 2,
        BLOCK_H=triton.next_power_of_2(max(num_heads, k.shape[1])), BLOCK_HALF=triton.next_power_of_2(head_dim // 2),
    )  # fmt: skip
    return q_out, k_out
