"""Fused recurrent decode in Triton: one token per sequence, gates and q/k l2 norm in-kernel, state updated in place."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from jetserve.ops.gated_delta_rule.reference import L2NORM_EPS, check_gate_params, check_heads, check_state
from jetserve.ops.gated_delta_rule.step import (
    block_sizes,
    check_state_layout,
    delta_step,
    load_gates,
    load_unit,
    unit_last_stride,
)
from jetserve.ops.layout import dense
from jetserve.ops.norm.reference import check_gated_rms_norm
from jetserve.ops.pdl import pdl_enter, pdl_exit, pdl_launch


@triton.jit
def gated_delta_rule_decode_kernel(
    q,
    k,
    v,
    a,
    b,
    A_log,
    dt_bias,
    state,
    state_indices,
    o,
    gate,
    norm_weight,
    y,
    stride_q_n,
    stride_q_h,
    stride_k_n,
    stride_k_h,
    stride_v_n,
    stride_v_h,
    stride_a_n,
    stride_b_n,
    stride_s,
    stride_g_n,
    stride_g_h,
    scale,
    norm_eps,
    H: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    CHUNKS: tl.constexpr,  # V tiles a program walks, one after the other
    EPS: tl.constexpr,
    NORM: tl.constexpr,  # the JetBlock's output norm on o into y (the program holds a whole head: CHUNKS·BV ≥ V)
    BLOCK_VN: tl.constexpr,  # V padded to a power of two, for the norm
    PDL: tl.constexpr = False,  # programmatic dependent launch (`jetserve.ops.pdl`)
):
    pdl_enter(PDL)
    i_n, i_h, i_p = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    slot = tl.load(state_indices + i_n).to(tl.int64)
    i_n64 = i_n.to(tl.int64)
    b_q = load_unit(q + i_n64 * stride_q_n + i_h * stride_q_h, o_k, m_k, EPS) * scale
    b_k = load_unit(k + i_n64 * stride_k_n + i_h * stride_k_h, o_k, m_k, EPS)
    b_g, b_beta = load_gates(
        a + i_n64 * stride_a_n + i_h, b + i_n64 * stride_b_n + i_h, tl.load(A_log + i_h), tl.load(dt_bias + i_h)
    )
    for c in tl.range(0, CHUNKS, num_stages=1):
        o_v = (i_p * CHUNKS + c) * BV + tl.arange(0, BV)
        m_v = o_v < V
        m_s = m_k[:, None] & m_v[None, :]
        p_s = state + slot * stride_s + i_h * (K * V) + o_k[:, None] * V + o_v[None, :]
        b_s = tl.load(p_s, mask=m_s, other=0.0)  # [BK, BV] fp32
        b_v = tl.load(v + i_n64 * stride_v_n + i_h * stride_v_h + o_v, mask=m_v, other=0.0).to(tl.float32)
        b_s = delta_step(b_s, b_k, b_v, b_g, b_beta)
        b_o = tl.sum(b_s * b_q[:, None], axis=0)  # [BV]
        tl.store(p_s, b_s, mask=m_s)
        tl.store(o + (i_n64 * H + i_h) * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)
    if NORM:
        # `gated_rms_norm` of the head's rounded o, read back once every thread's stores are done
        tl.debug_barrier()
        o_vn = tl.arange(0, BLOCK_VN)
        m_vn = o_vn < V
        b_on = tl.load(o + (i_n64 * H + i_h) * V + o_vn, mask=m_vn, other=0.0).to(tl.float32)  # [BLOCK_VN]
        b_rstd = 1.0 / tl.sqrt(tl.sum(b_on * b_on, axis=0) / V + norm_eps)
        b_w = tl.load(norm_weight + o_vn, mask=m_vn, other=0.0).to(tl.float32)
        b_gt = tl.load(gate + i_n64 * stride_g_n + i_h * stride_g_h + o_vn, mask=m_vn, other=0.0).to(tl.float32)
        b_y = b_on * b_rstd * b_w * (b_gt * tl.sigmoid(b_gt))
        tl.store(y + (i_n64 * H + i_h) * V + o_vn, b_y.to(y.dtype.element_ty), mask=m_vn)
    pdl_exit(PDL)


WALK_MIN_PAIRS = 512  # (sequence, head) pairs from which a program walks two 64-wide V tiles (`decode_tiles`)


def decode_tiles(
    num_pairs: int, V: int, block_v: int | None, chunks: int | None = None, whole_head: bool = False
) -> tuple[int, int]:
    """(BV, CHUNKS) for `num_pairs` (sequence, head) pairs: a given block_v (with chunks, 1 unless given); otherwise
    32-wide tiles, one a program, under WALK_MIN_PAIRS pairs, and past that 64-wide tiles two a program.
    `whole_head` (the output norm): the tiles a program walks cover V.

    H200 sweeps (session 24, 2B shape, 24 layers' states from HBM in a CUDA graph, µs a layer): batch 64 45.7 → 43.7
    and 44.7 → 43.9, batch 256 166.6 → 162.2 and 170.1 → 162.8 — q, k, the gates and their norms loaded once for two
    tiles. Walking all four V tiles, pipelining the walk, cache-streaming hints, 1, 2 or 8 warps: no faster. In the
    2B decode step (TPOT, same GPU): batch 64 3.451 → 3.431 ms, batch 256 7.598 → 7.577."""
    if block_v is not None:
        BV, chunks = block_v, chunks or 1
    elif num_pairs < WALK_MIN_PAIRS:
        BV, chunks = min(triton.next_power_of_2(V), 32), 1
    else:
        BV = min(triton.next_power_of_2(V), 64)
        chunks = max(1, min(2, triton.cdiv(V, BV)))
    return (BV, triton.cdiv(V, BV)) if whole_head else (BV, chunks)


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
    *,
    block_v: int | None = None,
    chunks: int | None = None,
    norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> torch.Tensor:
    """One token per sequence, in place on `state[state_indices]`: q, k `[N, H, K]`, v `[N, H, V]`, a, b `[N, H]` (raw),
    A_log, dt_bias `[H]` fp32, state `[S, H, K, V]` fp32 (contiguous within a slot), state_indices `[N]` int32.

    Grid (N, H, V / (block_v · chunks)), tiles by batch unless block_v is given (`decode_tiles`); padded rows point
    at slot 0.
    Returns o `[N, H, V]` in `v.dtype`; with `norm = (gate [N, H, V], norm_weight [V], eps)`,
    `gated_rms_norm(o, norm_weight, gate, eps)` instead, in the same launch (one program a head).
    """
    check_heads(q, k, v, a, b)
    check_state(state, k, v)
    check_gate_params(A_log, dt_bias, k)
    check_state_layout(state)
    N, H, K = q.shape
    V = v.shape[-1]
    if state_indices.shape != (N,):
        raise ValueError(f"gated_delta_rule_decode: state_indices {tuple(state_indices.shape)} must be [{N}]")
    scale = K**-0.5 if scale is None else scale
    q, k, v, a, b = (unit_last_stride(x) for x in (q, k, v, a, b))
    (state_indices,) = dense(state_indices)
    BV, chunks = decode_tiles(N * H, V, block_v, chunks, whole_head=norm is not None)
    BK, BV = block_sizes(K, V, BV)
    o = torch.empty(N, H, V, dtype=v.dtype, device=v.device)
    if norm is None:
        gate, norm_weight, norm_eps, y = o, o, 0.0, o  # unused
    else:
        gate, norm_weight, norm_eps = norm
        check_gated_rms_norm(o, norm_weight, gate)
        gate = unit_last_stride(gate)
        y = torch.empty_like(o)
    if N == 0:
        return o if norm is None else y
    gated_delta_rule_decode_kernel[(N, H, triton.cdiv(V, BV * chunks))](
        q,
        k,
        v,
        a,
        b,
        A_log,
        dt_bias,
        state,
        state_indices,
        o,
        gate,
        norm_weight,
        y,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        a.stride(0),
        b.stride(0),
        state.stride(0),
        gate.stride(0),
        gate.stride(1),
        scale,
        norm_eps,
        H=H,
        K=K,
        V=V,
        BK=BK,
        BV=BV,
        CHUNKS=chunks,
        EPS=L2NORM_EPS,
        NORM=norm is not None,
        BLOCK_VN=triton.next_power_of_2(V),
        num_warps=4,
        **pdl_launch(q),
    )
    return o if norm is None else y
