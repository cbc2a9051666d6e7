"""`tree_accept_emit` in one Triton launch: program i settles row i — which nodes lie on a matching path (its
[T_d, T_d] ancestor mask in registers), the deepest one, the path to it, the bonus and the result row — where
`tree_accept_greedy`'s node walk and the emitted tokens took ~150 small kernels at 8 nodes (a tree verify step's graph
replays them every step)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from jetserve.ops.accept_rows import empty_outputs, store_row
from jetserve.ops.layout import dense
from jetserve.ops.tree_accept.reference import Accepted, Tree, TreeForced, check_tree_args


@triton.jit
def _tree_accept_emit_kernel(
    target,  # [N, T_d] int64
    tokens,  # [N, T_d]
    parents,  # [N, T_d] (-1 at the root)
    depths,  # [N, T_d]
    mask,  # [N, T_d, T_d] bool: mask[i, j, a] = a is j or an ancestor of j
    slots,  # [N]
    forced_accepted,  # [N, T_d] (FORCED)
    forced_count,  # [N] (FORCED)
    forced_bonus,  # [N] (FORCED)
    accepted,  # [N, T_d] int32 out
    num_accepted,  # [N] int32 out
    bonus,  # [N] int64 out
    result,  # [N, T_d + 2] int64 out
    num_nodes,
    FORCED: tl.constexpr,
    BLOCK: tl.constexpr,  # ≥ T_d + 2: a result row
):
    i = tl.program_id(0).to(tl.int64)
    row = i * num_nodes
    j = tl.arange(0, BLOCK)  # a node (or a depth, or a result column)
    m_j = j < num_nodes
    b_depth = tl.load(depths + row + j, mask=m_j, other=-1).to(tl.int64)  # [BLOCK]
    b_token = tl.load(tokens + row + j, mask=m_j, other=-1).to(tl.int64)
    if FORCED:
        count = tl.load(forced_count + i).to(tl.int64)
        best = tl.load(forced_accepted + row + tl.maximum(count - 1, 0)).to(tl.int64)
        b_bonus = tl.load(forced_bonus + i).to(tl.int64)
    else:
        b_parent = tl.maximum(tl.load(parents + row + j, mask=m_j, other=0).to(tl.int64), 0)
        b_at_parent = tl.load(target + row + b_parent, mask=m_j, other=0).to(tl.int64)
        is_miss = (b_token != b_at_parent) & (j > 0)  # [BLOCK]: the root always matches
        m_mask = m_j[:, None] & m_j[None, :]
        b_mask = tl.load(mask + (row + j[:, None]) * num_nodes + j[None, :], mask=m_mask, other=0) != 0  # [node, anc.]
        is_off = tl.max((b_mask & is_miss[None, :]).to(tl.int32), axis=1) > 0  # an ancestor-or-self misses
        reach = tl.where(m_j & ~is_off, b_depth, -1)
        best_depth = tl.max(reach, axis=0)
        best = tl.min(tl.where(reach == best_depth, j, BLOCK), axis=0).to(tl.int64)  # the lowest index at that depth
        count = best_depth + 1
        b_bonus = tl.load(target + row + best).to(tl.int64)
    b_path = tl.load(mask + (row + best) * num_nodes + j, mask=m_j, other=0) != 0  # [BLOCK]: the path's nodes
    at_depth = b_path[None, :] & (b_depth[None, :] == j[:, None])  # [BLOCK (depth), BLOCK (node)]
    b_accepted = tl.max(tl.where(at_depth, j[None, :], -1), axis=1)  # the path's node at each depth, -1 past it
    after = b_path[None, :] & (b_depth[None, :] == j[:, None] + 1)
    b_next = tl.max(tl.where(after, b_token[None, :], -1), axis=1)  # the path's draft after each depth
    store_row(accepted, num_accepted, bonus, result, slots, i, j, b_accepted, count, b_bonus, b_next,
              tl.max(b_depth, axis=0), num_nodes)  # fmt: skip


def tree_accept_emit(target: torch.Tensor, tree: Tree, slots: torch.Tensor, forced: TreeForced = None) -> Accepted:
    """See `reference.tree_accept_emit`."""
    check_tree_args(target, tree, slots, forced)
    num_seqs, num_nodes = tree.tokens.shape
    device = tree.tokens.device
    target, tokens, parents, depths, mask, slots = dense(
        target, tree.tokens, tree.parents, tree.depths, tree.mask, slots
    )
    forced_accepted, forced_count, forced_bonus = dense(*forced) if forced is not None else (tokens, slots, slots)
    accepted, num_accepted, bonus, result = empty_outputs(num_seqs, num_nodes, device)
    if num_seqs:
        block = triton.next_power_of_2(num_nodes + 2)
        _tree_accept_emit_kernel[(num_seqs,)](
            target,
            tokens,
            parents,
            depths,
            mask,
            slots,
            forced_accepted,
            forced_count,
            forced_bonus,
            accepted,
            num_accepted,
            bonus,
            result,
            num_nodes,
            FORCED=forced is not None,
            BLOCK=block,
            num_warps=4 if block <= 32 else 8,
        )
    return accepted, num_accepted, bonus, result
