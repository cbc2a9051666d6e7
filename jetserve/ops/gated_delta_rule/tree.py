"""Tree verify and commit in Triton; the state is read once per program, and verify never writes it.

Verify is one kernel with two bodies. A chain's walks its nodes in order, extending one running state tile on chip. A
tree's does all of its nodes at once, in the chunked delta rule's form with the ancestor mask for the causal one: no
node's state is formed, and the work is tensor-core products on `[T_d, K]` and `[K, BV]` tiles. Commit replays the
accepted path and writes the state once. Together verify and commit move 1.5x a decode step's state bytes."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from jetserve.ops.backend import sm_count
from jetserve.ops.dynamic_conv.commit import window_after_commit
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
    unit,
    unit_last_stride,
)
from jetserve.ops.layout import dense

# Tiles of the chain verify and commit kernels, one warp a program: a node's reductions over K then stay inside a warp
# (no barrier between the warps of a program on each of a node's four), which is what bounds these kernels — each
# program walks its nodes one after the other. H200, 2B shape (H 12, K 96, V 256), bf16, 24 layers of state pools from
# HBM in one CUDA graph (session 26), µs a layer, 4 warps and 32-wide tiles before: chain 6 verify 13.6 → 5.6 at batch
# 1, 50.7 → 18.8 at 16, 201.6 → 59.5 at 64; commit of 4 nodes 5.7 → 3.7, 21.1 → 16.9, 68.9 → 53.4. Chain tiles narrow
# (32, 16, 8 columns of V) until a launch has CHAIN_PROGRAMS_PER_SM programs an SM.
CHAIN_PROGRAMS_PER_SM = 2
COMMIT_NARROW_PROGRAMS_PER_SM = 2  # fewer 32-wide programs than this an SM: 16-wide tiles
COMMIT_WIDE_PROGRAMS_PER_SM = 16  # more 32-wide programs than this an SM: 64-wide tiles of 4 warps (the state's bytes
# bound it there: at batch 64, 53.4 µs against 57.1 for 32-wide tiles of one warp)
# The tree body's tiles: 32 columns of V, 4 warps while a launch has fewer than TREE_WIDE_PROGRAMS_PER_SM programs an
# SM, else 2. Session 38 (same method), µs a layer, the path-replaying walk it replaced → this kernel: a tree of 8
# (topk 2, 3 steps) 14.4 → 9.4 at batch 1 (4 warps; 11.4 at 2), 63.4 → 50.6 at 16, 215.7 → 181.1 at 64 (2 warps; 68.2
# and 265.4 at 4); of 16 nodes 39.9 → 11.1, 169.2 → 57.4, 571.8 → 209.5. Chains stay on the walk: 5.2 against 8.5,
# 18.9 against 50.2, 59.5 against 183.3.
TREE_BLOCK_V = 32
TREE_WIDE_PROGRAMS_PER_SM = 2


def chain_tiles(num_pairs: int, V: int, num_sms: int) -> tuple[int, int]:
    """(BV, warps) of a chain verify launch over `num_pairs` sequence x head pairs."""
    for bv in (32, 16):
        if num_pairs * triton.cdiv(V, bv) >= CHAIN_PROGRAMS_PER_SM * num_sms:
            return min(bv, triton.next_power_of_2(V)), 1
    return min(8, triton.next_power_of_2(V)), 1


def tree_tiles(num_pairs: int, V: int, num_sms: int) -> tuple[int, int]:
    """(BV, warps) of a tree verify launch over `num_pairs` sequence x head pairs (BV at least 16: tl.dot's least)."""
    BV = max(16, min(TREE_BLOCK_V, triton.next_power_of_2(V)))
    return BV, 4 if num_pairs * triton.cdiv(V, BV) < TREE_WIDE_PROGRAMS_PER_SM * num_sms else 2


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
    CHAIN: tl.constexpr,  # every row is a chain (parent j - 1): the chain body, tree_parents not read
):
    """The chain body (CHAIN): b_run, the state after node j - 1 (the committed state before node 0), is extended by
    one step a node, and node j+1's inputs are loaded while node j's step runs (they do not depend on the state).

    The tree body: all of a tree's nodes at once. Along node m's path, with G_m the sum of g over it (m included)
    and e_m = β_m (v_m − e^{g_m} S_parentᵀ k_m) its step's correction: S_m = e^{G_m} S0 + Σ_{a on m's path}
    e^{G_m − G_a} k_a e_aᵀ. So the corrections solve (I + A) E = β (V − e^G K S0), A[m, a] = β_m e^{G_m − G_a}
    k_m·k_a over m's strict ancestors a (strictly lower triangular: parents precede children), and
    o = e^G Q S0 + (P ⊙ e^{G_j − G_a} ⊙ Q Kᵀ) E with P[j, a] = a is j or an ancestor of j. Products are tl.dot in
    tf32x3 (fp32-accurate on tensor cores: plain tf32 measured 4e-3 of the largest output against 7e-5)."""
    i_n, i_h, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    t0 = i_n.to(tl.int64) * T_d  # this sequence's first token
    slot = tl.load(state_indices + i_n).to(tl.int64)
    p_s = state + slot * stride_s + i_h * (K * V) + o_k[:, None] * V + o_v[None, :]
    b_A_log, b_dt_bias = tl.load(A_log + i_h), tl.load(dt_bias + i_h)
    if CHAIN:
        b_run = tl.load(p_s, mask=m_k[:, None] & m_v[None, :], other=0.0)  # [BK, BV] fp32, the committed state
        b_k1, b_q1, b_v1, b_a1, b_b1 = _node_inputs(q, k, v, a, b, t0, i_h, stride_q_t, stride_q_h, stride_k_t,
                                                    stride_k_h, stride_v_t, stride_v_h, stride_a_t, stride_b_t, o_k,
                                                    m_k, o_v, m_v, True)  # fmt: skip
        for j in range(T_d):
            b_k, b_q, b_v, b_a, b_b = b_k1, b_q1, b_v1, b_a1, b_b1
            t = t0 + j
            b_k1, b_q1, b_v1, b_a1, b_b1 = _node_inputs(q, k, v, a, b, t0 + tl.minimum(j + 1, T_d - 1), i_h,
                                                        stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_v_t,
                                                        stride_v_h, stride_a_t, stride_b_t, o_k, m_k, o_v, m_v,
                                                        True)  # fmt: skip
            b_k = unit(b_k, EPS)
            b_q = unit(b_q, EPS) * scale
            b_g, b_beta = gates(b_a, b_b, b_A_log, b_dt_bias)
            b_run = delta_step(b_run, b_k, b_v, b_g, b_beta)
            b_o = tl.sum(b_run * b_q[:, None], axis=0)  # [BV]
            tl.store(o + (t * H + i_h) * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)
    else:
        o_t = tl.arange(0, BT)
        m_t = o_t < T_d
        rows = t0 + o_t  # [BT]

        m_tk = m_t[:, None] & m_k[None, :]
        b_k = tl.load(k + rows[:, None] * stride_k_t + i_h * stride_k_h + o_k[None, :], mask=m_tk, other=0.0)
        b_k = b_k.to(tl.float32)
        b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k, axis=1) + EPS)[:, None]  # [BT, BK]
        b_q = tl.load(q + rows[:, None] * stride_q_t + i_h * stride_q_h + o_k[None, :], mask=m_tk, other=0.0)
        b_q = b_q.to(tl.float32)
        b_q = b_q * (tl.rsqrt(tl.sum(b_q * b_q, axis=1) + EPS) * scale)[:, None]  # [BT, BK]
        m_tv = m_t[:, None] & m_v[None, :]
        b_v = tl.load(v + rows[:, None] * stride_v_t + i_h * stride_v_h + o_v[None, :], mask=m_tv, other=0.0)
        b_v = b_v.to(tl.float32)  # [BT, BV]
        b_a = tl.load(a + rows * stride_a_t + i_h, mask=m_t, other=0.0).to(tl.float32)
        b_b = tl.load(b + rows * stride_b_t + i_h, mask=m_t, other=0.0).to(tl.float32)
        b_g, b_beta = gates(b_a, b_b, b_A_log, b_dt_bias)  # [BT] each

        # path[j, m]: m is j or an ancestor of j. All nodes walk up together: T_d hops of one vector load each.
        parents = tree_parents + t0
        node = tl.where(m_t, o_t, -1)
        path = o_t[None, :] == node[:, None]  # [BT, BT]
        for _ in range(T_d):
            node = tl.load(parents + tl.maximum(node, 0), mask=node >= 0, other=-1)
            path = path | (o_t[None, :] == node[:, None])
        b_G = tl.sum(tl.where(path, b_g[None, :], 0.0), axis=1)  # [BT]
        b_decay = tl.where(path, tl.exp(b_G[:, None] - b_G[None, :]), 0.0)  # [BT, BT]: e^{G_j − G_a} along j's path
        eye = o_t[:, None] == o_t[None, :]
        b_kk = tl.dot(b_k, tl.trans(b_k), input_precision="tf32x3")  # [BT, BT]
        b_A = tl.where(path & ~eye, b_beta[:, None] * b_decay * b_kk, 0.0)
        # (I + A)⁻¹ by forward substitution, row m from the rows above it (stable where the series Σ (−A)^i in products
        # of squares cancels terms as large as binomial coefficients on deep paths of A entries near 1)
        b_inv = tl.where(eye, 1.0, 0.0)  # [BT, BT]
        for m in range(1, T_d):
            b_row = tl.sum(tl.where(o_t[:, None] == m, b_A, 0.0), axis=0)  # [BT]: A[m, :]
            b_inv = tl.where(o_t[:, None] == m, b_inv - tl.sum(b_row[:, None] * b_inv, axis=0)[None, :], b_inv)
        b_eG = tl.exp(b_G)
        b_qkd = b_decay * tl.dot(b_q, tl.trans(b_k), input_precision="tf32x3")  # [BT, BT]

        b_s0 = tl.load(p_s, mask=m_k[:, None] & m_v[None, :], other=0.0)  # [BK, BV] fp32, the committed state
        b_ks = tl.dot(b_k, b_s0, input_precision="tf32x3")  # [BT, BV]
        b_qs = tl.dot(b_q, b_s0, input_precision="tf32x3")  # [BT, BV]
        b_e = tl.dot(b_inv, b_beta[:, None] * (b_v - b_eG[:, None] * b_ks), input_precision="tf32x3")  # [BT, BV]
        b_o = b_eG[:, None] * b_qs + tl.dot(b_qkd, b_e, input_precision="tf32x3")  # [BT, BV]
        tl.store(o + (rows[:, None] * H + i_h) * V + o_v[None, :], b_o.to(o.dtype.element_ty), mask=m_tv)


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
    u,  # CONV: [N*T_d, H*V], the conv's raw inputs of the verify step
    conv_state,  # CONV: [S, W-1, H*V], the conv windows
    stride_u,
    stride_c_slot,
    stride_c_row,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    EPS: tl.constexpr,
    CONV: tl.constexpr = False,  # also shift the conv window of this program's channels (head i_h, its V tile)
    W: tl.constexpr = 1,  # CONV: the conv's width
    WP: tl.constexpr = 1,  # CONV: next power of two >= W-1
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
        if CONV:  # the conv's new window of the value channels this program's V tile covers, read before the walk
            p_win = conv_state + slot * stride_c_slot + (i_h * V + o_v)[None, :]
            b_win = window_after_commit(u, p_win, accepted_nodes + row, row, num, i_h * V + o_v, m_v, stride_u,
                                        stride_c_row, W, WP)  # fmt: skip
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
        if CONV:
            tl.debug_barrier()  # every thread's window loads done before any row is overwritten
            o_r = tl.arange(0, WP)
            tl.store(p_win + o_r[:, None] * stride_c_row, b_win, mask=(o_r < W - 1)[:, None] & m_v[None, :])


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
) -> torch.Tensor:
    """Draft-tree outputs without writing `state`: q, k `[T, H, K]`, v `[T, H, V]`, a, b `[T, H]` (raw), token
    `i*T_d + j` is node j of sequence i, tree_parents `[N, T_d]` int32 (-1 for node 0, else `parent < j`),
    state `[S, H, K, V]` fp32, state_indices `[N]`. `is_chain`: the caller's promise that every row is a chain
    (parent j - 1), which the chain body then takes without reading tree_parents; else the tree body. Grid
    (N, H, V / block_v); block_v and num_warps default to `chain_tiles` or `tree_tiles` (the tree body's block_v is
    at least 16). Returns o `[T, H, V]` in `v.dtype`.
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
    BK = max(16, triton.next_power_of_2(K))  # the whole of K: the l2 norm needs the whole vector
    BV, warps = (chain_tiles if is_chain else tree_tiles)(N * H, V, sm_count(q.device))
    BV, warps = block_v or BV, num_warps or warps
    o = torch.empty(T, H, V, dtype=v.dtype, device=v.device)
    if T == 0:
        return o
    strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), a.stride(0), b.stride(0),
               state.stride(0))  # fmt: skip
    if not is_chain:
        BV = max(16, BV)  # tl.dot's least, for a caller's block_v too
    BT = max(16, triton.next_power_of_2(T_d))
    gated_delta_rule_verify_kernel[(N, H, triton.cdiv(V, BV))](
        q, k, v, a, b, A_log, dt_bias, state, state_indices, tree_parents.to(torch.int32).contiguous(), o, *strides,
        scale, T_d, H=H, K=K, V=V, BK=BK, BV=BV, BT=BT, EPS=L2NORM_EPS, CHAIN=is_chain, num_warps=warps,
    )  # fmt: skip
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
    conv: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Advance `state[state_indices[i]]` along nodes `accepted_nodes[i, :num_accepted[i]]` (root first) of the verify
    step's k `[T, H, K]`, v `[T, H, V]`, a, b `[T, H]`; the slot is written once, and not at all when
    `num_accepted[i] = 0`. Grid (N, H, V / block_v); block_v and num_warps default to `commit_tiles`. `conv` = (u
    `[T, H*V]`, conv_state `[S, W-1, H*V]`, validated by the caller: `jet_mixer_commit`): the same launch also does
    `dynamic_conv_commit(u, conv_state, ...)`, each program the window of the channels its head and V tile cover."""
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
    if conv is None:
        u, conv_state, conv_args = k, state, dict(CONV=False)  # unused
    else:
        u, conv_state = unit_last_stride(conv[0]), conv[1]
        width = conv_state.shape[1] + 1
        conv_args = dict(CONV=True, W=width, WP=triton.next_power_of_2(width - 1))
    gated_delta_rule_commit_kernel[(N, k.shape[1], triton.cdiv(V, BV))](
        k, v, a, b, A_log, dt_bias, state, state_indices, accepted_nodes.to(torch.int32).contiguous(),
        num_accepted.to(torch.int32).contiguous(), k.stride(0), k.stride(1), v.stride(0), v.stride(1), a.stride(0),
        b.stride(0), state.stride(0), T_d, u, conv_state, u.stride(0), conv_state.stride(0), conv_state.stride(1),
        K=K, V=V, BK=BK, BV=BV, EPS=L2NORM_EPS, num_warps=warps, **conv_args,
    )  # fmt: skip
