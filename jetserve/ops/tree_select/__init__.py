"""Selection of a draft tree's nodes from its candidates (`select_tree`): one Triton launch (`kernels.py`) when
`use_triton(tokens)` says so, else the reference."""

from __future__ import annotations

import torch

from jetserve.ops.backend import use_triton
from jetserve.ops.tree_select import kernels, reference
from jetserve.ops.tree_select.reference import Selected


def select_tree(
    root_tokens: torch.Tensor,
    tokens: torch.Tensor,
    scores: torch.Tensor,
    parents: torch.Tensor,
    num_draft_tokens: int,
    root_positions: torch.Tensor,
    max_depth: int,
) -> Selected:
    """root_tokens [N], tokens, scores, parents [N, M] (-1: the root), num_draft_tokens T_d, root_positions [N],
    max_depth (the draft levels) → the tree's (tokens, parents, depths, mask, positions, scores), [N, T_d] each and the
    mask [N, T_d, T_d]. See `reference.select_tree`."""
    fn = kernels.select_tree if use_triton(tokens) else reference.select_tree
    return fn(root_tokens, tokens, scores, parents, num_draft_tokens, root_positions, max_depth)


__all__ = ["select_tree"]
