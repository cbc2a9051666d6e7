"""Greedy acceptance of draft trees and the verify step's result rows, as torch ops (the contract the Triton launch in
`kernels.py` keeps). Vectorised over the nodes with the ancestor mask: no loop over nodes or rows."""

from __future__ import annotations

from typing import Protocol

import torch

# (accepted [N, T_d], num_accepted [N], bonus [N]) replacing the acceptance (the benchmarks' forced "all")
TreeForced = tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
Accepted = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # (accepted, num_accepted, bonus, result)


class Tree(Protocol):
    """The tree's fields the acceptance reads, as `spec.tree.DraftTree` holds them."""

    tokens: torch.Tensor  # [N, T_d]: node 0 the root, the last committed token
    parents: torch.Tensor  # [N, T_d]: -1 at the root; parents precede children
    depths: torch.Tensor  # [N, T_d]
    mask: torch.Tensor  # [N, T_d, T_d] bool: mask[i, j, a] = a is j or an ancestor of j


def check_tree_args(target: torch.Tensor, tree: Tree, slots: torch.Tensor, forced: TreeForced) -> None:
    tokens, parents, depths, mask = tree.tokens, tree.parents, tree.depths, tree.mask
    if tokens.dim() != 2 or tokens.shape[1] < 1:
        raise ValueError(f"tree_accept_emit: tokens must be [N, T_d] with T_d ≥ 1, got {tuple(tokens.shape)}")
    num_seqs, num_nodes = tokens.shape
    for name, t in (("target", target), ("parents", parents), ("depths", depths)):
        if t.shape != tokens.shape:
            raise ValueError(f"tree_accept_emit: {name} {tuple(t.shape)} must match tokens {tuple(tokens.shape)}")
    if mask.shape != (num_seqs, num_nodes, num_nodes) or mask.dtype != torch.bool:
        raise ValueError(
            f"tree_accept_emit: mask must be [N, T_d, T_d] = [{num_seqs}, {num_nodes}, {num_nodes}] bool, got "
            f"{tuple(mask.shape)} {mask.dtype}"
        )
    if slots.shape != (num_seqs,):
        raise ValueError(f"tree_accept_emit: slots {tuple(slots.shape)} must be [{num_seqs}]")
    if forced is not None and (forced[0].shape != tokens.shape or any(t.shape != (num_seqs,) for t in forced[1:])):
        raise ValueError(
            f"tree_accept_emit: forced (accepted, num_accepted, bonus) must be [{num_seqs}, {num_nodes}], "
            f"[{num_seqs}], [{num_seqs}]"
        )
    named = (("target", target), ("tokens", tokens), ("parents", parents), ("depths", depths), ("slots", slots))
    for name, t in (*named, *(("forced", t) for t in forced or ())):
        if t.is_floating_point() or t.dtype == torch.bool:
            raise ValueError(f"tree_accept_emit: {name} must hold integers, got {t.dtype}")


def tree_accept_emit(target: torch.Tensor, tree: Tree, slots: torch.Tensor, forced: TreeForced = None) -> Accepted:
    """Greedy acceptance of one draft tree per row and what the step emits, from the target's greedy tokens.

    target [N, T_d] int64: the target's argmax at each node; tree: its tokens, parents, depths [N, T_d] and mask
    [N, T_d, T_d] bool, as `DraftTree` holds them (`Tree`); slots [N]: each row's state slot, 0 for a padded row
    (which commits nothing). A node is on a matching path when it and every ancestor below the root carry the target's
    token at their parent; the accepted path ends at the deepest such node, the lowest index among equally deep
    ones, and the bonus is the target's token there — `tree_accept_greedy`'s rule. `forced` = (accepted [N, T_d],
    num_accepted [N], bonus [N]) replaces that acceptance (the benchmarks' forced "all": the path to node
    accepted[i, count - 1], with 1 ≤ count ≤ T_d).

    Returns accepted [N, T_d] int32 (the path's nodes, root first, then -1), num_accepted [N] int32 (the path's
    length, root included; 0 on padded rows), bonus [N] int64, and result [N, T_d + 2] int64: the emitted tokens (the
    accepted drafts in path order, then the bonus, -1 after num_accepted), num_accepted, and the tree's depth (its
    deepest node's) — the row a verify step reads back in one transfer.
    """
    check_tree_args(target, tree, slots, forced)
    num_seqs, num_nodes = tree.tokens.shape
    device = tree.tokens.device
    target, tokens, depths, mask = target.long(), tree.tokens.long(), tree.depths.long(), tree.mask
    nodes = torch.arange(num_nodes, device=device)  # [T_d]
    if forced is None:
        at_parent = target.gather(1, tree.parents.long().clamp(min=0))  # [N, T_d]: the target's token at each parent
        is_match = (tokens == at_parent) | (nodes == 0)  # [N, T_d]: the root always
        on_path = ~(mask & ~is_match[:, None, :]).any(dim=2)  # [N, T_d]: no ancestor-or-self that misses
        reach = torch.where(on_path, depths, -1)  # [N, T_d]
        best_depth = reach.max(dim=1).values  # [N]
        best = torch.where(reach == best_depth[:, None], nodes, num_nodes).min(dim=1).values  # [N]: lowest index
        bonus = target.gather(1, best[:, None]).squeeze(1)  # [N]
    else:
        count = forced[1].long()
        best = forced[0].long().gather(1, (count - 1).clamp(min=0)[:, None]).squeeze(1)  # [N]: the path's last node
        best_depth, bonus = count - 1, forced[2].long()
    count = best_depth + 1  # [N]
    path = mask[torch.arange(num_seqs, device=device), best]  # [N, T_d]: the path's nodes
    at_depth = path[:, None, :] & (depths[:, None, :] == nodes[None, :, None])  # [N, T_d (depth), T_d (node)]
    accepted = torch.where(at_depth, nodes, -1).max(dim=2).values  # [N, T_d]: the path's node at each depth
    next_token = torch.where(at_depth[:, 1:], tokens[:, None, :], -1).max(dim=2).values  # [N, T_d - 1]
    emitted = torch.cat([next_token, next_token.new_full((num_seqs, 1), -1)], dim=1)  # [N, T_d]: draft after depth p
    count_out = torch.where(slots > 0, count, 0)  # [N]
    emitted = torch.where(nodes[None, :] == count_out[:, None] - 1, bonus[:, None], emitted)
    emitted = torch.where(nodes[None, :] < count_out[:, None], emitted, -1)  # [N, T_d]
    tree_depth = depths.max(dim=1, keepdim=True).values  # [N, 1]
    result = torch.cat([emitted, count_out[:, None], tree_depth], dim=1)  # [N, T_d + 2]
    return accepted.to(torch.int32), count_out.to(torch.int32), bonus, result
