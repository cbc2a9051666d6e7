"""`select_tree` in one Triton launch: program i settles row i — each candidate's ancestor walk (capped score, depth,
its ancestors as an [M, M] block in registers), its rank by counting the candidates ahead of it, the kept ones'
node numbers, and the tree's six fields stored by node — where the reference's torch ops are ~85 small kernels at a
2x3x8 tree (the capping, sorts, scatters, gathers and the ancestor mask's loop), replayed by the draft step's graph."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from jetserve.ops.layout import dense
from jetserve.ops.tree_select.reference import Candidates, Selected, check_select_args


@triton.jit
def _select_tree_kernel(
    root_tokens,  # [N]
    tokens,  # [N, M]
    scores,  # [N, M] float
    parents,  # [N, M] (-1: the root)
    root_positions,  # [N]
    out_tokens,  # [N, T_d] int64
    out_parents,  # [N, T_d] int32
    out_depths,  # [N, T_d] int32
    out_mask,  # [N, T_d, T_d] bool
    out_positions,  # [N, T_d] int64
    out_scores,  # [N, T_d] fp32
    num_candidates,
    num_nodes,
    MAX_DEPTH: tl.constexpr,
    BLOCK_M: tl.constexpr,  # ≥ M
    BLOCK_T: tl.constexpr,  # ≥ T_d
):
    i = tl.program_id(0).to(tl.int64)
    row = i * num_candidates
    c = tl.arange(0, BLOCK_M)  # a candidate (rows of the [M, M] blocks; `c[None, :]` the other candidate)
    m_c = c < num_candidates
    b_raw = tl.load(scores + row + c, mask=m_c, other=0.0).to(tl.float32)
    b_parent = tl.load(parents + row + c, mask=m_c, other=-1).to(tl.int64)
    # The ancestor walk: capped score, depth, and is_ancestor[c, a] = a is c or an ancestor of c.
    b_capped = b_raw
    b_depth = tl.where(m_c, 1, 0)
    is_ancestor = c[:, None] == c[None, :]
    up = b_parent
    for _ in tl.static_range(MAX_DEPTH - 1):
        has = up >= 0
        b_capped = tl.where(has, tl.minimum(b_capped, tl.load(scores + row + up, mask=has, other=0.0)), b_capped)
        b_depth += has.to(tl.int32)
        is_ancestor = is_ancestor | ((c[None, :] == up[:, None]) & has[:, None])
        up = tl.load(parents + row + up, mask=has, other=-1).to(tl.int64)
    # Rank: the candidates ahead of c (a higher capped score, or an equal one at a lower index).
    s_row, s_col = b_capped[:, None], b_capped[None, :]
    ahead = m_c[None, :] & ((s_col > s_row) | ((s_col == s_row) & (c[None, :] < c[:, None])))  # [c, other]
    rank = tl.sum(ahead.to(tl.int32), axis=1)
    is_kept = m_c & (rank < num_nodes - 1)
    # Node numbers in candidate order: 1 + the kept candidates before c; a parent's the same count below it.
    kept_col = is_kept[None, :]
    b_node = 1 + tl.sum((kept_col & (c[None, :] < c[:, None])).to(tl.int32), axis=1)
    b_parent_node = tl.where(
        b_parent >= 0, 1 + tl.sum((kept_col & (c[None, :] < b_parent[:, None])).to(tl.int32), axis=1), 0
    )
    b_token = tl.load(tokens + row + c, mask=m_c, other=0).to(tl.int64)
    root_position = tl.load(root_positions + i).to(tl.int64)
    out = i * num_nodes + b_node
    tl.store(out_tokens + out, b_token, mask=is_kept)
    tl.store(out_parents + out, b_parent_node.to(tl.int32), mask=is_kept)
    tl.store(out_depths + out, b_depth.to(tl.int32), mask=is_kept)
    tl.store(out_positions + out, root_position + b_depth, mask=is_kept)
    tl.store(out_scores + out, b_capped, mask=is_kept)
    tl.store(out_tokens + i * num_nodes, tl.load(root_tokens + i).to(tl.int64))
    tl.store(out_parents + i * num_nodes, -1)
    tl.store(out_depths + i * num_nodes, 0)
    tl.store(out_positions + i * num_nodes, root_position)
    tl.store(out_scores + i * num_nodes, 0.0)
    # The mask: between kept candidates as their ancestry says; row 0 the root alone, column 0 every node.
    square = out_mask + i * num_nodes * num_nodes
    pair = b_node[:, None] * num_nodes + b_node[None, :]
    tl.store(square + pair, is_ancestor, mask=is_kept[:, None] & kept_col)
    t = tl.arange(0, BLOCK_T)
    m_t = t < num_nodes
    tl.store(square + t, t == 0, mask=m_t)
    tl.store(square + t * num_nodes, t >= 0, mask=m_t & (t > 0))


def select_tree(candidates: Candidates, num_draft_tokens: int, max_depth: int) -> Selected:
    """See `reference.select_tree`."""
    check_select_args(candidates, num_draft_tokens, max_depth)
    num_seqs, num_candidates = candidates.tokens.shape
    device = candidates.tokens.device
    root_tokens, tokens, scores, parents, root_positions = dense(*candidates)
    shape = (num_seqs, num_draft_tokens)
    out_tokens = torch.empty(shape, dtype=torch.int64, device=device)
    out_parents = torch.empty(shape, dtype=torch.int32, device=device)
    out_depths = torch.empty(shape, dtype=torch.int32, device=device)
    out_mask = torch.empty(num_seqs, num_draft_tokens, num_draft_tokens, dtype=torch.bool, device=device)
    out_positions = torch.empty(shape, dtype=torch.int64, device=device)
    out_scores = torch.empty(shape, dtype=torch.float32, device=device)
    if num_seqs:
        block_m = triton.next_power_of_2(max(num_candidates, 1))
        _select_tree_kernel[(num_seqs,)](
            root_tokens,
            tokens,
            scores,
            parents,
            root_positions,
            out_tokens,
            out_parents,
            out_depths,
            out_mask,
            out_positions,
            out_scores,
            num_candidates,
            num_draft_tokens,
            MAX_DEPTH=max_depth,
            BLOCK_M=block_m,
            BLOCK_T=triton.next_power_of_2(num_draft_tokens),
            num_warps=4 if block_m <= 32 else 8,
        )
    return out_tokens, out_parents, out_depths, out_mask, out_positions, out_scores
