"""Tree verify and commit in Triton. Verify replays each draft node's ancestry path from the committed state on chip
(the state is read once per program and never written, no per-node state reaches memory); commit replays the accepted
path and writes the state once. Together they move 1.5x a decode step's state bytes."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from jetserve.ops.backend import sm_count
from jetserve.ops.gated_delta_rule.reference import (
    L2NORM_EPS,
    check_gate_params,
    check_heads,
    check_state,
    check_tree,
)
from jetserve.ops.gated_delta_rule.step import (
    check_state_layout,
    delta_step,
    gates,
    token_step,
    unit,
    unit_last_stride,
)
from jetserve.ops.layout import dense

# Tiles of the verify and commit kernels, one warp a program: a node's reductions over K then stay inside a warp (no
# barrier between the warps of a program on each of a node's four), which is what bounds these kernels — each program
# walks its nodes one after the other. H200, 2B shape (H 12, K 96, V 256), bf16, 24 layers of state pools from HBM in
# one CUDA graph (session 26), µs a layer, 4 warps and 32-wide tiles before: chain 6 verify 13.6 → 5.6 at batch 1, 50.7
# → 18.8 at 16, 201.6 → 59.5 at 64; tree 8 27.2 → 14.8, 107.2 → 62.7, 422.3 → 216.0; commit of 4 nodes 5.7 → 3.7,
# 21.1 → 16.9, 68.9 → 53.4. Tiles narrow (32, 16, 8 columns of V) until a verify launch has this many programs an
# SM: a tree's path replays are longer walks, which more programs in flight hide.
VERIFY_PROGRAMS_PER_SM = {True: 2, False: 16}  # is_chain → programs an SM
COMMIT_NARROW_PROGRAMS_PER_SM = 2  # fewer 32-wide programs than this an SM: 16-wide tiles
COMMIT_WIDE_PROGRAMS_PER_SM = 16  # more 32-wide programs than this an SM: 64-wide tiles of 4 warps (the state's bytes
# bound it there: at batch 64, 53.4 µs against 57.1 for 32-wide tiles of one warp)


def verify_tiles(num_pairs: int, V: int, is_chain: bool, num_sms: int) -> tuple[int, int]:
    """(BV, warps) of a verify launch over `num_pairs` sequence x head pairs."""
    for bv in (32, 16):
        if num_pairs * triton.cdiv(V, bv) >= VERIFY_PROGRAMS_PER_SM[is_chain] * num_sms:
            return min(bv, triton.next_power_of_2(V)), 1
    return min(8, triton.next_power_of_2(V)), 1


def commit_tiles(num_pairs: int, V: int, num_sms: int) -> tuple[int, int]:
    """(BV, warps) of a commit launch over `num_pairs` sequence x head pairs."""
    programs = num_pairs * triton.cdiv(V, 32)
    if programs < COMMIT_NARROW_PROGRAMS_PER_SM * num_sms:
        return min(16, triton.next_power_of_2(V)), 1
    if programs > COMMIT_WIDE_PROGRAMS_PER_SM * num_sms:
        return min(64, triton.next_power_of_2(V)), 4
    return min(32, triton.next_power_of_2(V)), 1


@triton.jit
def _node_inputs(q, k, v, a, b, t, i_h, stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_v_t, stride_v_h,
                 stride_a_t, stride_b_t, o_k, m_k, o_v, m_v, HAS_Q: tl.constexpr):  # fmt: skip
    """Packed token t's raw inputs for head i_h in fp32: k (and q) `[BK]`, the v tile `[BV]`, a and b."""
    b_k = tl.load(k + t * stride_k_t + i_h * stride_k_h + o_k, mask=m_k, other=0.0).to(tl.float32)
    b_q = b_k
    if HAS_Q:
        b_q = tl.load(q + t * stride_q_t + i_h * stride_q_h + o_k, mask=m_k, other=0.0).to(tl.float32)
    b_v = tl.load(v + t * stride_v_t + i_h * stride_v_h + o_v, mask=m_v, other=0.0).to(tl.float32)
    b_a = tl.load(a + t * stride_a_t + i_h).to(tl.float32)
    return b_k, b_q, b_v, b_a, tl.load(b + t * stride_b_t + i_h).to(tl.float32)


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
    CHAIN: tl.constexpr,  # every row is a chain (parent j - 1): tree_parents is not read
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

    if not CHAIN:
        # path[j, m] = 1 where node m lies on node j's path (j included). All nodes walk up together: T_d hops of
        # one vector load each, instead of a chain of dependent scalar loads per node.
        node = tl.where(o_t < T_d, o_t, -1)
        path = tl.where(o_t[None, :] == node[:, None], 1, 0)  # [BT, BT] int32
        for _ in range(T_d):
            node = tl.load(parents + tl.maximum(node, 0), mask=node >= 0, other=-1)
            path = tl.where(o_t[None, :] == node[:, None], 1, path)

    # b_run holds the state after node j-1 (the committed state before node 0). A node whose parent is j-1 — every
    # node of a chain — extends it by one step; any other node replays its ancestors from the committed state, then
    # takes its own step. Node j+1's inputs are loaded while node j's step runs (they do not depend on the state).
    b_k1, b_q1, b_v1, b_a1, b_b1 = _node_inputs(q, k, v, a, b, t0, i_h, stride_q_t, stride_q_h, stride_k_t,
                                                stride_k_h, stride_v_t, stride_v_h, stride_a_t, stride_b_t, o_k, m_k,
                                                o_v, m_v, True)  # fmt: skip
    parent1 = -1
    b_run = b_s0
    for j in range(T_d):
        b_k, b_q, b_v, b_a, b_b, parent = b_k1, b_q1, b_v1, b_a1, b_b1, parent1
        t = t0 + j
        nxt = tl.minimum(j + 1, T_d - 1)
        b_k1, b_q1, b_v1, b_a1, b_b1 = _node_inputs(q, k, v, a, b, t0 + nxt, i_h, stride_q_t, stride_q_h,
                                                    stride_k_t, stride_k_h, stride_v_t, stride_v_h, stride_a_t,
                                                    stride_b_t, o_k, m_k, o_v, m_v, True)  # fmt: skip
        if not CHAIN:
            parent1 = tl.load(parents + nxt)
        b_k = unit(b_k, EPS)
        b_q = unit(b_q, EPS) * scale
        b_g, b_beta = gates(b_a, b_b, b_A_log, b_dt_bias)
        if CHAIN:
            b_s = delta_step(b_run, b_k, b_v, b_g, b_beta)
        elif parent == j - 1:
            b_s = delta_step(b_run, b_k, b_v, b_g, b_beta)
        else:
            b_path = tl.sum(tl.where(o_t[:, None] == j, path, 0), axis=0)  # [BT] row j
            # Parents precede children, so ascending node order along the path is root-first order.
            b_s = b_s0
            for m in range(j):
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
            b_s = delta_step(b_s, b_k, b_v, b_g, b_beta)
        b_run = b_s
        b_o = tl.sum(b_s * b_q[:, None], axis=0)  # [BV]
        tl.store(o + (t * H + i_h) * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)


