"""The draft tree as data: per-level candidates of the EAGLE drafting loop → the best `num_draft_tokens` nodes as
`DraftTree` tensors (tokens, parents, depths, ancestor mask, positions), batched over sequences on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from jetserve.ops.tree_select import Candidates, select_tree
from jetserve.spec.constants import ShapeConstants


@dataclass
class DraftTree:
    """T_d nodes per sequence; node 0 is the last committed token (parent -1, depth 0).

    Nodes are in topological order (`parents[i, j] < j` for j ≥ 1) and siblings in order of decreasing score, which
    is the order in which tree acceptance tries them.
    """

    tokens: torch.Tensor  # [N, T_d] int64: node tokens (target vocabulary)
    parents: torch.Tensor  # [N, T_d] int32: parent node, -1 for node 0
    depths: torch.Tensor  # [N, T_d] int32: 0 for node 0
    mask: torch.Tensor  # [N, T_d, T_d] bool: mask[i, j, a] = a is j or an ancestor of j
    positions: torch.Tensor  # [N, T_d] int64: RoPE positions, root position + depth
    scores: torch.Tensor  # [N, T_d] fp32: cumulative draft log-prob of each node (0 for node 0)

    @property
    def num_seqs(self) -> int:
        return self.tokens.shape[0]

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[1]


@dataclass
class DraftLevel:
    """The candidates drafted at one depth (d + 1 for level d), each a child of a node of the previous level."""

    tokens: torch.Tensor  # [N, C] int64
    scores: torch.Tensor  # [N, C] fp32: cumulative log-prob (parent's score + own log-prob)
    parents: torch.Tensor  # [N, C] int64: index into the previous level's candidates (ignored at level 0: the root)


def expand_frontier(
    frontier_scores: torch.Tensor,
    frontier_index: torch.Tensor,
    child_logprobs: torch.Tensor,
    child_tokens: torch.Tensor,
) -> tuple[DraftLevel, torch.Tensor, torch.Tensor]:
    """One EAGLE drafting level: each of the k frontier nodes gets its top-k children, k*k candidates in all.

    frontier_scores [N, k] (cumulative log-probs of the nodes expanded), frontier_index [N, k] (their indices among
    the previous level's candidates), child_logprobs [N, k, k] and child_tokens [N, k, k] (the draft model's top-k
    log-probs and target-vocabulary tokens at each frontier node, most likely first). Returns the level's candidates,
    and the next frontier: the k best candidates' indices into this level [N, k] and their scores [N, k].
    """
    if child_logprobs.dim() != 3 or child_logprobs.shape != child_tokens.shape:
        raise ValueError(
            f"expand_frontier: child_logprobs and child_tokens must be [N, k, k], got {tuple(child_logprobs.shape)}, "
            f"{tuple(child_tokens.shape)}"
        )
    num_seqs, k, k_children = child_logprobs.shape
    if frontier_scores.shape != (num_seqs, k) or frontier_index.shape != (num_seqs, k):
        raise ValueError(
            f"expand_frontier: frontier_scores and frontier_index must be [N, k] = [{num_seqs}, {k}], got "
            f"{tuple(frontier_scores.shape)}, {tuple(frontier_index.shape)}"
        )
    scores = (frontier_scores.float()[:, :, None] + child_logprobs.float()).reshape(num_seqs, k * k_children)
    parents = frontier_index.long()[:, :, None].expand(-1, -1, k_children).reshape(num_seqs, k * k_children)
    level = DraftLevel(tokens=child_tokens.long().reshape(num_seqs, -1), scores=scores, parents=parents)
    top_scores, top_index = _stable_top(scores, min(k, scores.shape[1]))
    return level, top_index, top_scores


def first_level(logprobs: torch.Tensor, tokens: torch.Tensor) -> tuple[DraftLevel, torch.Tensor, torch.Tensor]:
    """Level 0: the root's top-k children, logprobs [N, k] and tokens [N, k] (most likely first). Returns the level
    and the frontier to expand next (indices [N, k] into this level, scores [N, k])."""
    if logprobs.dim() != 2 or logprobs.shape != tokens.shape:
        raise ValueError(f"first_level: logprobs and tokens must be [N, k], got {logprobs.shape}, {tokens.shape}")
    scores = logprobs.float()
    level = DraftLevel(tokens=tokens.long(), scores=scores, parents=torch.zeros_like(tokens, dtype=torch.long))
    top_scores, top_index = _stable_top(scores, scores.shape[1])
    return level, top_index, top_scores


def _stable_top(scores: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `count` largest scores per row and their indices; ties go to the lower index (so a parent whose score
    equals its child's always ranks first)."""
    values, index = torch.sort(scores, dim=1, descending=True, stable=True)  # [N, C]
    return values[:, :count], index[:, :count]


