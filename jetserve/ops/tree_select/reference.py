"""Selection of a draft tree's nodes from its candidates, as torch ops (the contract the Triton launch in `kernels.py`
keeps): the scores capped along each candidate's ancestors, the best `num_draft_tokens - 1` kept, and the kept
candidates renumbered as tree nodes with their parents, depths, ancestor mask, positions and scores."""

from __future__ import annotations

from typing import NamedTuple

import torch

# (tokens [N, T_d] int64, parents [N, T_d] int32, depths [N, T_d] int32, mask [N, T_d, T_d] bool, positions [N, T_d]
# int64, scores [N, T_d] fp32): a `DraftTree`'s fields in its order
Selected = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


class Candidates(NamedTuple):
    """Every draft level's candidates, concatenated in level order, and each row's root."""

    root_tokens: torch.Tensor  # [N]: each row's last committed token (node 0)
    tokens: torch.Tensor  # [N, M]
    scores: torch.Tensor  # [N, M] float: cumulative draft log-probs, not NaN
    parents: torch.Tensor  # [N, M] int: the parent candidate, -1 for the root; parents precede children
    root_positions: torch.Tensor  # [N]: the root's RoPE position


def check_select_args(candidates: Candidates, num_draft_tokens: int, max_depth: int) -> None:
    root_tokens, tokens, scores, parents, root_positions = candidates
    if tokens.dim() != 2:
        raise ValueError(f"select_tree: tokens must be [N, M], got {tuple(tokens.shape)}")
    num_seqs, num_candidates = tokens.shape
    if scores.shape != tokens.shape or parents.shape != tokens.shape:
        raise ValueError(
            f"select_tree: scores {tuple(scores.shape)} and parents {tuple(parents.shape)} must match tokens "
            f"{tuple(tokens.shape)}"
        )
    if root_tokens.shape != (num_seqs,) or root_positions.shape != (num_seqs,):
        raise ValueError(
            f"select_tree: root_tokens {tuple(root_tokens.shape)} and root_positions {tuple(root_positions.shape)} "
            f"must be [{num_seqs}]"
        )
    if not 1 <= num_draft_tokens <= num_candidates + 1:
        raise ValueError(
            f"num_draft_tokens: {num_draft_tokens} must be in [1, {num_candidates + 1}] (root + the {num_candidates} "
            f"drafted candidates)"
        )
    if max_depth < 1:
        raise ValueError(f"select_tree: max_depth must be ≥ 1, got {max_depth}")
    if not scores.is_floating_point() or parents.is_floating_point() or tokens.is_floating_point():
        raise ValueError(f"select_tree: scores must be floating, tokens and parents integers (got {scores.dtype}, "
                         f"{tokens.dtype}, {parents.dtype})")  # fmt: skip


def select_tree(candidates: Candidates, num_draft_tokens: int, max_depth: int) -> Selected:
    """The best `num_draft_tokens - 1` of each row's M candidates, with the root, as a tree of T_d nodes.

    candidates: the levels' candidates (tokens, scores, parents [N, M]) and each row's root token and position
    (`Candidates`); max_depth: no candidate lies deeper (the draft levels). A candidate's score is first capped at
    its ancestors' — so a kept node's ancestors always rank at least as high and are kept too — and ties go to the
    lower candidate index (the shallower one). The kept candidates become nodes 1 .. T_d - 1 in candidate order, so
    parents precede children.

    Returns the tree's tokens, parents (int32, -1 at the root), depths (int32), ancestor mask (mask[i, j, a]: a is j or
    an ancestor of j), positions (root position + depth) and capped scores (0 at the root), as `Selected`.
    """
    check_select_args(candidates, num_draft_tokens, max_depth)
    root_tokens, tokens, scores, parents, root_positions = candidates
    num_seqs, num_candidates = tokens.shape
    device = tokens.device
    raw, parents = scores.float(), parents.long()
    # Walk each candidate's ancestors: its capped score, its depth, and which candidates are its ancestors-or-self.
    capped = raw
    depth = torch.ones(num_seqs, num_candidates, dtype=torch.long, device=device)
    is_ancestor = torch.eye(num_candidates, dtype=torch.bool, device=device).expand(num_seqs, -1, -1)  # [N, M, M]
    ancestor = parents
    for _ in range(max_depth - 1):
        has = ancestor >= 0  # [N, M]
        up = ancestor.clamp(min=0)
        capped = torch.where(has, torch.minimum(capped, raw.gather(1, up)), capped)
        depth = depth + has.long()
        is_ancestor = is_ancestor | (torch.nn.functional.one_hot(up, num_candidates).bool() & has[..., None])
        ancestor = torch.where(has, parents.gather(1, up), -1)
    # Best T_d - 1 by capped score (stable: ties to the lower index), then back in candidate order.
    kept = num_draft_tokens - 1
    chosen = torch.sort(capped, dim=1, descending=True, stable=True).indices[:, :kept].sort(dim=1).values  # [N, T_d-1]
    node_of = torch.zeros(num_seqs, num_candidates + 1, dtype=torch.long, device=device)  # [N, M + 1]: last = root
    node_of.scatter_(1, chosen, torch.arange(1, kept + 1, device=device).expand(num_seqs, -1))
    parent = parents.gather(1, chosen)  # [N, T_d - 1]
    parent_nodes = node_of.gather(1, torch.where(parent < 0, num_candidates, parent))
    among = is_ancestor.gather(1, chosen[:, :, None].expand(-1, -1, num_candidates))  # [N, T_d - 1, M]
    mask = torch.zeros(num_seqs, kept + 1, kept + 1, dtype=torch.bool, device=device)
    mask[:, :, 0] = True
    mask[:, 1:, 1:] = among.gather(2, chosen[:, None, :].expand(-1, kept, -1))  # [N, T_d - 1, T_d - 1]
    root = torch.zeros(num_seqs, 1, dtype=torch.long, device=device)
    depths = torch.cat([root, depth.gather(1, chosen)], dim=1)  # [N, T_d]
    return (
        torch.cat([root_tokens.long()[:, None], tokens.long().gather(1, chosen)], dim=1),
        torch.cat([root - 1, parent_nodes], dim=1).to(torch.int32),
        depths.to(torch.int32),
        mask,
        root_positions.long()[:, None] + depths,
        torch.cat([root.float(), capped.gather(1, chosen)], dim=1),
    )