@triton.jit
def gated_delta_rule_verify_solve_kernel(
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
    CHAIN: tl.constexpr,  # every row is a chain (parent j - 1): tree_parents is not read
    PRECISION: tl.constexpr,  # tl.dot's input_precision
):
    """All of a tree's nodes at once, as the chunked delta rule does a chunk's tokens, with the ancestor mask for the
    causal one. Along node m's path, with G_m the sum of g over it (m included) and e_m = β_m (v_m − S_parentᵀ k_m):
    S_m = e^{G_m} S0 + Σ_{a on m's path} e^{G_m − G_a} k_a e_aᵀ, so the e solve (I + A) E = β (V − e^G K S0), A[m, a]
    = β_m e^{G_m − G_a} k_m·k_a over m's strict ancestors a (lower triangular: parents precede children), and
    o = e^G Q S0 + (P ⊙ e^{G_j − G_a} ⊙ Q Kᵀ) E with P the ancestor-or-self mask. No node's state is formed."""
    i_n, i_h, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    o_t = tl.arange(0, BT)
    m_k, m_v, m_t = o_k < K, o_v < V, o_t < T_d
    t0 = i_n.to(tl.int64) * T_d  # this sequence's first token
    rows = t0 + o_t  # [BT]

    m_tk = m_t[:, None] & m_k[None, :]
    b_k = tl.load(k + rows[:, None] * stride_k_t + i_h * stride_k_h + o_k[None, :], mask=m_tk, other=0.0)
    b_k = b_k.to(tl.float32)
    b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k, axis=1) + EPS)[:, None]  # [BT, BK]
    b_q = tl.load(q + rows[:, None] * stride_q_t + i_h * stride_q_h + o_k[None, :], mask=m_tk, other=0.0)
    b_q = b_q.to(tl.float32)
    b_q = b_q * (tl.rsqrt(tl.sum(b_q * b_q, axis=1) + EPS) * scale)[:, None]  # [BT, BK]
    b_v = tl.load(v + rows[:, None] * stride_v_t + i_h * stride_v_h + o_v[None, :],
                  mask=m_t[:, None] & m_v[None, :], other=0.0).to(tl.float32)  # fmt: skip
    b_a = tl.load(a + rows * stride_a_t + i_h, mask=m_t, other=0.0).to(tl.float32)
    b_b = tl.load(b + rows * stride_b_t + i_h, mask=m_t, other=0.0).to(tl.float32)
    b_g, b_beta = gates(b_a, b_b, tl.load(A_log + i_h), tl.load(dt_bias + i_h))  # [BT] each
    b_g = tl.where(m_t, b_g, 0.0)
    b_beta = tl.where(m_t, b_beta, 0.0)

    if CHAIN:
        path = (o_t[None, :] <= o_t[:, None]) & m_t[:, None]  # [BT, BT]: path[j, m], m on j's path
    else:
        # All nodes walk up together: T_d hops of one vector load each.
        parents = tree_parents + t0
        node = tl.where(m_t, o_t, -1)
        path = o_t[None, :] == node[:, None]
        for _ in range(T_d):
            node = tl.load(parents + tl.maximum(node, 0), mask=node >= 0, other=-1)
            path = path | (o_t[None, :] == node[:, None])
    b_G = tl.sum(tl.where(path, b_g[None, :], 0.0), axis=1)  # [BT]
    b_decay = tl.where(path, tl.exp(b_G[:, None] - b_G[None, :]), 0.0)  # [BT, BT]: e^{G_j − G_a} on j's path

    strict = path & (o_t[None, :] != o_t[:, None])
    b_kk = tl.dot(b_k, tl.trans(b_k), input_precision=PRECISION)  # [BT, BT]
    b_A = tl.where(strict, b_beta[:, None] * b_decay * b_kk, 0.0)
    # (I + A)⁻¹ by forward substitution, row m from the rows above it
    b_inv = tl.where(o_t[:, None] == o_t[None, :], 1.0, 0.0)  # [BT, BT]
    for m in range(1, T_d):
        b_row = tl.sum(tl.where(o_t[:, None] == m, b_A, 0.0), axis=0)  # [BT]: A[m, :]
        b_new = -tl.sum(b_row[:, None] * b_inv, axis=0)  # [BT]
        b_inv = tl.where(o_t[:, None] == m, b_inv + b_new[None, :], b_inv)

    slot = tl.load(state_indices + i_n).to(tl.int64)
    p_s = state + slot * stride_s + i_h * (K * V) + o_k[:, None] * V + o_v[None, :]
    b_s0 = tl.load(p_s, mask=m_k[:, None] & m_v[None, :], other=0.0)  # [BK, BV] fp32, the committed state
    b_ks = tl.dot(b_k, b_s0, input_precision=PRECISION)  # [BT, BV]
    b_qs = tl.dot(b_q, b_s0, input_precision=PRECISION)  # [BT, BV]
    b_eG = tl.exp(b_G)
    b_rhs = b_beta[:, None] * (b_v - b_eG[:, None] * b_ks)  # [BT, BV]
    b_e = tl.dot(b_inv, b_rhs, input_precision=PRECISION)  # [BT, BV]
    b_qk = tl.dot(b_q, tl.trans(b_k), input_precision=PRECISION)  # [BT, BT]
    b_o = b_eG[:, None] * b_qs + tl.dot(b_decay * b_qk, b_e, input_precision=PRECISION)  # [BT, BV]
    tl.store(o + (rows[:, None] * H + i_h) * V + o_v[None, :], b_o.to(o.dtype.element_ty),
             mask=m_t[:, None] & m_v[None, :])  # fmt: skip


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
        row = i_n.to(tl.int64) * T_d
        # the path's next node's inputs are loaded while this node's step runs
        b_k1, _, b_v1, b_a1, b_b1 = _node_inputs(k, k, v, a, b, row + tl.load(accepted_nodes + row), i_h, 0, 0,
                                                 stride_k_t, stride_k_h, stride_v_t, stride_v_h, stride_a_t,
                                                 stride_b_t, o_k, m_k, o_v, m_v, False)  # fmt: skip
        b_s = tl.load(p_s, mask=m_s, other=0.0)  # [BK, BV] fp32
        b_A_log, b_dt_bias = tl.load(A_log + i_h), tl.load(dt_bias + i_h)
        for d in range(num):
            b_k, b_v, b_a, b_b = b_k1, b_v1, b_a1, b_b1
            t = row + tl.load(accepted_nodes + row + tl.minimum(d + 1, num - 1))
            b_k1, _, b_v1, b_a1, b_b1 = _node_inputs(k, k, v, a, b, t, i_h, 0, 0, stride_k_t, stride_k_h,
                                                     stride_v_t, stride_v_h, stride_a_t, stride_b_t, o_k, m_k, o_v,
                                                     m_v, False)  # fmt: skip
            b_k = unit(b_k, EPS)
            b_g, b_beta = gates(b_a, b_b, b_A_log, b_dt_bias)
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
    is_chain: bool = False,
    block_v: int | None = None,
    num_warps: int | None = None,
    form: str = "walk",
    precision: str = "ieee",
) -> torch.Tensor:
    """Draft-tree outputs without writing `state`: q, k `[T, H, K]`, v `[T, H, V]`, a, b `[T, H]` (raw), token
    `i*T_d + j` is node j of sequence i, tree_parents `[N, T_d]` int32 (-1 for node 0, else `parent < j`),
    state `[S, H, K, V]` fp32, state_indices `[N]`. `is_chain`: the caller's promise that every row is a chain
    (parent j - 1), which the kernel then takes without reading tree_parents. Grid (N, H, V / block_v); block_v
    and num_warps default to `verify_tiles`. Returns o `[T, H, V]` in `v.dtype`.
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
    BK = triton.next_power_of_2(K)  # the whole of K: the l2 norm needs the whole vector
    BV, warps = verify_tiles(N * H, V, is_chain, sm_count(q.device))
    BV, warps = block_v or BV, num_warps or warps
    o = torch.empty(T, H, V, dtype=v.dtype, device=v.device)
    if T == 0:
        return o
    if form == "solve":
        BV = max(16, block_v or min(32, triton.next_power_of_2(V)))
        gated_delta_rule_verify_solve_kernel[(N, H, triton.cdiv(V, BV))](
            q, k, v, a, b, A_log, dt_bias, state, state_indices, tree_parents.to(torch.int32).contiguous(), o,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), a.stride(0), b.stride(0),
            state.stride(0), scale, T_d, H=H, K=K, V=V, BK=max(16, BK), BV=BV,
            BT=max(16, triton.next_power_of_2(T_d)), EPS=L2NORM_EPS, CHAIN=is_chain, PRECISION=precision,
            num_warps=num_warps or 4,
        )  # fmt: skip
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
        CHAIN=is_chain,
        num_warps=warps,
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
    num_warps: int | None = None,
) -> None:
    """Advance `state[state_indices[i]]` along nodes `accepted_nodes[i, :num_accepted[i]]` (root first) of the verify
    step's k `[T, H, K]`, v `[T, H, V]`, a, b `[T, H]`; the slot is written once, and not at all when
    `num_accepted[i] = 0`. Grid (N, H, V / block_v); block_v and num_warps default to `commit_tiles`."""
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
    BK = triton.next_power_of_2(K)
    BV, warps = commit_tiles(N * k.shape[1], V, sm_count(k.device))
    BV, warps = block_v or BV, num_warps or warps
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
        num_warps=warps,
    )