def build_draft_tree(
    root_tokens: torch.Tensor,
    levels: list[DraftLevel],
    num_draft_tokens: int,
    root_positions: torch.Tensor,
) -> DraftTree:
    """Keep the best `num_draft_tokens - 1` candidates by cumulative log-prob (plus the root) as a `DraftTree`.

    root_tokens [N] (the last committed token of each sequence), levels[d] the candidates at depth d + 1 (level 0's
    parents are the root), root_positions [N] (the root's RoPE position). A node's score is first capped at its
    parent's, so a kept node's ancestors always rank at least as high and are kept too (ties go to the shallower
    node). With one candidate per level (topk = 1) the tree is a chain. The levels are concatenated here and the
    selection is `ops.tree_select` (one launch on a GPU). No host synchronisation, no loop over N.
    """
    if not levels:
        raise ValueError("build_draft_tree: need at least one draft level")
    num_seqs = root_tokens.shape[0]
    device = root_tokens.device
    if root_positions.shape != (num_seqs,):
        raise ValueError(f"build_draft_tree: root_positions must be [N] = [{num_seqs}], got {root_positions.shape}")

    # Concatenate the levels; a candidate's parent becomes a global candidate index (-1 = the root).
    parents, offset = [], 0
    for d, level in enumerate(levels):
        width = level.tokens.shape[1]
        if level.tokens.shape != (num_seqs, width) or level.scores.shape != level.tokens.shape:
            raise ValueError(f"build_draft_tree: level {d} tokens and scores must be [N, C], got {level.tokens.shape}")
        if d == 0:
            parents.append(torch.full((num_seqs, width), -1, dtype=torch.long, device=device))
        else:
            if level.parents.shape != level.tokens.shape:
                raise ValueError(f"build_draft_tree: level {d} parents must be [N, C], got {level.parents.shape}")
            parents.append(level.parents.long() + (offset - levels[d - 1].tokens.shape[1]))
        offset += width
    tokens = torch.cat([level.tokens for level in levels], dim=1)  # [N, M]
    scores = torch.cat([level.scores.float() for level in levels], dim=1)  # [N, M]
    candidates = Candidates(root_tokens, tokens, scores, torch.cat(parents, dim=1), root_positions)
    return DraftTree(*select_tree(candidates, num_draft_tokens, max_depth=len(levels)))


def ancestor_mask(parents: torch.Tensor, num_levels: int) -> torch.Tensor:
    """mask [N, T_d, T_d] bool with mask[i, j, a] = a is j or an ancestor of j, from parents [N, T_d] (-1 at the root)
    of a tree at most `num_levels` deep: the `DraftTree.mask` of a tree given by its parents alone (hand-made trees,
    as the tests build). The drafter's trees get theirs from `ops.tree_select`, and chains from `chain_buffers`."""
    num_seqs, num_nodes = parents.shape
    device = parents.device
    mask = torch.eye(num_nodes, dtype=torch.bool, device=device).expand(num_seqs, -1, -1).clone()  # [N, T_d, T_d]
    ancestor = parents.long()  # [N, T_d]: the ancestor `step + 1` levels up, -1 past the root
    for _ in range(num_levels):
        has = ancestor >= 0  # [N, T_d]
        hit = torch.nn.functional.one_hot(ancestor.clamp(min=0), num_nodes).bool()  # [N, T_d, T_d]
        mask |= hit & has[..., None]
        ancestor = torch.where(has, parents.long().gather(1, ancestor.clamp(min=0)), -1)
    return mask


def chain_buffers(
    num_seqs: int, num_nodes: int, device: torch.device, constants: ShapeConstants | None = None
) -> DraftTree:
    """A chain's tree to draft into (`Drafter.draft_tree`'s `out`): a chain's parents, depths and mask, which a chain
    drafted into it keeps; tokens and positions zero; scores zero, the root's column staying so. With `constants`
    (a drafter's), the parents, depths and mask — the shape's alone — are made once and served from there
    (read-only), and tokens and positions are left unset (a chain drafted into them writes every entry)."""
    if constants is None:
        depth = torch.arange(num_nodes, device=device)  # [T_d]
        parents = (depth - 1).to(torch.int32).expand(num_seqs, -1).contiguous()
        depths = depth.to(torch.int32).expand(num_seqs, -1).contiguous()
        mask = torch.ones(num_nodes, num_nodes, dtype=torch.bool, device=device).tril().expand(num_seqs, -1, -1)
        new = torch.zeros
    else:
        parents = constants.get(("chain parents", num_seqs, num_nodes), device,
                                lambda: chain_buffers(num_seqs, num_nodes, device).parents)  # fmt: skip
        depths = constants.get(("chain depths", num_seqs, num_nodes), device,
                               lambda: chain_buffers(num_seqs, num_nodes, device).depths)  # fmt: skip
        mask = constants.causal(num_seqs, num_nodes, device)
        new = torch.empty
    return DraftTree(
        tokens=new(num_seqs, num_nodes, dtype=torch.int64, device=device),
        parents=parents,  # [N, T_d] int32
        depths=depths,  # [N, T_d] int32
        mask=mask.contiguous(),  # [N, T_d, T_d]: node a ≤ j is j's ancestor
        positions=new(num_seqs, num_nodes, dtype=torch.int64, device=device),
        scores=torch.zeros(num_seqs, num_nodes, dtype=torch.float32, device=device),
    )


def chain_tree(tokens: torch.Tensor, root_positions: torch.Tensor, scores: torch.Tensor | None = None) -> DraftTree:
    """A chain of T_d nodes from tokens [N, T_d] (node 0 the last committed token): parent j - 1, depth j, position
    root_positions[i] + j; scores [N, T_d] fp32 its cumulative draft log-probs (0 at the root), zeros when not given.
    (The drafter drafts a chain into `chain_buffers` directly.)"""
    num_seqs, num_nodes = tokens.shape
    tree = chain_buffers(num_seqs, num_nodes, tokens.device)
    tree.tokens.copy_(tokens)
    torch.add(root_positions.to(tokens.device, torch.long)[:, None], tree.depths, out=tree.positions)
    if scores is not None:
        tree.scores.copy_(scores)
    return tree
