"""Selection of a draft tree's nodes from its candidates (`select_tree`): one Triton launch (`kernels.py`) when
`use_triton(tokens)` says so, else the reference."""

from __future__ import annotations

from jetserve.ops.backend import use_triton
from jetserve.ops.tree_select import kernels, reference
from jetserve.ops.tree_select.reference import Candidates, Selected


def select_tree(candidates: Candidates, num_draft_tokens: int, max_depth: int) -> Selected:
    """candidates (root_tokens [N], tokens, scores, parents [N, M] (-1: the root), root_positions [N]),
    num_draft_tokens T_d, max_depth (the draft levels) → the tree's (tokens, parents, depths, mask, positions, scores),
    [N, T_d] each and the mask [N, T_d, T_d]. See `reference.select_tree`."""
    fn = kernels.select_tree if use_triton(candidates.tokens) else reference.select_tree
    return fn(candidates, num_draft_tokens, max_depth)


__all__ = ["Candidates", "select_tree"]
