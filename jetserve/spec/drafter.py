"""Drafter: runs the EAGLE-3 draft model — catches its own K/V up on committed tokens, then drafts `num_steps`
levels of `topk` children per node and keeps the best `num_draft_tokens` as a DraftTree. Device tensors throughout,
fixed shapes per (batch size, tree shape), no host synchronisation.

Draft position t holds the pair (token t + 1, target feature at t): its output predicts token t + 2. With n tokens
in the target's cache and the root (the last committed token, position n) not yet in it, the draft's cache holds
positions [0, n) and its output at n - 1 gives the root's children. A node at depth d ≥ 1 sits at draft position
n + d - 1 with input (its token, the draft output at its parent).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from jetserve.model.forward_batch import ForwardBatch, KVMetadata, Phase
from jetserve.ops.draft_rows import draft_rows
from jetserve.spec.constants import ShapeConstants
from jetserve.spec.eagle3 import Eagle3DraftModel
from jetserve.spec.tree import DraftTree, build_draft_tree, chain_buffers, expand_frontier, first_level


@dataclass
class DraftKV:
    """Where each sequence's draft K/V lives: its pages in the draft cache (logical → physical), like `attn` pages.
    Sharing the target's `attn` block table is natural: draft position t needs a page exactly when target position
    t does."""

    block_tables: torch.Tensor  # [N, P] int32
    page_size: int

    def slots(self, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Physical slots [T] int64 of `positions` [T] in the pages of sequences `rows` [T]."""
        pages = self.block_tables[rows, positions // self.page_size].long()
        return pages * self.page_size + positions % self.page_size


# Rows of at most this many tokens (the levels of `draft_tree`, a verify step's catch-up) attend through the verify
# kernel with a causal mask: its programs split each row's cached prefix and hold all of the row's tokens, where the
# prefill kernel's programs each walk the whole prefix for a few queries. Longer rows (a ring's catch-up) keep the
# prefill kernel. H200, 2B shape, chain 6, 1K prefix (session 26): the six prefill-kernel launches of a verify step
# took 216 µs at batch 1 and 752 µs at 64; through the verify kernel the step went 3.552 → 3.373 ms and 9.458 → 8.876.
ROWS_VERIFY_MAX_WIDTH = 16


class Drafter:
    def __init__(self, draft: Eagle3DraftModel, topk: int, num_steps: int, num_draft_tokens: int) -> None:
        if topk < 1 or num_steps < 1:
            raise ValueError(f"spec topk ({topk}) and num_steps ({num_steps}) must be ≥ 1")
        max_nodes = 1 + topk + (num_steps - 1) * topk * topk
        if not 2 <= num_draft_tokens <= max_nodes:
            raise ValueError(
                f"spec num_draft_tokens: {num_draft_tokens} must be in [2, {max_nodes}] for topk {topk} and "
                f"num_steps {num_steps} (the root plus the drafted candidates)"
            )
        self.draft = draft
        self.topk = topk
        self.num_steps = num_steps
        self.num_draft_tokens = num_draft_tokens
        self.constants = ShapeConstants()  # the batches' aranges, masks and fills (`spec.constants`)

    def _prefill_batch(
        self, positions: torch.Tensor, cu_seqlens: torch.Tensor, context_lens: torch.Tensor, slots: torch.Tensor,
        block_tables: torch.Tensor, max_seqlen_q: int,
    ) -> ForwardBatch:  # fmt: skip
        num_seqs, device = cu_seqlens.shape[0] - 1, positions.device
        return ForwardBatch(
            phase=Phase.PREFILL,
            input_ids=positions,  # unused by the draft (it takes input_ids as an argument)
            positions=positions,
            cu_seqlens=cu_seqlens.to(torch.int32),
            context_lens=context_lens.to(torch.int32),
            state_indices=self.constants.full((num_seqs,), 0, torch.int32, device),
            has_initial_state=self.constants.full((num_seqs,), True, torch.bool, device),
            max_seqlen_q=max_seqlen_q,
            kv=KVMetadata(slot_mapping=slots, block_tables=block_tables),
        )

    def _rows_batch(
        self, positions: torch.Tensor, num_rows: int, width: int, context_lens: torch.Tensor, slots: torch.Tensor,
        block_tables: torch.Tensor,
    ) -> ForwardBatch:  # fmt: skip
        """A draft forward of `num_rows` rows of `width` tokens each, row i's at positions context_lens[i] - width
        onward, causal among themselves: a VERIFY batch of chains while the rows are short (`ROWS_VERIFY_MAX_WIDTH`),
        else a PREFILL batch. positions [N*C], context_lens [N] (int32 or int64), slots [N*C] (-1: not stored)."""
        device = positions.device
        cu = self.constants.offsets(num_rows, width, device)  # [N + 1] int32
        if width > ROWS_VERIFY_MAX_WIDTH:
            return self._prefill_batch(positions, cu, context_lens, slots, block_tables, width)
        return dataclasses.replace(
            self._prefill_batch(positions, cu, context_lens, slots, block_tables, width),
            phase=Phase.VERIFY,
            tree_mask=self.constants.causal(num_rows, width, device),  # [N, C, C]
        )

    def extend(
        self,
        input_ids: torch.Tensor,
        aux_hidden_states: list[torch.Tensor],
        cu_seqlens: torch.Tensor,
        start_positions: torch.Tensor,
        kv: DraftKV,
        max_seqlen_q: int,
        input_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Append draft positions to the draft cache after a target prefill chunk (rows of equal width with padding,
        as after a verify step, take `extend_rows`).

        input_ids [T] (token t + 1 for draft position t), aux_hidden_states the target's features at those positions
        (one [T, H_t] per `draft.capture_layers`), cu_seqlens [N+1], start_positions [N] (draft position of each
        sequence's first new token), input_embeds [T, H] the embeddings of `input_ids` where they are not the draft's
        own (a VLM prompt's image rows; default: embed `input_ids`). Returns the draft output at each sequence's last
        token [N, H]: what `draft_tree` expands.
        """
        device = input_ids.device
        num_tokens = input_ids.shape[0]
        cu = cu_seqlens.to(device, torch.long)
        lens = cu[1:] - cu[:-1]  # [N]
        owner = torch.repeat_interleave(torch.arange(lens.shape[0], device=device), lens, output_size=num_tokens)
        starts = start_positions.to(device, torch.long)
        positions = starts[owner] + torch.arange(num_tokens, device=device) - cu[owner]  # [T]
        fb = self._prefill_batch(
            positions, cu, starts + lens, kv.slots(owner, positions), kv.block_tables, max_seqlen_q
        )
        return self.extend_in(input_ids, aux_hidden_states, dataclasses.replace(fb, last_indices=cu[1:] - 1),
                              input_embeds)  # fmt: skip

    def extend_in(
        self,
        input_ids: torch.Tensor,
        aux_hidden_states: list[torch.Tensor],
        fb: ForwardBatch,
        input_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`extend` in a PREFILL batch made already: its positions are the draft positions, its `kv` says where the
        draft's K/V goes and is found (a target PREFILL step's own batch, whose `attn` pages the draft shares), and
        its `last_indices` [N] pick the rows returned [N, H]."""
        hidden = self.draft(input_ids, self.draft.project_features(aux_hidden_states), fb, input_embeds)  # [T, H]
        return hidden[fb.last_indices]

    def extend_rows(
        self,
        input_ids: torch.Tensor,
        aux_hidden_states: list[torch.Tensor],
        start_positions: torch.Tensor,
        kv: DraftKV,
        num_valid: torch.Tensor,
        guesses: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`extend` for N rows of C tokens each (a verify step's catch-up, a flush of missed positions): its owner and
        offset of every token come from the shape instead of `cu_seqlens` (a few kernels fewer in the graphs that
        capture it). input_ids [N, C], aux_hidden_states one [N*C, H_t] per capture layer (row-major), start_positions
        [N] int64, num_valid [N]: the first num_valid tokens of a row are stored and count. Returns [N, H], each row's
        output at its last valid token (a row with none stores nothing; its output row is meaningless). `guesses`
        [N, C] int64, when given, gets the draft's top token at every position: the first draft of a chain grown from
        the position after it (what `draft_tree` would draft there)."""
        num_seqs, width = input_ids.shape
        # Padding tokens (offset ≥ num_valid) take their row's last valid position, so their RoPE and page lookups stay
        # inside what the sequence holds; they write nothing, and causality hides them from the valid tokens. One
        # launch on the GPU (`ops.draft_rows`), where the same arithmetic in torch took ~14 of the verify graph's.
        positions, slots, last, context_lens = draft_rows(start_positions, num_valid, kv.block_tables, width,
                                                          kv.page_size)  # [N, C], [N, C], [N], [N]  # fmt: skip
        fb = self._rows_batch(positions.view(-1), num_seqs, width, context_lens, slots.view(-1), kv.block_tables)
        hidden = self.draft(input_ids.reshape(-1), self.draft.project_features(aux_hidden_states), fb)  # [N*C, H]
        if guesses is not None:
            guesses.copy_(self.draft.top_candidate(hidden)[1].view(num_seqs, width))
        return hidden.view(num_seqs, width, -1)[self.constants.arange(num_seqs, input_ids.device), last]

    def extend_after_verify(
        self,
        tree: DraftTree,
        accepted_nodes: torch.Tensor,
        num_accepted: torch.Tensor,
        emitted: torch.Tensor,
        aux_hidden_states: list[torch.Tensor],
        kv: DraftKV,
        is_chain: bool = False,
    ) -> torch.Tensor:
        """Catch up on a verify step: accepted nodes a_0 (the root) .. a_{m-1} become draft positions
        root position + [0, m) with inputs (token of a_{k+1}, or the bonus for the last; the target's feature at a_k).
        Fixed shape: T_d tokens per sequence, the ones past m padding. Returns [N, H] for the next `draft_tree`.

        tree the verified DraftTree [N, T_d], accepted_nodes [N, T_d] / num_accepted [N] from tree acceptance,
        emitted [N, T_d] its emitted tokens (`VerifyOutput.emitted_tokens`: token k is exactly draft position k's
        input), aux_hidden_states the verify step's features (one [N*T_d, H_t] per capture layer). `is_chain`: every
        tree is a chain (topk = 1), whose accepted path is always nodes 0 .. m-1, so the features are taken as they
        are instead of gathered (the padding tokens past m see other features, and are neither stored nor read).
        """
        num_seqs, num_nodes = tree.tokens.shape
        if is_chain:
            features = list(aux_hidden_states)
        else:
            nodes = accepted_nodes.long().clamp(min=0)  # [N, T_d]
            flat = (self.constants.arange(num_seqs, nodes.device)[:, None] * num_nodes + nodes).view(-1)  # [N*T_d]
            features = [aux[flat] for aux in aux_hidden_states]
        input_ids = emitted.clamp(min=0)  # [N, T_d]: the -1 padding becomes a token id the padding rows ignore
        return self.extend_rows(input_ids, features, tree.positions[:, 0], kv, num_accepted)

    def draft_tree(
        self,
        last_hidden: torch.Tensor,
        root_tokens: torch.Tensor,
        root_positions: torch.Tensor,
        kv: DraftKV,
        out: DraftTree | None = None,
    ) -> DraftTree:
        """Draft the tree below each root: last_hidden [N, H] (from `extend`), root_tokens [N], root_positions [N]
        (= tokens in the target's cache; the draft cache holds positions [0, root_position)). Into `out` [N, T_d]
        when given (a graph's static tree), which is returned: a chain writes its tokens, positions and scores there
        directly, so `out` must come from `chain_buffers` (its parents, depths, mask and root scores are kept); a
        tree is copied in whole.

        Level d + 1 re-runs, for each of the k frontier nodes, the chain of its d + 1 draft inputs over the draft
        cache (nothing is stored), so sibling branches never see each other. The draft is one layer, so this costs
        a few dozen tokens per sequence and keeps the cache append-only.
        """
        if self.topk == 1:
            if out is None:
                out = chain_buffers(root_tokens.shape[0], self.num_draft_tokens, last_hidden.device, self.constants)
            return self._draft_chain(last_hidden, root_tokens, root_positions, kv, out)
        tree = self._draft_levels(last_hidden, root_tokens, root_positions, kv)
        if out is None:
            return tree
        for f in dataclasses.fields(DraftTree):
            getattr(out, f.name).copy_(getattr(tree, f.name))
        return out

    def _draft_levels(
        self, last_hidden: torch.Tensor, root_tokens: torch.Tensor, root_positions: torch.Tensor, kv: DraftKV
    ) -> DraftTree:
        """`draft_tree` for any topk: every level's candidates, then the best `num_draft_tokens - 1` kept."""
        k = self.topk
        num_seqs, hidden_size = last_hidden.shape
        device = last_hidden.device
        logprobs, tokens = self.draft.top_candidates(last_hidden, k)  # [N, k] each
        level, frontier_index, frontier_scores = first_level(logprobs, tokens)
        levels = [level]
        # Each candidate's chain of draft inputs from depth 1 down to itself: tokens [N, C, d], hidden [N, C, d, H].
        chain_tokens = tokens[:, :, None]
        chain_hidden = last_hidden[:, None, None, :].expand(-1, k, 1, -1)
        # [N*k]: the sequence of each branch
        rows = self.constants.get(("branch rows", num_seqs, k), device,
                                  lambda: torch.arange(num_seqs, device=device).repeat_interleave(k))  # fmt: skip
        roots = root_positions.to(device, torch.long)
        for depth in range(1, self.num_steps):
            pick = frontier_index[:, :, None]  # [N, k, 1]
            branch_tokens = chain_tokens.gather(1, pick.expand(-1, -1, depth))  # [N, k, d]
            branch_hidden = chain_hidden.gather(1, pick[..., None].expand(-1, -1, depth, hidden_size))  # [N, k, d, H]
            # [N, k, d] made dense: with N = 1 the expanded view would flatten to a stride-0 vector
            positions = (roots[:, None, None] + self.constants.arange(depth, device)).expand(-1, k, -1).contiguous()
            fb = self._rows_batch(
                positions.reshape(-1), num_seqs * k, depth, roots[rows] + depth,
                self.constants.full((num_seqs * k * depth,), -1, torch.long, device), kv.block_tables[rows],
            )  # fmt: skip
            out = self.draft(branch_tokens.reshape(-1), branch_hidden.reshape(-1, hidden_size), fb)  # [N*k*d, H]
            frontier_out = out.view(num_seqs, k, depth, hidden_size)[:, :, -1]  # [N, k, H]
            child_lp, child_tokens = self.draft.top_candidates(frontier_out.reshape(-1, hidden_size), k)
            level, next_index, next_scores = expand_frontier(
                frontier_scores, frontier_index, child_lp.view(num_seqs, k, k), child_tokens.view(num_seqs, k, k)
            )
            levels.append(level)
            # Children's chains: the parent's chain plus (child token, the parent's output).
            chain_tokens = torch.cat(
                [branch_tokens[:, :, None].expand(-1, -1, k, -1), child_tokens.view(num_seqs, k, k, 1)], dim=3
            ).reshape(num_seqs, k * k, depth + 1)
            parent_out = frontier_out[:, :, None, None, :].expand(-1, -1, k, 1, -1)  # [N, k, k, 1, H]
            chain_hidden = torch.cat([branch_hidden[:, :, None].expand(-1, -1, k, -1, -1), parent_out], dim=3).reshape(
                num_seqs, k * k, depth + 1, hidden_size
            )
            frontier_index, frontier_scores = next_index, next_scores
        return build_draft_tree(root_tokens, levels, self.num_draft_tokens, roots)

    def _draft_chain(
        self,
        last_hidden: torch.Tensor,
        root_tokens: torch.Tensor,
        root_positions: torch.Tensor,
        kv: DraftKV,
        out: DraftTree,
    ) -> DraftTree:
        """`draft_tree` for topk = 1 into `out` (`chain_buffers`): the same chain as the general path, without its
        selection. A chain's cumulative log-probs fall with depth, so the best `num_draft_tokens - 1` candidates are
        its first levels: only those are drafted. Level d + 1 re-runs the chain's d inputs (nothing is stored) and
        keeps the last output; the top-1 token is one reduction (no sort) written into its column of `out`, whose
        parents, depths and mask are a chain's already. Session 19 measured the general path's bookkeeping at ~100 of
        the 193 kernels of the default pair's chain-3 draft graph (sorts, gathers, the ancestor mask); writing in
        place saves the levels' stacks and a graph's copies of the tree (session 46)."""
        num_seqs, hidden_size = last_hidden.shape
        device = last_hidden.device
        levels = self.num_draft_tokens - 1
        roots = root_positions.to(device, torch.long)  # [N]
        # Node j sits at position root + j, and level d's chain inputs at the first d of them; level d's context
        # lengths are row d - 1 of [levels, N] int32, rows contiguous as a batch's context_lens are.
        torch.add(roots[:, None], self.constants.arange(levels + 1, device), out=out.positions)  # [N, T_d]
        ends = torch.empty(levels, num_seqs, dtype=torch.int32, device=device)
        torch.add(roots[None, :], self.constants.arange(levels + 1, device)[1:, None], out=ends)
        out.tokens[:, 0].copy_(root_tokens)
        # Each level's log-prob lands in its column of the scores, summed along the chain at the end (the root's 0
        # stays).
        self.draft.top_candidate(last_hidden, out=(out.scores[:, 1], out.tokens[:, 1]))
        chain_hidden = last_hidden[:, None, :]  # [N, 1, H]: the draft inputs' hidden part, depth 1 .. d
        for depth in range(1, levels):
            fb = self._rows_batch(
                out.positions[:, :depth].reshape(-1), num_seqs, depth, ends[depth - 1],
                self.constants.full((num_seqs * depth,), -1, torch.long, device), kv.block_tables,
            )  # fmt: skip
            chain_tokens = out.tokens[:, 1 : depth + 1].reshape(-1)  # [N*d]: a view (strided at depth 1)
            normed, hidden = self.draft.forward_normed(chain_tokens, chain_hidden.reshape(-1, hidden_size), fb)
            last = hidden.view(num_seqs, depth, hidden_size)[:, -1]  # [N, H]
            self.draft.top_candidate(normed.view(num_seqs, depth, hidden_size)[:, -1], normed=True,
                                     out=(out.scores[:, depth + 1], out.tokens[:, depth + 1]))  # fmt: skip
            chain_hidden = torch.cat([chain_hidden, last[:, None, :]], dim=1)  # [N, d + 1, H]
        out.scores.cumsum_(dim=1)  # [N, T_d]: cumulative log-probs
        return out
