"""Verifier: one target forward over every sequence's draft tree (a VERIFY ForwardBatch), tree acceptance on the
device, and the commit of the accepted path into the K/V pages and JetBlock state (`model.commit_verified`, which
calls kv_cache_commit, dynamic_conv_commit and gated_delta_rule_commit)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from jetserve.model.forward_batch import ForwardBatch, KVMetadata, Phase
from jetserve.model.jet_nemotron import JetNemotronForCausalLM
from jetserve.ops.chain_accept import chain_accept_emit
from jetserve.ops.sampling import argmax, tree_accept
from jetserve.ops.tree_accept import tree_accept_emit
from jetserve.spec.constants import ShapeConstants
from jetserve.spec.tree import DraftTree

# (stored positions [T], state slot of each token [T], context length of each token's sequence [T], state_indices [N])
# → K/V metadata of `attn` and `swa` layers: what ModelRunner._kv_metadata computes for its page tables.
KVMetadataFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], tuple[KVMetadata | None, KVMetadata | None]
]


@dataclass
class SamplingRows:
    """Per-sequence sampling parameters of a verify step, as `sample` takes them ([N] each)."""

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    seeds: torch.Tensor
    counters: torch.Tensor  # the request's draw index: a fresh one per verify step (e.g. its length)


@dataclass
class VerifyOutput:
    accepted_nodes: torch.Tensor  # [N, T_d] int32: node indices, root first, padded with -1
    num_accepted: torch.Tensor  # [N] int32: accepted nodes including the root (≥ 1; 0 on padded rows, slot 0)
    bonus: torch.Tensor  # [N] int64: the next token after the accepted path (the next tree's root)
    aux_hidden_states: list[torch.Tensor]  # the target's features at every node (one [N*T_d, H] per capture layer)
    # [N, T_d + 2] int64 or None: the step's result row (emitted tokens, num_accepted, the tree's depth), where the
    # acceptance made it (greedy acceptance: `chain_accept_emit`, `tree_accept_emit`)
    result: torch.Tensor | None = None

    def emitted_tokens(self, tree: DraftTree) -> torch.Tensor:
        """[N, T_d] int64: the tokens this step adds to each sequence — the accepted drafts then the bonus — padded
        with -1 past num_accepted (the root was already in the sequence)."""
        num_nodes = tree.num_nodes
        if self.result is not None:
            return self.result[:, :num_nodes]
        depth = torch.arange(num_nodes, device=tree.tokens.device)
        next_nodes = torch.cat([self.accepted_nodes[:, 1:], self.accepted_nodes[:, :1]], dim=1).long().clamp(min=0)
        drafts = tree.tokens.gather(1, next_nodes)  # [N, T_d]: token of accepted node k + 1
        count = self.num_accepted.long()[:, None]
        out = torch.where(depth[None, :] == count - 1, self.bonus.long()[:, None], drafts)
        return torch.where(depth[None, :] < count, out, -1)


class Verifier:
    def __init__(self, model: JetNemotronForCausalLM, capture_layers: tuple[int, ...] = ()) -> None:
        self.model = model
        self.capture_layers = capture_layers  # the drafter's (draft.capture_layers), to feed its catch-up
        self.constants = ShapeConstants()  # the batch's node aranges and offsets (`spec.constants`)

    def forward_batch(
        self,
        tree: DraftTree,
        prefix_lens: torch.Tensor,
        state_indices: torch.Tensor,
        kv_metadata: KVMetadataFn,
        is_chain: bool = False,
    ) -> ForwardBatch:
        """The VERIFY batch of `tree` [N, T_d]: node j of sequence i is token i*T_d + j, stored at position
        prefix_lens[i] + j, at RoPE position prefix_lens[i] + depth_j. prefix_lens [N]: tokens in the cache before
        the root. state_indices [N] int32 (slot 0: a padded row). `is_chain`: every tree is a chain (topk = 1)."""
        num_seqs, num_nodes = tree.tokens.shape
        device = tree.tokens.device
        prefix = prefix_lens.to(device, torch.long)  # [N]
        if is_chain:  # node j of a chain sits at its RoPE position, prefix + depth j
            stored = tree.positions.reshape(-1)  # [T]
        else:
            stored = (prefix[:, None] + self.constants.arange(num_nodes, device)).view(-1)  # [T]
        context = torch.empty(num_seqs, dtype=torch.int32, device=device)  # [N]
        torch.add(prefix, num_nodes, out=context)
        # Each token's state slot and context length: one widening copy each (a repeat_interleave after a `long`).
        per_token = torch.empty(2, num_seqs, num_nodes, dtype=torch.long, device=device)  # [2, N, T_d]
        per_token[0].copy_(state_indices[:, None].expand(-1, num_nodes))
        per_token[1].copy_(context[:, None].expand(-1, num_nodes))
        rows, ends = per_token.view(2, -1)  # [T] each
        kv, swa_kv = kv_metadata(stored, rows, ends, state_indices)
        return ForwardBatch(
            phase=Phase.VERIFY,
            input_ids=tree.tokens.reshape(-1),
            positions=tree.positions.reshape(-1),
            cu_seqlens=self.constants.offsets(num_seqs, num_nodes, device),
            context_lens=context,
            state_indices=state_indices.to(torch.int32),
            has_initial_state=prefix > 0,
            max_seqlen_q=num_nodes,
            kv=kv,
            swa_kv=swa_kv,
            tree_parents=tree.parents,
            tree_mask=tree.mask,
            tree_is_chain=is_chain,
            capture_layers=self.capture_layers,
        )

    def verify(
        self,
        fb: ForwardBatch,
        tree: DraftTree,
        sampling: SamplingRows | None = None,
        is_chain: bool = False,
        forced: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> VerifyOutput:
        """Run the target over the trees, accept (greedy when `sampling` is None, else per row as `tree_accept`),
        and commit the accepted paths. Draft probabilities are not used: EAGLE's top-k children are deterministic
        proposals, for which point-mass acceptance keeps the target distribution exactly. `is_chain`: every tree is
        a chain (topk = 1). Greedy acceptance and its result row are one launch after the argmax (`chain_accept_emit`
        for chains, `tree_accept_emit` for trees). `forced` (benchmarks' forced acceptance "all"): the (accepted,
        num_accepted, bonus) that replace the acceptance's result; the acceptance still runs (greedy: the same launch
        given them), so the step costs what a real one does."""
        num_seqs, num_nodes = tree.tokens.shape
        hidden = self.model(fb)  # [N*T_d, H]
        aux = list(self.model.aux_hidden_states)
        logits = self.model.compute_logits(hidden).view(num_seqs, num_nodes, -1)  # [N, T_d, V]
        result = None
        if sampling is None and is_chain:  # one launch after the argmax; padded rows (slot 0) commit nothing
            given = None if forced is None else forced[1:]  # a chain's accepted nodes follow from their count
            accepted, num_accepted, bonus, result = chain_accept_emit(
                argmax(logits), tree.tokens, fb.state_indices, given
            )
        elif sampling is None:  # the same for a tree, from its ancestor mask
            accepted, num_accepted, bonus, result = tree_accept_emit(argmax(logits), tree, fb.state_indices, forced)
        else:
            accepted, num_accepted, bonus = tree_accept(
                logits, tree.tokens, tree.parents, sampling.temperature, sampling.top_k, sampling.top_p,
                sampling.min_p, sampling.seeds, sampling.counters,
            )  # fmt: skip
            if forced is not None:
                accepted, num_accepted, bonus = forced
            # Padded rows (slot 0) commit nothing.
            num_accepted = torch.where(fb.state_indices > 0, num_accepted, 0)
        self.model.commit_verified(fb, accepted, num_accepted)
        return VerifyOutput(accepted, num_accepted, bonus, aux, result)


def next_tree_inputs(result: torch.Tensor, num_nodes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """From a verify step's result rows [N, T_d + 2] (`VerifyOutput.result`'s layout): each row's next tree root,
    the bonus token it emitted last, and how far its cached prefix moved, its accepted node count (root included).
    Both [N] int64, 0 on padded rows (which accept nothing)."""
    count = result[:, num_nodes]  # [N]
    bonus = result.gather(1, (count - 1).clamp(min=0)[:, None]).squeeze(1)  # [N]
    return torch.where(count > 0, bonus, 0), count
