"""Greedy acceptance of draft trees with the verify step's result rows (`tree_accept_emit`): one Triton launch
(`kernels.py`) when `use_triton(tokens)` says so, else the reference."""

from __future__ import annotations

import torch

from jetserve.ops.backend import use_triton
from jetserve.ops.tree_accept import kernels, reference
from jetserve.ops.tree_accept.reference import Accepted, Tree, TreeForced


def tree_accept_emit(target: torch.Tensor, tree: Tree, slots: torch.Tensor, forced: TreeForced = None) -> Accepted:
    """target [N, T_d] int64, tree (tokens, parents, depths [N, T_d], mask [N, T_d, T_d] bool: a `DraftTree`), slots
    [N] (0: a padded row), forced (accepted, num_accepted, bonus) or None → (accepted [N, T_d] int32, num_accepted [N]
    int32, bonus [N] int64, result [N, T_d + 2] int64). See `reference.tree_accept_emit`."""
    fn = kernels.tree_accept_emit if use_triton(tree.tokens) else reference.tree_accept_emit
    return fn(target, tree, slots, forced)


__all__ = ["Tree", "tree_accept_emit"]
