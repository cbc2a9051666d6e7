"""Tree verify and commit in Triton. Verify computes every draft node's output from the committed state in the tree form
of the chunked rule (the state is read once per program and never written; no per-node state is formed); commit
replays the accepted path and writes the state once. Together they move 1.5x a decode step's state bytes."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from jetserve.ops.gated_delta_rule.reference import (
    L2NORM_EPS,
    check_gate_params,
    check_heads,
    check_state,
    check_tree,
)
from jetserve.ops.gated_delta_rule.step import (
    block_sizes,
    check_state_layout,
    delta_step,
    gates,
    load_gates,
    load_unit,
    unit_last_stride,
)


@triton.jit
def gated_delta_rule_verify_kernel(
    q,
    k,
    v,
    a,
    b,
    A_log,
    dt_bias,
    state,
    state_indices,
    tree_parents,
    o,
    stride_q_t,
    stride_q_h,
    stride_k_t,
    stride_k_h,
    stride_v_t,
    stride_v_h,
    stride_a_t,
    stride_b_t,
    stride_s,
    scale,
    T_d,
    H: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    BT: tl.constexpr,
    EPS: tl.constexpr,
):
    # Tree form of the chunked delta rule. With G_j the summed log decay along node j's path (root..j) and e_s the
    # delta-rule error of node s (it depends only on s's own path), every node state is
    #   S_j = exp(G_j) S0 + sum_{s in path(j)} exp(G_j - G_s) k_s e_sᵀ,
    #   e_s = β_s (v_s - exp(G_s) S0ᵀk_s - sum_{r in path(s), r != s} exp(G_s - G_r) (k_r·k_s) e_r),
    # so the committed tile S0 enters only through K S0 and Q S0, and no node state is ever formed.
    i_n, i_h, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    o_t = tl.arange(0, BT)
    m_k, m_v, m_t = o_k < K, o_v < V, o_t < T_d
    tok = i_n.to(tl.int64) * T_d + o_t  # [BT] this sequence's tokens

    b_k = tl.load(
        k + tok[:, None] * stride_k_t + i_h * stride_k_h + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0
    ).to(tl.float32)  # [BT, BK]
    b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k, axis=1) + EPS)[:, None]
    b_q = tl.load(
        q + tok[:, None] * stride_q_t + i_h * stride_q_h + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0
    ).to(tl.float32)  # [BT, BK]
    b_q = b_q * (tl.rsqrt(tl.sum(b_q * b_q, axis=1) + EPS) * scale)[:, None]
    b_v = tl.load(
        v + tok[:, None] * stride_v_t + i_h * stride_v_h + o_v[None, :], mask=m_t[:, None] & m_v[None, :], other=0.0
    ).to(tl.float32)  # [BT, BV]
    b_g, b_beta = gates(
        tl.load(a + tok * stride_a_t + i_h, mask=m_t, other=0.0).to(tl.float32),
        tl.load(b + tok * stride_b_t + i_h, mask=m_t, other=0.0).to(tl.float32),
        tl.load(A_log + i_h),
        tl.load(dt_bias + i_h),
    )
    b_g = tl.where(m_t, b_g, 0.0)  # [BT]
    b_beta = tl.where(m_t, b_beta, 0.0)  # [BT]

    # path[j, m]: node m lies on node j's path (j included); walking up from every node at once takes T_d hops.
    parents = tree_parents + i_n.to(tl.int64) * T_d
    node = tl.where(m_t, o_t, -1)
    path = o_t[None, :] == node[:, None]  # [BT, BT]
    for _ in range(T_d):
        node = tl.load(parents + tl.maximum(node, 0), mask=node >= 0, other=-1)
        path = path | (o_t[None, :] == node[:, None])
    b_G = tl.sum(tl.where(path, b_g[None, :], 0.0), axis=1)  # [BT]
    b_decay = tl.where(path, tl.exp(tl.where(path, b_G[:, None] - b_G[None, :], 0.0)), 0.0)  # [BT, BT]

    slot = tl.load(state_indices + i_n).to(tl.int64)
    p_s = state + slot * stride_s + i_h * (K * V) + o_k[:, None] * V + o_v[None, :]
    b_s0 = tl.load(p_s, mask=m_k[:, None] & m_v[None, :], other=0.0)  # [BK, BV] fp32, read once
    b_ks = tl.dot(b_k, b_s0, input_precision="ieee")  # [BT, BV]
    b_qs = tl.dot(b_q, b_s0, input_precision="ieee")  # [BT, BV]
    b_kk = tl.dot(b_k, tl.trans(b_k), input_precision="ieee")  # [BT, BT]
    b_qk = tl.dot(b_q, tl.trans(b_k), input_precision="ieee")  # [BT, BT]

    # Errors in node order (a node's strict ancestors come before it): e_s = rhs_s - sum_r A[s, r] e_r.
    b_A = tl.where(o_t[:, None] != o_t[None, :], b_beta[:, None] * b_decay * b_kk, 0.0)  # [BT, BT]
    b_rhs = b_beta[:, None] * (b_v - tl.exp(b_G)[:, None] * b_ks)  # [BT, BV]
    b_e = tl.zeros([BT, BV], dtype=tl.float32)
    for s in range(T_d):
        is_s = o_t == s
        b_A_s = tl.sum(tl.where(is_s[:, None], b_A, 0.0), axis=0)  # [BT] row s
        b_e_s = tl.sum(tl.where(is_s[:, None], b_rhs, 0.0), axis=0) - tl.sum(b_A_s[:, None] * b_e, axis=0)  # [BV]
        b_e = tl.where(is_s[:, None], b_e_s[None, :], b_e)

    b_o = tl.exp(b_G)[:, None] * b_qs + tl.dot(b_decay * b_qk, b_e, input_precision="ieee")  # [BT, BV]
    p_o = o + (tok[:, None] * H + i_h) * V + o_v[None, :]
    tl.store(p_o, b_o.to(o.dtype.element_ty), mask=m_t[:, None] & m_v[None, :])


@triton.jit
def gated_delta_rule_commit_kernel(
    k,
    v,
    a,
    b,
    A_log,
    dt_bias,
    state,
    state_indices,
    accepted_nodes,
    num_accepted,
    stride_k_t,
    stride_k_h,
    stride_v_t,
    stride_v_h,
    stride_a_t,
    stride_b_t,
    stride_s,
    T_d,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    EPS: tl.constexpr,
):
    i_n, i_h, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    num = tl.load(num_accepted + i_n)
    if num > 0:
        o_k = tl.arange(0, BK)
        o_v = i_v * BV + tl.arange(0, BV)
        m_k, m_v = o_k < K, o_v < V
        m_s = m_k[:, None] & m_v[None, :]
        slot = tl.load(state_indices + i_n).to(tl.int64)
        p_s = state + slot * stride_s + i_h * (K * V) + o_k[:, None] * V + o_v[None, :]
        b_s = tl.load(p_s, mask=m_s, other=0.0)  # [BK, BV] fp32
        b_A_log, b_dt_bias = tl.load(A_log + i_h), tl.load(dt_bias + i_h)
        row = i_n.to(tl.int64) * T_d
        for d in range(num):
            t = row + tl.load(accepted_nodes + row + d)
            b_k = load_unit(k + t * stride_k_t + i_h * stride_k_h, o_k, m_k, EPS)
            b_v = tl.load(v + t * stride_v_t + i_h * stride_v_h + o_v, mask=m_v, other=0.0).to(tl.float32)
            b_g, b_beta = load_gates(a + t * stride_a_t + i_h, b + t * stride_b_t + i_h, b_A_log, b_dt_bias)
            b_s = delta_step(b_s, b_k, b_v, b_g, b_beta)
        tl.store(p_s, b_s, mask=m_s)


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
    block_v: int | None = None,
) -> torch.Tensor:
    """Draft-tree outputs without writing `state`: q, k `[T, H, K]`, v `[T, H, V]`, a, b `[T, H]` (raw), token
    `i*T_d + j` is node j of sequence i, tree_parents `[N, T_d]` int32 (-1 for node 0, else `parent < j`),
    state `[S, H, K, V]` fp32, state_indices `[N]`. Grid (N, H, V / block_v). Returns o `[T, H, V]` in `v.dtype`.
    """
    check_heads(q, k, v, a, b)
    check_state(state, k, v)
    check_gate_params(A_log, dt_bias, k)
    check_state_layout(state)
    N, T_d = check_tree(k, state_indices, tree_parents, "tree_parents")
    T, H, K = q.shape
    V = v.shape[-1]
    scale = K**-0.5 if scale is None else scale
    q, k, v, a, b = (unit_last_stride(x) for x in (q, k, v, a, b))
    BK, BV = block_sizes(K, V, block_v)
    o = torch.empty(T, H, V, dtype=v.dtype, device=v.device)
    if T == 0:
        return o
    gated_delta_rule_verify_kernel[(N, H, triton.cdiv(V, BV))](
        q,
        k,
        v,
        a,
        b,
        A_log,
        dt_bias,
        state,
        state_indices,
        tree_parents.to(torch.int32).contiguous(),
        o,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        a.stride(0),
        b.stride(0),
        state.stride(0),
        scale,
        T_d,
        H=H,
        K=K,
        V=V,
        BK=BK,
        BV=BV,
        BT=max(16, triton.next_power_of_2(T_d)),  # tl.dot needs 16 rows
        EPS=L2NORM_EPS,
        num_warps=4,
    )
    return o


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
    *,
    block_v: int | None = None,
) -> None:
    """Advance `state[state_indices[i]]` along nodes `accepted_nodes[i, :num_accepted[i]]` (root first) of the verify
    step's k `[T, H, K]`, v `[T, H, V]`, a, b `[T, H]`; the slot is written once, and not at all when
    `num_accepted[i] = 0`. Grid (N, H, V / block_v)."""
    check_heads(None, k, v, a, b)
    check_state(state, k, v)
    check_gate_params(A_log, dt_bias, k)
    check_state_layout(state)
    N, T_d = check_tree(k, state_indices, accepted_nodes, "accepted_nodes")
    if num_accepted.shape != (N,):
        raise ValueError(f"gated_delta_rule_commit: num_accepted {tuple(num_accepted.shape)} must be [{N}]")
    K, V = k.shape[-1], v.shape[-1]
    k, v, a, b = (unit_last_stride(x) for x in (k, v, a, b))
    BK, BV = block_sizes(K, V, block_v)
    if N == 0:
        return
    gated_delta_rule_commit_kernel[(N, k.shape[1], triton.cdiv(V, BV))](
        k,
        v,
        a,
        b,
        A_log,
        dt_bias,
        state,
        state_indices,
        accepted_nodes.to(torch.int32).contiguous(),
        num_accepted.to(torch.int32).contiguous(),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        a.stride(0),
        b.stride(0),
        state.stride(0),
        T_d,
        K=K,
        V=V,
        BK=BK,
        BV=BV,
        EPS=L2NORM_EPS,
        num_warps=4,
    )
