"""Scheduler: continuous batching with chunked prefill, decode first, and preemption by recompute."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from jetserve.engine.block_manager import BlockManager
from jetserve.engine.sequence import FinishReason, Sequence, SequenceStatus
from jetserve.engine.state_pool import StatePool
from jetserve.model.forward_batch import Phase


@dataclass
class Batch:
    """One step's work, on the host: which sequences run and how many of their uncomputed tokens each brings.

    Sequence i computes tokens `[start_positions[i], start_positions[i] + num_new_tokens[i])`; when that reaches
    its last token (`is_sampling[i]`), the step samples its next token. DECODE: every sequence brings its one last
    token onto a cache that holds the rest; PREFILL: anything else (prompt chunks, recomputation, and decode rows
    riding along as one-token chunks). VERIFY: like DECODE, but each sequence's last token is the root of a draft
    tree of `num_draft_tokens` nodes (draft shape `draft_shape` of the speculative decoder), whose pages are
    reserved; the step may add several tokens per sequence.
    """

    phase: Phase
    seqs: list[Sequence]
    num_new_tokens: list[int]
    num_draft_tokens: int = 0  # VERIFY: tree nodes per sequence (T_d), root included
    draft_shape: int = -1  # VERIFY: which of the speculative decoder's draft shapes
    start_positions: list[int] = field(init=False)  # [N]: each sequence's num_computed_tokens when scheduled
    is_sampling: list[bool] = field(init=False)  # [N]: the step reaches the sequence's last token

    def __post_init__(self) -> None:
        assert len(self.seqs) == len(self.num_new_tokens) and self.seqs
        self.start_positions = [s.num_computed_tokens for s in self.seqs]
        pairs = zip(self.seqs, self.num_new_tokens, strict=True)
        self.is_sampling = [s.num_computed_tokens + n == s.num_tokens for s, n in pairs]

    @property
    def num_seqs(self) -> int:
        return len(self.seqs)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


class VerifyPlanner(Protocol):
    """What the scheduler asks the speculative decoder (engine/speculative.py) when a step would decode."""

    def verify_options(self, seqs: list[Sequence]) -> list[tuple[int, int]]:
        """(draft shape, T_d) pairs to try for a VERIFY step of `seqs`, preferred first; empty for plain DECODE."""
        ...


class Scheduler:
    """Owns the waiting queue and the running set, and hands out pages (BlockManager) and state slots (StatePool).

    Each step fills a budget of `max_num_batched_tokens`: running sequences that are decoding first (one token
    each), then running prefills (oldest first, the last one's chunk cut to the budget), then waiting sequences in
    arrival order while a slot and pages are free. When a running sequence cannot get pages, the newest running
    sequence is preempted — its pages and slot freed, its tokens kept — and waits at the front of the queue to be
    recomputed; the oldest sequence therefore always progresses, and nothing is lost.

    With a `verify_planner` (speculative decoding), a step where every sequence decodes becomes a VERIFY step when
    the planner offers a draft shape whose tree fits: T_d tokens of budget per sequence, the context length, and
    free pages (speculation never preempts anyone; without room the step decodes plainly).
    """

    def __init__(
        self,
        block_manager: BlockManager,
        state_pool: StatePool,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        eos_token_ids: tuple[int, ...] = (),
        verify_planner: VerifyPlanner | None = None,
        max_model_len: int | None = None,
    ) -> None:
        self.block_manager = block_manager
        self.state_pool = state_pool
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.verify_planner = verify_planner
        self.max_model_len = max_model_len or block_manager.max_tokens_per_seq

    def add(self, seq: Sequence) -> None:
        assert seq.status == SequenceStatus.WAITING and seq.num_computed_tokens == 0
        assert seq.num_prompt_tokens + seq.max_output_tokens <= self.block_manager.max_tokens_per_seq + 1, (
            "a sequence that cannot fit the whole page pool would never finish"
        )
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def can_admit(self) -> bool:
        """Whether a schedule now would admit the head of the waiting queue, as far as the running set decides: a
        free slot, room under `max_num_seqs` and in the token budget beside one decode token per running sequence,
        and a free page. The engine stops launching decode steps ahead when it would (a full server keeps them)."""
        if not self.waiting:
            return False
        num_running = len(self.running)
        return (
            self.state_pool.num_free_slots > 0
            and num_running < self.max_num_seqs
            and num_running < self.max_num_batched_tokens
            and self.block_manager.num_fitting_tokens(self.waiting[0]) > 0
        )

    def schedule(self) -> Batch | None:
        budget = self.max_num_batched_tokens
        seqs: list[Sequence] = []
        counts: list[int] = []
        queue = deque(sorted(self.running, key=lambda s: (not s.is_decoding, s.seq_id)))
        preempted = False
        while queue and budget > 0 and len(seqs) < self.max_num_seqs:
            seq = queue.popleft()
            n = min(seq.num_uncomputed_tokens, budget)
            while self.block_manager.num_fitting_tokens(seq) < n:
                fitting = self.block_manager.num_fitting_tokens(seq)
                if fitting > 0 and not seq.is_decoding:
                    n = fitting  # a prefill chunk shrinks to the free pages rather than evict anyone
                    break
                preempted = True
                if not queue:
                    self._preempt(seq)
                    n = 0
                    break
                self._preempt(queue.pop())
            if n == 0:
                break
            self.block_manager.append(seq, n)
            seqs.append(seq)
            counts.append(n)
            budget -= n
        # Admitting right after a preemption would hand the freed pages straight back and thrash.
        while not preempted and self.waiting and budget > 0 and len(seqs) < self.max_num_seqs:
            seq = self.waiting[0]
            n = min(seq.num_uncomputed_tokens, budget, self.block_manager.num_fitting_tokens(seq))
            if n <= 0 or self.state_pool.num_free_slots == 0 or len(self.running) >= self.max_num_seqs:
                break
            self.waiting.popleft()
            seq.slot = self.state_pool.allocate()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self.block_manager.append(seq, n)
            seqs.append(seq)
            counts.append(n)
            budget -= n
        if not seqs:
            return None
        is_decode = all(s.is_decoding for s in seqs)
        if is_decode and self.verify_planner is not None:
            verify = self._plan_verify(seqs)
            if verify is not None:
                return verify
        return Batch(Phase.DECODE if is_decode else Phase.PREFILL, seqs, counts)

    def _plan_verify(self, seqs: list[Sequence]) -> Batch | None:
        """A VERIFY batch of `seqs` (each already holding the page of its root) with the first draft shape whose
        tree fits the token budget, the context and the free pages; None to decode plainly."""
        assert self.verify_planner is not None
        # A tree stores nodes at positions [n, n + T_d): they must stay inside the context.
        room = min(self.max_model_len - s.num_computed_tokens for s in seqs)
        for shape, num_nodes in self.verify_planner.verify_options(seqs):
            if num_nodes < 2 or num_nodes > room or num_nodes * len(seqs) > self.max_num_batched_tokens:
                continue
            needed = sum(self.block_manager.pages_needed(s, num_nodes) for s in seqs)
            if needed > self.block_manager.num_free_pages:
                continue
            for seq in seqs:
                self.block_manager.append(seq, num_nodes)
            return Batch(Phase.VERIFY, seqs, [1] * len(seqs), num_draft_tokens=num_nodes, draft_shape=shape)
        return None

    def postprocess(self, batch: Batch, token_ids: list[int]) -> list[Sequence]:
        """Advance every sequence of `batch` and append the sampled token where it sampled (`token_ids[i]`, one per
        sequence; ignored where it did not). Finishes sequences on EOS, a stop token or their length limit.
        Returns the sequences that got a token."""
        assert len(token_ids) == batch.num_seqs
        updated = []
        for seq, n, sampled, token in zip(batch.seqs, batch.num_new_tokens, batch.is_sampling, token_ids, strict=True):
            assert seq.status == SequenceStatus.RUNNING, f"{seq} left the running set during its step"
            seq.num_computed_tokens += n
            if not sampled:
                continue
            self._append_token(seq, token)
            updated.append(seq)
        return updated

    def postprocess_verify(self, batch: Batch, emitted: list[list[int]], num_kept: int = 1) -> list[Sequence]:
        """Advance every sequence of a VERIFY `batch` by the tokens it accepted: `emitted[i]` is sequence i's
        accepted drafts then its bonus token (≥ 1 token). The root and the accepted drafts are now cached; the pages
        past the next `num_kept` tokens go back (the rejected nodes': 1 keeps the bonus token's page; a verify step
        launched ahead keeps its tree's, T_d). Tokens are appended one by one with the stop checks of `postprocess`,
        so a stop token or the length limit inside the accepted path cuts it there. Returns the sequences (all got
        tokens)."""
        assert batch.phase is Phase.VERIFY and len(emitted) == batch.num_seqs
        for seq, tokens in zip(batch.seqs, emitted, strict=True):
            assert seq.status == SequenceStatus.RUNNING and seq.is_decoding, f"{seq} is not decoding"
            assert tokens, f"{seq}: a verify step emits at least the bonus token"
            # The root plus the accepted drafts (all but the bonus) are in the caches now.
            seq.num_computed_tokens += len(tokens)
            self.block_manager.trim(seq, seq.num_computed_tokens + num_kept)
            for token in tokens:
                self._append_token(seq, token)
                if seq.is_finished:
                    break
        return list(batch.seqs)

    def _append_token(self, seq: Sequence, token: int) -> None:
        """Append a generated token to `seq`, finishing it on EOS, a stop token or its length limit."""
        seq.token_ids.append(token)
        params = seq.sampling_params
        if token in params.stop_token_ids:
            self.finish(seq, FinishReason.STOP, token)
        elif not params.ignore_eos and token in self.eos_token_ids:
            self.finish(seq, FinishReason.STOP)
        elif seq.num_output_tokens >= seq.max_output_tokens:
            self.finish(seq, FinishReason.LENGTH)

    def finish(self, seq: Sequence, reason: FinishReason, stop_reason: int | str | None = None) -> None:
        """End `seq` now, freeing its pages and slot (whether it is running or waiting)."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
            self._release(seq)
        elif seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason

    def abort(self, request_id: str) -> Sequence | None:
        """Finish the request `request_id` with reason ABORT; None when it is not queued or running."""
        for seq in (*self.running, *self.waiting):
            if seq.request_id == request_id:
                self.finish(seq, FinishReason.ABORT)
                return seq
        return None

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _release(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        self.state_pool.free(seq.slot)
        seq.slot = 0
