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
BRANCH_REGISTERS = 128  # fp32 registers a thread for the branch states of a tree verify program
MAX_BRANCH_SLOTS = 8
COMMIT_NARROW_PROGRAMS_PER_SM = 2  # fewer 32-wide programs than this an SM: 16-wide tiles
COMMIT_WIDE_PROGRAMS_PER_SM = 16  # more 32-wide programs than this an SM: 64-wide tiles of 4 warps (the state's bytes
# bound it there: at batch 64, 53.4 µs against 57.1 for 32-wide tiles of one warp)


def verify_tiles(num_pairs: int, V: int, is_chain: bool, num_sms: int) -> tuple[int, int]:
    """(BV, warps) of a verify launch over `num_pairs` sequence x head pairs."""
    for bv in (32, 16):
        if num_pairs * triton.cdiv(V, bv) >= VERIFY_PROGRAMS_PER_SM[is_chain] * num_sms:
            return min(bv, triton.next_power_of_2(V)), 1
    return min(8, triton.next_power_of_2(V)), 1


def branch_slots(BK: int, BV: int, warps: int) -> int:
    """How many branching nodes' states a tree verify program keeps (`SLOTS`): the most `[BK, BV]` fp32 tiles that
    fit BRANCH_REGISTERS registers a thread, as a power of two from 1 to MAX_BRANCH_SLOTS."""
    fits = max(1, BRANCH_REGISTERS * 32 * warps // (BK * BV))
    return min(1 << (fits.bit_length() - 1), MAX_BRANCH_SLOTS)


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
def _preorder(parents, T_d, o_t, BT: tl.constexpr):
    """A tree's nodes in depth-first preorder (children in index order), with what the verify walk needs of each.

    Returns `path` `[BT, BT]` int32 (path[j, m] = 1 where node m is j or an ancestor of j) and `by_rank` `[BT]` int32:
    entry r packs the r-th node of the preorder — its index (bits 0–7), its depth (8–15), its parent + 1 (16–23) and
    whether it has two or more children (bit 24). Lanes past T_d hold 0 and are never read."""
    # All nodes walk up together: T_d hops of one vector load each, instead of a chain of dependent scalar loads.
    node = tl.where(o_t < T_d, o_t, -1)
    path = tl.where(o_t[None, :] == node[:, None], 1, 0)  # [BT, BT]
    for _ in range(T_d):
        node = tl.load(parents + tl.maximum(node, 0), mask=node >= 0, other=-1)
        path = tl.where(o_t[None, :] == node[:, None], 1, path)
    par = tl.load(parents + o_t, mask=o_t < T_d, other=-2)  # [BT]: -1 the root, -2 past T_d
    depth = tl.sum(path, axis=1) - 1  # [BT]
    size = tl.sum(path, axis=0)  # [BT]: nodes in each node's subtree (itself included)
    # A node's preorder position: its ancestors, and the subtrees of the earlier siblings of it and of each ancestor.
    earlier = (par[:, None] == par[None, :]) & (o_t[None, :] < o_t[:, None])  # [p, s]: s an earlier sibling of p
    before = tl.sum(tl.where(earlier, size[None, :], 0), axis=1)  # [BT]
    rank = depth + tl.sum(path * before[None, :], axis=1)  # [BT], -1 past T_d
    children = tl.sum(tl.where(par[None, :] == o_t[:, None], 1, 0), axis=1)  # [BT]
    info = o_t | (depth << 8) | ((par + 1) << 16) | (tl.where(children >= 2, 1, 0) << 24)
    return path, tl.sum(tl.where(rank[None, :] == o_t[:, None], info[None, :], 0), axis=1)


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
    SLOTS: tl.constexpr,  # branch states kept on chip: those of branching nodes at depths 0 .. SLOTS - 1
    EPS: tl.constexpr,
    CHAIN: tl.constexpr,  # every row is a chain (parent j - 1): tree_parents is not read
):
    i_n, i_h, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    o_t = tl.arange(0, BT)
    o_slot = tl.arange(0, SLOTS)
    m_k, m_v = o_k < K, o_v < V

    slot = tl.load(state_indices + i_n).to(tl.int64)
    p_s = state + slot * stride_s + i_h * (K * V) + o_k[:, None] * V + o_v[None, :]
    b_s0 = tl.load(p_s, mask=m_k[:, None] & m_v[None, :], other=0.0)  # [BK, BV] fp32, the committed state
    b_A_log, b_dt_bias = tl.load(A_log + i_h), tl.load(dt_bias + i_h)
    t0 = i_n.to(tl.int64) * T_d  # this sequence's first token

    # The nodes are walked in depth-first preorder, so that b_run — the state after the node walked last — is the
    # parent's state of every node but the later children of a branching node. Those take their parent's state from
    # the slot of its depth, where a branching node leaves its state; a branching node deeper than the slots makes its
    # later children replay their ancestors from the committed state. In preorder the last node walked at a depth
    # above a node's is that node's ancestor, so a slot is never overwritten before its last reader. A chain (CHAIN)
    # walks nodes 0 .. T_d - 1 and only ever extends b_run.
    path = tl.zeros([BT, BT], dtype=tl.int32)
    by_rank = tl.zeros([BT], dtype=tl.int32)
    if not CHAIN:
        path, by_rank = _preorder(tree_parents + i_n.to(tl.int64) * T_d, T_d, o_t, BT)
    # the first child's inputs are loaded while its parent's step runs (they do not depend on the state)
    node1 = 0
    if not CHAIN:
        node1 = tl.sum(tl.where(o_t == 0, by_rank, 0))
    b_k1, b_q1, b_v1, b_a1, b_b1 = _node_inputs(q, k, v, a, b, t0 + (node1 & 255), i_h, stride_q_t, stride_q_h,
                                                stride_k_t, stride_k_h, stride_v_t, stride_v_h, stride_a_t,
                                                stride_b_t, o_k, m_k, o_v, m_v, True)  # fmt: skip
    b_run = b_s0
    b_branch = tl.zeros([SLOTS, BK, BV], dtype=tl.float32)  # [SLOTS, BK, BV]: slot d, a branching node's at depth d
    prev = -1
    for r in range(T_d):
        b_k, b_q, b_v, b_a, b_b, node = b_k1, b_q1, b_v1, b_a1, b_b1, node1
        nxt = tl.minimum(r + 1, T_d - 1)
        if CHAIN:
            node1 = nxt
        else:
            node1 = tl.sum(tl.where(o_t == nxt, by_rank, 0))
        b_k1, b_q1, b_v1, b_a1, b_b1 = _node_inputs(q, k, v, a, b, t0 + (node1 & 255), i_h, stride_q_t,
                                                    stride_q_h, stride_k_t, stride_k_h, stride_v_t, stride_v_h,
                                                    stride_a_t, stride_b_t, o_k, m_k, o_v, m_v, True)  # fmt: skip
        b_k = unit(b_k, EPS)
        b_q = unit(b_q, EPS) * scale
        b_g, b_beta = gates(b_a, b_b, b_A_log, b_dt_bias)
        j = node & 255
        if CHAIN:
            b_s = delta_step(b_run, b_k, b_v, b_g, b_beta)
        else:
            depth = (node >> 8) & 255
            parent = ((node >> 16) & 255) - 1
            b_base = b_run
            if parent != prev:
                if depth <= SLOTS:  # the parent (depth - 1) left its state in its slot
                    b_base = tl.sum(tl.where(o_slot[:, None, None] == depth - 1, b_branch, 0.0), axis=0)
                else:
                    b_path = tl.sum(tl.where(o_t[:, None] == j, path, 0), axis=0)  # [BT] row j
                    # Parents precede children, so ascending node order along the path is root-first order.
                    b_base = b_s0
                    for m in range(j):
                        if tl.sum(tl.where(o_t == m, b_path, 0)) > 0:
                            b_base = token_step(b_base, t0 + m, k, v, a, b, stride_k_t, stride_k_h, stride_v_t,
                                                stride_v_h, stride_a_t, stride_b_t, i_h, o_k, m_k, o_v, m_v, b_A_log,
                                                b_dt_bias, EPS)  # fmt: skip
            b_s = delta_step(b_base, b_k, b_v, b_g, b_beta)
            if (node >> 24) != 0:
                if depth < SLOTS:
                    b_branch = tl.where(o_slot[:, None, None] == depth, b_s[None, :, :], b_branch)
        b_run = b_s
        prev = j
        b_o = tl.sum(b_s * b_q[:, None], axis=0)  # [BV]
        tl.store(o + ((t0 + j) * H + i_h) * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)


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
    branch_states: int | None = None,
) -> torch.Tensor:
    """Draft-tree outputs without writing `state`: q, k `[T, H, K]`, v `[T, H, V]`, a, b `[T, H]` (raw), token
    `i*T_d + j` is node j of sequence i, tree_parents `[N, T_d]` int32 (-1 for node 0, else `parent < j`),
    state `[S, H, K, V]` fp32, state_indices `[N]`. `is_chain`: the caller's promise that every row is a chain
    (parent j - 1), which the kernel then takes without reading tree_parents. Grid (N, H, V / block_v); block_v
    and num_warps default to `verify_tiles`, branch_states (a power of two: the branching depths whose states stay on
    chip) to `branch_slots`. Returns o `[T, H, V]` in `v.dtype`.
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
    slots = 1 if is_chain else branch_states or branch_slots(BK, BV, warps)
    if slots < 1 or slots & (slots - 1):
        raise ValueError(f"gated_delta_rule_verify: branch_states {slots} must be a power of two")
    if T_d > 255:  # the kernel packs a node's index, depth and parent + 1 into 8 bits each
        raise ValueError(f"gated_delta_rule_verify: {T_d} nodes a tree, at most 255")
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
        SLOTS=slots,
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
