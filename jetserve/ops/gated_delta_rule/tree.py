"""Tree verify and commit in Triton. Verify replays each draft node's ancestry path from the committed state on chip
(the state is read once per program and never written, no per-node state reaches memory); commit replays the accepted
path and writes the state once. Together they move 1.5x a decode step's state bytes."""

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
    load_unit,
    token_step,
    unit_last_stride,
)
from jetserve.ops.layout import dense


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
    i_n, i_h, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    o_t = tl.arange(0, BT)
    m_k, m_v = o_k < K, o_v < V

    slot = tl.load(state_indices + i_n).to(tl.int64)
    p_s = state + slot * stride_s + i_h * (K * V) + o_k[:, None] * V + o_v[None, :]
    b_s0 = tl.load(p_s, mask=m_k[:, None] & m_v[None, :], other=0.0)  # [BK, BV] fp32, the committed state
    b_A_log, b_dt_bias = tl.load(A_log + i_h), tl.load(dt_bias + i_h)
    parents = tree_parents + i_n.to(tl.int64) * T_d
    t0 = i_n.to(tl.int64) * T_d  # this sequence's first token

    # path[j, m] = 1 where node m lies on node j's path (j included). All nodes walk up together: T_d hops of one
    # vector load each, instead of a chain of dependent scalar loads per node.
    node = tl.where(o_t < T_d, o_t, -1)
    path = tl.where(o_t[None, :] == node[:, None], 1, 0)  # [BT, BT] int32
    for _ in range(T_d):
        node = tl.load(parents + tl.maximum(node, 0), mask=node >= 0, other=-1)
        path = tl.where(o_t[None, :] == node[:, None], 1, path)

    # b_run holds the state after node j-1 (the committed state before node 0). A node whose parent is j-1 — every
    # node of a chain — extends it by one step; any other node replays its path from the committed state. A chain of
    # T_d nodes thus costs T_d steps instead of T_d (T_d + 1) / 2.
    b_run = b_s0
    for j in range(T_d):
        if tl.load(parents + j) == j - 1:
            b_s = token_step(
                b_run,
                t0 + j,
                k,
                v,
                a,
                b,
                stride_k_t,
                stride_k_h,
                stride_v_t,
                stride_v_h,
                stride_a_t,
                stride_b_t,
                i_h,
                o_k,
                m_k,
                o_v,
                m_v,
                b_A_log,
                b_dt_bias,
                EPS,
            )
        else:
            b_path = tl.sum(tl.where(o_t[:, None] == j, path, 0), axis=0)  # [BT] row j
            # Parents precede children, so ascending node order along the path is root-first order.
            b_s = b_s0
            for m in range(j + 1):
                if tl.sum(tl.where(o_t == m, b_path, 0)) > 0:
                    b_s = token_step(
                        b_s,
                        t0 + m,
                        k,
                        v,
                        a,
                        b,
                        stride_k_t,
                        stride_k_h,
                        stride_v_t,
                        stride_v_h,
                        stride_a_t,
                        stride_b_t,
                        i_h,
                        o_k,
                        m_k,
                        o_v,
                        m_v,
                        b_A_log,
                        b_dt_bias,
                        EPS,
                    )
        b_run = b_s
        t = t0 + j
        b_q = load_unit(q + t * stride_q_t + i_h * stride_q_h, o_k, m_k, EPS) * scale
        b_o = tl.sum(b_s * b_q[:, None], axis=0)  # [BV]
        tl.store(o + (t * H + i_h) * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)


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
            b_s = token_step(
                b_s,
                t,
                k,
                v,
                a,
                b,
                stride_k_t,
                stride_k_h,
                stride_v_t,
                stride_v_h,
                stride_a_t,
                stride_b_t,
                i_h,
                o_k,
                m_k,
                o_v,
                m_v,
                b_A_log,
                b_dt_bias,
                EPS,
            )
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
    (state_indices,) = dense(state_indices)
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
        BT=max(16, triton.next_power_of_2(T_d)),
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
    (state_indices,) = dense(state_indices)
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
