"""ModelRunner: owns the K/V caches, turns a Batch into a ForwardBatch, runs the model and samples (→ StepOutput)."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from jetserve.engine.host_copy import HostCopy, start_host_copy
from jetserve.engine.memory_plan import MemoryPlan, ring_tokens_for
from jetserve.engine.prefill_graph import PrefillGraphs
from jetserve.engine.sampler import Sampler
from jetserve.engine.scheduler import Batch
from jetserve.engine.sequence import Sequence, TokenLogprobs
from jetserve.engine.staging import UploadRing
from jetserve.engine.state_pool import StatePool
from jetserve.model.forward_batch import ForwardBatch, KVMetadata, Phase
from jetserve.model.jet_nemotron import JetNemotronForCausalLM
from jetserve.multimodal.inputs import spliced_input_embeds
from jetserve.ops.gated_delta_rule.chunk_table import CHUNK_SIZE, DeltaRuleChunks
from jetserve.ops.kv_metadata import kv_metadata
from jetserve.ops.sampling import compute_logprobs, top_logprobs

if TYPE_CHECKING:
    from jetserve.engine.speculative import SpecDecoder, VerifyLaunch


def _inference(fn):
    """`torch.inference_mode` for a step's entry points, entered only when the caller (`LLMEngine.step`, itself in
    inference mode) has not: entering it again cost ~2 µs of every decode step's host time."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if torch.is_inference_mode_enabled():
            return fn(*args, **kwargs)
        with torch.inference_mode():
            return fn(*args, **kwargs)

    return wrapper


@dataclass
class StepOutput:
    """What one step produced, on the host: a token per sequence of the batch (meaningful where it sampled)."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None] | None = None  # per sequence, where the request asked for them
    prompt_logprobs: dict[int, list[TokenLogprobs]] = field(default_factory=dict)  # batch row → new prompt positions
    emitted: list[list[int]] | None = None  # VERIFY: per sequence, its accepted drafts then its bonus token


@dataclass(frozen=True)
class PrefillLayout:
    """The shape of a PREFILL step's host rows (`ModelRunner.prefill_host_rows`): what its device part is built for."""

    num_tokens: int  # T (a graph's bucket: T_b, pad tokens included)
    num_seqs: int  # N (a graph's: N_b, empty and padding rows included)
    num_chunks: int  # rows of the delta rule's chunk table
    num_cols: int  # block-table columns passed to the attention layers
    max_seqlen_q: int  # the most new tokens of one sequence (a graph's: T_b), for launch grids
    fresh: bool  # no sequence starts from a stored state (`DeltaRuleChunks.fresh`)


@dataclass(frozen=True)
class DraftPrefillInputs:
    """A speculating PREFILL step's device rows for the draft's catch-up, from the step's one upload."""

    next_ids: torch.Tensor  # [T] int64: token t + 1 for each new position t, -1 where it is the token sampled here
    owner: torch.Tensor  # [T] int64: the batch row of each token
    slots: torch.Tensor  # [N] int64: state slots


@dataclass
class DecodeLaunch:
    """A DECODE step queued on the device: its sequences, its inputs and sampled tokens (device tensors, which a
    following step can take its inputs from), and the tokens' copy to the host, started right behind the sampler so
    that reading them waits for this step only."""

    seqs: list[Sequence]
    tokens: torch.Tensor  # [N] int64: sampled
    positions: torch.Tensor  # [N] int64: the position each sequence cached (may be the decode graph's static input)
    state_indices: torch.Tensor  # [N]
    slots_host: np.ndarray  # [N] int64: `state_indices` on the host
    positions_host: np.ndarray  # [N] int64: `positions` on the host
    host_tokens: HostCopy  # [N] int64: `tokens`' copy to the host, started

    @classmethod
    def start(
        cls,
        seqs: list[Sequence],
        tokens: torch.Tensor,
        positions: torch.Tensor,
        state_indices: torch.Tensor,
        slots_host: np.ndarray,
        positions_host: np.ndarray,
    ) -> DecodeLaunch:
        """Start copying `tokens` to the host without waiting for them."""
        return cls(seqs, tokens, positions, state_indices, slots_host, positions_host, start_host_copy(tokens))

    @property
    def option(self) -> int:
        """The adaptive policy's option this step ran: plain decoding."""
        return -1

    def next_rows(self, keep: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """The slots [N] and the positions [N] cached by the decode step after this one, for its rows `keep`."""
        if len(keep) == len(self.seqs):
            return self.slots_host, self.positions_host + 1
        return self.slots_host[keep], self.positions_host[keep] + 1

    def token_ids(self) -> list[int]:
        """The sampled tokens, one per sequence (waits for the step to finish on the device)."""
        return self.host_tokens.read()


class ModelRunner:
    """Allocates the K/V caches (the StatePool holds the JetBlock state), binds both to the model, and runs steps.

    The host work of a step is building index lists once (token ids, positions, per-sequence offsets and slots)
    and one copy to the device; everything derived from them (K/V slot mapping, block tables, sampling rows) is
    computed on the device from tables indexed by state slot. The one synchronisation is reading the sampled tokens;
    a DECODE step can be launched without it (`launch_decode`, then `launch_next` for the step after, whose inputs
    are the first one's tokens on the device) and its tokens read later (`DecodeLaunch.token_ids`); likewise a VERIFY
    step (`launch_verify`, then `launch_verify_next`, whose inputs are the first one's result on the device).

    With a SpecDecoder attached (`attach_spec`), PREFILL and DECODE steps also capture the draft's target features;
    PREFILL steps catch the draft up on the positions they cached, DECODE steps leave their features to the
    SpecDecoder for a later catch-up (`store_features`, inside the decode graph), and VERIFY steps run through the
    SpecDecoder.
    """

    def __init__(self, model: JetNemotronForCausalLM, plan: MemoryPlan, state_pool: StatePool) -> None:
        config = model.config
        weight = model.model.embed_tokens.weight
        self.model = model
        self.config = config
        self.plan = plan
        self.device = weight.device
        self.dtype = weight.dtype
        self.page_size = plan.page_size
        self.has_attn = "attn" in config.layer_types
        self.has_swa = "swa" in config.layer_types
        kv_shape = (config.num_key_value_heads, config.head_dim)
        ring_pages = plan.ring_tokens // plan.page_size
        self.kv_caches: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for layer, kind in enumerate(config.layer_types):
            if kind == "jet":
                continue
            num_pages = plan.num_pages if kind == "attn" else plan.num_slots * ring_pages
            shape = (num_pages, plan.page_size, *kv_shape)  # [num_pages, page_size, HK, Dh]
            self.kv_caches[layer] = (self._zeros(shape), self._zeros(shape))
        model.bind_caches(self.kv_caches, *state_pool.layer_states())
        # Logical → physical `attn` page of the sequence in each slot; row 0 (the padding slot) stays all page 0.
        self.block_table = torch.zeros(
            plan.num_slots, plan.max_pages_per_seq, dtype=torch.int32, device=self.device
        )  # [S, P]
        # (seq_id, num_preemptions) whose pages/params the slot's rows hold
        self._slot_owner: list[tuple[int, int] | None] = [None] * plan.num_slots
        self._slot_synced_pages = [0] * plan.num_slots
        self.sampler = Sampler(plan.num_slots, self.device)
        self.uploads = UploadRing(self.device)  # every upload's pinned staging
        self._size_decode_constants(plan.num_slots)
        self.graph_runner = None  # a GraphRunner once `capture_graphs` ran
        self.prefill_graphs: PrefillGraphs | None = None  # once `use_prefill_graphs` ran
        self.spec: SpecDecoder | None = None
        self.capture_layers: tuple[int, ...] = ()  # target layers whose inputs the draft reads (with a SpecDecoder)

    def attach_spec(self, spec: SpecDecoder) -> None:
        """Turn speculative decoding on (before `capture_graphs`)."""
        assert self.graph_runner is None, "attach the SpecDecoder before capturing graphs"
        self.spec = spec
        self.capture_layers = spec.capture_layers

    def _zeros(self, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.zeros(shape, dtype=self.dtype, device=self.device)

    # ---- the step ----

    @_inference
    def run(self, batch: Batch) -> StepOutput:
        """Run one step of any phase and wait for its tokens (the synchronous path)."""
        seqs = batch.seqs
        if batch.phase is Phase.DECODE:
            launch, logits = self._launch_decode(batch)
            out = StepOutput(launch.token_ids())
            if any(s.sampling_params.logprobs is not None for s in seqs):
                out.logprobs = self._token_logprobs(logits, launch.tokens, out.token_ids, seqs)
            return out
        slots = self._claim(seqs)
        if batch.phase is Phase.VERIFY:
            assert self.spec is not None, "a VERIFY batch needs a SpecDecoder"
            emitted = self.spec.run_verify(seqs, slots, batch.draft_shape, self.sampler.is_all_greedy(slots))
            return StepOutput([tokens[-1] for tokens in emitted], emitted=emitted)
        bucket = self.prefill_graphs.bucket(batch) if self.prefill_graphs is not None else None
        if bucket is not None:
            return self._run_prefill_graph(batch, slots, bucket)
        fb, counters, draft_inputs = self.prefill_forward_batch(batch, slots)
        images = [s.images for s in seqs]
        embedding = self.model.model.embed_tokens
        input_embeds = spliced_input_embeds(embedding, fb.input_ids, images, batch.start_positions,
                                            batch.num_new_tokens)  # fmt: skip
        hidden = self.model(fb, input_embeds)  # [T, hidden]; input_embeds None unless the chunks hold images
        logits = self.model.compute_logits(hidden[fb.last_indices])  # [N, V]
        tokens = self.sampler(logits, fb.state_indices, counters, slots)  # [N]
        copy = start_host_copy(tokens)  # before the draft's catch-up: the tokens are read without waiting for it
        if draft_inputs is not None:
            self._catch_up_prefill(batch, fb, tokens, slots, draft_inputs)
        out = StepOutput(copy.read())
        if any(s.sampling_params.logprobs is not None for s in seqs):
            out.logprobs = self._token_logprobs(logits, tokens, out.token_ids, seqs)
        if any(s.wants_prompt_logprobs for s in seqs):
            out.prompt_logprobs = self._prompt_logprobs(hidden, batch)
        return out

    def _run_prefill_graph(self, batch: Batch, slots: np.ndarray, bucket: int) -> StepOutput:
        """A PREFILL step replayed from its bucket's graphs (`engine.prefill_graph`; no prompt log-probs, no image
        rows)."""
        graphs = self.prefill_graphs
        fb, counters, logits = graphs.run(batch, slots, bucket)  # [N] rows
        into = graphs.sampled_tokens(len(batch.seqs)) if self.spec is not None else None
        tokens = self.sampler(logits, fb.state_indices[: len(batch.seqs)], counters, slots, out=into)  # [N]
        copy = start_host_copy(tokens)  # before the draft's catch-up: the tokens are read without waiting for it
        if self.spec is not None:
            self.spec.before_prefill(batch.seqs, slots, batch.start_positions, batch.num_new_tokens)
            graphs.catch_up(bucket)
        out = StepOutput(copy.read())
        if any(s.sampling_params.logprobs is not None for s in batch.seqs):
            out.logprobs = self._token_logprobs(logits, tokens, out.token_ids, batch.seqs)
        return out

    @_inference
    def launch_decode(self, batch: Batch) -> DecodeLaunch:
        """Queue a DECODE step on the device and return without waiting for its tokens."""
        return self._launch_decode(batch)[0]

    @_inference
    def launch_next(
        self, prev: DecodeLaunch, keep: list[int], seqs: list[Sequence], slots: np.ndarray, positions: np.ndarray
    ) -> DecodeLaunch:
        """Queue the decode step that follows `prev` for its rows `keep` (ascending), whose sequences `seqs` already
        hold the pages of one more token: each row's input is the token `prev` sampled, at the next position, in the
        same slot — all taken on the device, so this queues behind `prev` without waiting for it. `slots` and
        `positions` [N] are the rows' slots and the positions this step caches, on the host
        (`DecodeLaunch.next_rows`). With a SpecDecoder, the caller caught up any draft ring this step would wrap
        (`SpecDecoder.plan_decode_ahead`); the step stores its features in the ring as any plain step does."""
        assert keep and len(keep) == len(seqs) and keep[-1] < len(prev.seqs)
        self._claim_slots(seqs, slots)  # writes the new pages into the block table
        self.sampler.sync()
        if len(keep) == len(prev.seqs):
            graphs = self.graph_runner
            if graphs is not None and graphs.holds(prev.state_indices):
                # The decode graph's inputs hold the step after `prev` for its rows (the graph wrote them): replay.
                logits, positions_d = graphs.run_next(prev.tokens)  # [N, V], [N]
                return self._sampled(seqs, slots, positions, logits, positions_d, prev.state_indices, is_graphed=True)
            input_ids, positions_d, state_indices = prev.tokens, prev.positions + 1, prev.state_indices
        else:
            (rows,) = self.upload(np.array([keep], dtype=np.int64))  # [N]
            input_ids, state_indices = prev.tokens[rows], prev.state_indices[rows]
            positions_d = prev.positions[rows] + 1
        return self._decode(seqs, slots, positions, input_ids, positions_d, state_indices)[0]

    @_inference
    def launch_verify(self, batch: Batch) -> VerifyLaunch:
        """Queue a VERIFY step on the device and return without waiting for its result."""
        assert self.spec is not None and batch.phase is Phase.VERIFY, "a VERIFY batch needs a SpecDecoder"
        slots = self._claim(batch.seqs)
        return self.spec.launch_verify(batch.seqs, slots, batch.draft_shape, self.sampler.is_all_greedy(slots))

    @_inference
    def launch_verify_next(self, prev: VerifyLaunch) -> VerifyLaunch:
        """Queue the VERIFY step that follows `prev` for the same sequences, which already hold the pages of its
        longest accepted path and the next tree: its inputs are taken from `prev`'s result on the device
        (`SpecDecoder.launch_verify_next`), so this queues behind `prev` without waiting for it."""
        self._claim_slots(prev.seqs, prev.slots_host)  # writes the new pages into the block table
        self.sampler.sync()
        return self.spec.launch_verify_next(prev)

    def _claim(self, seqs: list[Sequence]) -> np.ndarray:
        """The state slots of `seqs` [N], after bringing the slot-indexed tables (pages, sampling) up to date."""
        slots = np.fromiter((s.slot for s in seqs), dtype=np.int64, count=len(seqs))  # [N]
        self._claim_slots(seqs, slots)
        self.sampler.sync()
        return slots

    def _launch_decode(self, batch: Batch) -> tuple[DecodeLaunch, torch.Tensor]:
        """Queue a DECODE step whose inputs come from the host (each sequence's last token, its cached length, its
        slot); returns the launch and its logits [N, V] (valid until the next decode step: a graph's buffer)."""
        seqs = batch.seqs
        slots = self._claim(seqs)
        host = np.empty((3, len(seqs)), dtype=np.int64)
        host[0] = [s.token_ids[-1] for s in seqs]
        host[1] = [s.num_computed_tokens for s in seqs]
        host[2] = slots
        if self.spec is not None:
            self.spec.before_decode(seqs, slots, host[1])
        graphs = self.graph_runner
        if graphs is not None and graphs.fits(len(seqs)):  # the inputs go straight into the graph's block
            logits, positions, state_indices = graphs.run_host(host)  # [N, V], [N], [N]
            return self._sampled(seqs, slots, host[1], logits, positions, state_indices, is_graphed=True), logits
        input_ids, positions, state_indices = self.upload(host)
        return self._decode(seqs, slots, host[1], input_ids, positions, state_indices)

    def _decode(
        self,
        seqs: list[Sequence],
        slots: np.ndarray,  # [N] the same slots as `state_indices`, on the host
        positions_host: np.ndarray,  # [N] `positions` on the host
        input_ids: torch.Tensor,  # [N] int64
        positions: torch.Tensor,  # [N] int64: the position each sequence caches
        state_indices: torch.Tensor,  # [N]
    ) -> tuple[DecodeLaunch, torch.Tensor]:
        """The decode forward (a CUDA graph where one fits, else eager) and the sampler, queued on the device; the
        tokens' copy to the host starts right behind them. Returns the launch and the logits [N, V]."""
        is_graphed = self.graph_runner is not None and self.graph_runner.fits(len(seqs))
        if is_graphed:
            logits = self.graph_runner.run(input_ids, positions, state_indices)  # [N, V]
        else:
            logits = self.decode_logits(input_ids, positions, state_indices)  # [N, V]
            if self.spec is not None:  # a decode graph stores them as it replays
                self.spec.store_features(positions, state_indices, self.model.aux_hidden_states)
        return self._sampled(seqs, slots, positions_host, logits, positions, state_indices, is_graphed), logits

    def _sampled(
        self,
        seqs: list[Sequence],
        slots: np.ndarray,  # [N] on the host
        positions_host: np.ndarray,  # [N] on the host
        logits: torch.Tensor,  # [N, V]
        positions: torch.Tensor,  # [N] int64: the position each sequence caches
        state_indices: torch.Tensor,  # [N]
        is_graphed: bool,
    ) -> DecodeLaunch:
        """The decode step's tokens — the graph's argmax when every row is greedy (no sampler launch), else the
        sampler's draw — and their copy to the host, started."""
        if is_graphed and self.sampler.is_all_greedy(slots):  # the graph took the argmax: no sampler launch
            tokens = self.graph_runner.greedy[: len(seqs)]  # [N], valid until the next replay (stream-ordered reads)
        else:
            tokens = self.sampler.after(logits, state_indices, positions, slots)  # [N]
        return DecodeLaunch.start(seqs, tokens, positions, state_indices, slots, positions_host)

    def _catch_up_prefill(
        self, batch: Batch, fb: ForwardBatch, tokens: torch.Tensor, slots: np.ndarray, inputs: DraftPrefillInputs
    ) -> None:
        """The draft takes the chunk's positions [s, e) with tokens [s + 1, e + 1): the chunk's own tokens shifted by
        one, then token e — the one just sampled where the chunk ends its sequence, else the next prompt token.
        Positions before s that plain decode steps left to the draft are caught up on first. The draft's positions
        are the target's, and its K/V pages the `attn` layers' (`DraftKV`): its forward batch is the step's own."""
        self.spec.before_prefill(batch.seqs, slots, batch.start_positions, batch.num_new_tokens)
        next_ids = torch.where(inputs.next_ids < 0, tokens[inputs.owner], inputs.next_ids)  # [T]
        # A VLM prompt's image placeholders: the draft sees the image rows the target saw (token t + 1 at position t).
        draft = self.spec.drafters[0].draft
        next_embeds = None
        if draft.config.hidden_size == self.config.hidden_size:
            images = [s.images for s in batch.seqs]
            shifted = [start + 1 for start in batch.start_positions]
            next_embeds = spliced_input_embeds(draft.embed, next_ids, images, shifted, batch.num_new_tokens)
        if fb.kv is None:  # no `attn` layer: the draft's own slots and metadata
            starts = fb.positions[fb.cu_seqlens[:-1].long()]  # [N]
            self.spec.catch_up(next_ids, self.model.aux_hidden_states, fb.cu_seqlens, starts, inputs.slots,
                               fb.max_seqlen_q, next_embeds)  # fmt: skip
        else:
            self.spec.catch_up_prefill(next_ids, self.model.aux_hidden_states, fb, inputs.slots, next_embeds)

    def pages_trimmed(self, seqs: list[Sequence]) -> None:
        """After a verify step gave pages back (BlockManager.trim): later pages of these slots must be re-synced."""
        for seq in seqs:
            if seq.slot > 0 and self._slot_owner[seq.slot] == (seq.seq_id, seq.num_preemptions):
                self._slot_synced_pages[seq.slot] = min(self._slot_synced_pages[seq.slot], len(seq.pages))

    def _claim_slots(self, seqs: list[Sequence], slots: np.ndarray) -> None:
        """Bring the slot-indexed tables up to date: sampling parameters of newly placed sequences, new pages."""
        rows, cols, pages = [], [], []
        for seq, slot in zip(seqs, slots.tolist(), strict=True):
            # A preempted sequence that comes back (into any slot) holds new pages: it is a new owner too.
            owner = (seq.seq_id, seq.num_preemptions)
            if self._slot_owner[slot] != owner:
                self._slot_owner[slot] = owner
                self._slot_synced_pages[slot] = 0
                self.sampler.set_slot(slot, seq.sampling_params, seq.seed)
                if self.spec is not None:
                    self.spec.on_claim(seq, slot)
            synced = self._slot_synced_pages[slot]
            if len(seq.pages) > synced:
                new = seq.pages[synced:]
                rows += [slot] * len(new)
                cols += range(synced, len(seq.pages))
                pages += new
                self._slot_synced_pages[slot] = len(seq.pages)
        if pages:
            # Through pinned memory: a copy from pageable memory may wait for the device, and a decode step launched
            # ahead (`launch_next`) claims its pages while the step before it still runs.
            rows_d, cols_d, pages_d = self.upload(np.array([rows, cols, pages], dtype=np.int64))
            self.block_table[rows_d, cols_d] = pages_d.to(torch.int32)

    def upload(self, rows: np.ndarray) -> list[torch.Tensor]:
        """Copy a [C, n] int64 host array to the device at once; returns its C rows (`upload_block`'s)."""
        return list(self.upload_block(rows).unbind(0))

    def upload_block(self, rows: np.ndarray) -> torch.Tensor:
        """Copy a [C, n] int64 host array to the device at once; returns it as a [C, n] view whose rows each start
        16-byte aligned (the copy is padded to an even n): Triton specializes a kernel on its pointers' 16-byte
        alignment, so rows whose alignment followed n's parity would build a second variant of every kernel they
        reach."""
        num_rows, n = rows.shape
        if n % 2:  # (np.pad takes ~10 µs here: a plain copy well under 1)
            padded = np.zeros((num_rows, n + 1), dtype=rows.dtype)
            padded[:, :n] = rows
            rows = padded
        return self.uploads.upload(rows)[:, :n]  # [C, n rounded up to even] on the device, viewed as [C, n]

    def prefill_forward_batch(
        self, batch: Batch, slots: np.ndarray
    ) -> tuple[ForwardBatch, torch.Tensor, DraftPrefillInputs | None]:
        """The ForwardBatch of a PREFILL step, the sampling counter per sequence [N] (its length when sampling), and,
        speculating, what the draft's catch-up on the step takes (`_catch_up_prefill`)."""
        host, layout = self.prefill_host_rows(batch, slots)
        return self.prefill_device_batch(self.upload_block(host), layout)

    def prefill_host_rows(
        self, batch: Batch | None, slots: np.ndarray, padded: tuple[int, int] | None = None
    ) -> tuple[np.ndarray, PrefillLayout]:
        """A PREFILL step's host rows, for one copy to the device, and their layout (`prefill_device_batch`).

        `padded` (T_b, N_b): the shape of a prefill graph's bucket (`engine.prefill_graph`). Its rows N..N_b − 2 are
        empty sequences and row N_b − 1 a padding sequence of the T_b − T pad tokens (positions 0 onward); all of
        them in slot 0 from no stored state, so they write only the reserved slot 0 and nothing in the K/V caches. The
        chunk table is padded to the bucket's count with chunks past the padding sequence's end, which the chunk
        kernels mask whole; and never `fresh` (whether a row starts from a stored state is the device's
        has_initial_state in a graph, whatever step it replays). `batch` None: no real sequence (a graph's capture)."""
        seqs = [] if batch is None else batch.seqs
        real_lens = [] if batch is None else batch.num_new_tokens
        real_starts = [] if batch is None else batch.start_positions
        ids = [t for s, st, n in zip(seqs, real_starts, real_lens, strict=True) for t in s.token_ids[st : st + n]]
        num_real = len(ids)
        num_tokens, num_seqs = (num_real, len(seqs)) if padded is None else padded
        lens = np.zeros(num_seqs, dtype=np.int64)  # [N]
        lens[: len(seqs)] = real_lens
        starts = np.zeros(num_seqs, dtype=np.int64)  # [N]
        starts[: len(seqs)] = real_starts
        if padded is not None:
            assert len(seqs) < num_seqs and num_real <= num_tokens, "a prefill graph's bucket holds the step"
            lens[-1] = num_tokens - num_real
        cu = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(lens, out=cu[1:])
        owner = np.repeat(np.arange(num_seqs), lens)  # [T]: which sequence each token belongs to
        positions = np.arange(num_tokens) - cu[owner] + starts[owner]  # [T]
        context = starts + lens  # [N]
        chunk_rows = DeltaRuleChunks.host_rows(lens)  # [2, NT]
        num_chunks = chunk_rows.shape[1]
        if padded is not None:  # the bucket's count of chunks, the extra ones past the padding sequence's end
            num_chunks = -(-num_tokens // CHUNK_SIZE) + num_seqs
            past = np.arange(num_chunks - chunk_rows.shape[1], dtype=np.int64) + (-(-lens[-1] // CHUNK_SIZE))
            chunk_rows = np.concatenate([chunk_rows, np.stack([np.full_like(past, num_seqs - 1), past])], axis=1)
        # One [10, T+1] host buffer (T ≥ N and T ≥ NT, so every column fits; an 11th row speculating), one copy to the
        # device.
        assert num_tokens + 1 >= max(num_seqs + 1, num_chunks)
        host = np.zeros((10 + (self.spec is not None), num_tokens + 1), dtype=np.int64)
        host[0, :num_real] = ids
        host[1, :num_tokens] = positions
        host[2, :num_tokens] = owner
        host[3, : num_seqs + 1] = cu
        host[4, :num_seqs] = context
        host[5, : len(seqs)] = slots
        host[6, :num_seqs] = starts
        host[7:9, :num_chunks] = chunk_rows
        host[9, :num_seqs] = np.maximum(cu[1:] - 1, 0)  # each sequence's last new token
        if self.spec is not None and seqs:  # the draft's input at each position: the next token (-1: sampled here)
            chunks = zip(seqs, real_starts, real_lens, batch.is_sampling, strict=True)
            host[10, : num_real - 1] = host[0, 1:num_real]
            follow = [-1 if sampled else s.token_ids[st + n] for s, st, n, sampled in chunks]
            host[10, cu[1 : len(seqs) + 1] - 1] = follow
        if padded is None:
            num_cols, max_seqlen_q = -(-int(context.max()) // self.page_size), int(lens.max())
        else:
            num_cols, max_seqlen_q = self.plan.max_pages_per_seq, num_tokens
        fresh = padded is None and not starts.any()
        return host, PrefillLayout(num_tokens, num_seqs, num_chunks, num_cols, max_seqlen_q, fresh)

    def prefill_device_batch(
        self, block: torch.Tensor, layout: PrefillLayout
    ) -> tuple[ForwardBatch, torch.Tensor, DraftPrefillInputs | None]:
        """`prefill_forward_batch`'s device part, from the host rows on the device (`block`, at least
        [10, layout.num_tokens + 1]; 11 rows speculating): graph-capturable, the shapes all from `layout`."""
        num_tokens, num_seqs, num_chunks = layout.num_tokens, layout.num_seqs, layout.num_chunks
        input_ids, positions_d, owner_d = (t[:num_tokens] for t in block[:3])
        cu_d, context_d, slots_d, starts_d = block[3, : num_seqs + 1], *(t[:num_seqs] for t in block[4:7])
        rows = slots_d[owner_d]  # [T]: state slot of each token
        kv, swa_kv = self._kv_metadata(positions_d, rows, context_d[owner_d], slots_d, layout.num_cols)
        fb = ForwardBatch(
            phase=Phase.PREFILL,
            input_ids=input_ids,
            positions=positions_d,
            cu_seqlens=cu_d.to(torch.int32),
            context_lens=context_d.to(torch.int32),
            state_indices=slots_d.to(torch.int32),
            has_initial_state=starts_d > 0,
            max_seqlen_q=layout.max_seqlen_q,
            kv=kv,
            swa_kv=swa_kv,
            capture_layers=self.capture_layers,
            delta_chunks=DeltaRuleChunks(cu_d, block[7:9, :num_chunks].t().contiguous(), fresh=layout.fresh),
            last_indices=block[9, :num_seqs],
        )
        draft_inputs = None if self.spec is None else DraftPrefillInputs(block[10, :num_tokens], owner_d, slots_d)
        return fb, context_d, draft_inputs

    def decode_forward_batch(
        self, input_ids: torch.Tensor, positions: torch.Tensor, state_indices: torch.Tensor
    ) -> ForwardBatch:
        """A DECODE ForwardBatch built on the device from [B] token ids, positions and slots (graph-capturable:
        no host reads; rows with slot 0 are padding and write nothing)."""
        num_seqs = input_ids.shape[0]
        assert num_seqs <= self._decode_has_state.shape[0], f"a decode batch of {num_seqs} rows past the constants"
        context = positions + 1  # [B]
        kv, swa_kv = self._kv_metadata(positions, state_indices, context, state_indices, self.plan.max_pages_per_seq)
        return ForwardBatch(
            phase=Phase.DECODE,
            input_ids=input_ids,
            positions=positions,
            cu_seqlens=self._decode_cu_seqlens[: num_seqs + 1],  # constants: no kernel in a decode graph
            context_lens=context.to(torch.int32),
            state_indices=state_indices.to(torch.int32),
            has_initial_state=self._decode_has_state[:num_seqs],
            max_seqlen_q=1,
            kv=kv,
            swa_kv=swa_kv,
            capture_layers=self.capture_layers,
        )

    def _size_decode_constants(self, max_batch: int) -> None:
        """A DECODE batch's cu_seqlens (0, 1, .., B) and has_initial_state (all true), for batches up to max_batch:
        slices of these, so a decode graph replays no kernel for them."""
        self._decode_cu_seqlens = torch.arange(max_batch + 1, dtype=torch.int32, device=self.device)  # [B_max + 1]
        self._decode_has_state = torch.ones(max_batch, dtype=torch.bool, device=self.device)  # [B_max]

    def decode_logits(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        state_indices: torch.Tensor,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """[B] inputs → logits [B, V] fp32, into `out` when given (what a decode CUDA graph captures)."""
        hidden = self.model(self.decode_forward_batch(input_ids, positions, state_indices))  # [B, hidden]
        return self.model.compute_logits(hidden, out)

    def verify_kv_metadata(
        self, stored: torch.Tensor, rows: torch.Tensor, seq_ends: torch.Tensor, state_indices: torch.Tensor
    ) -> tuple[KVMetadata | None, KVMetadata | None]:
        """The Verifier's KVMetadataFn: metadata of a VERIFY batch (every block-table column, graph-capturable)."""
        return self._kv_metadata(stored, rows, seq_ends, state_indices, self.plan.max_pages_per_seq)

    def _kv_metadata(
        self,
        positions: torch.Tensor,  # [T] int64
        rows: torch.Tensor,  # [T] int64: state slot of each token's sequence
        seq_ends: torch.Tensor,  # [T] int64: the context length of each token's sequence after this step
        state_indices: torch.Tensor,  # [N]
        num_cols: int,  # block-table columns to pass (pages of the longest sequence)
    ) -> tuple[KVMetadata | None, KVMetadata | None]:
        """`ops.kv_metadata` over this runner's block table (one launch on the GPU): padded rows (slot 0) write
        nothing, and a token that a later token of the same chunk overwrites in an SWA ring is not written at all."""
        ring = self.plan.ring_tokens
        kv, swa_kv = kv_metadata(positions, rows, seq_ends, state_indices, self.block_table, num_cols, self.page_size,
                                 ring, self.has_attn, self.has_swa)  # fmt: skip
        return (
            KVMetadata(*kv) if kv is not None else None,
            KVMetadata(*swa_kv, ring_tokens=ring) if swa_kv is not None else None,
        )

    # ---- log-probs (only when a request asks) ----

    def _token_logprobs(
        self, logits: torch.Tensor, tokens: torch.Tensor, token_ids: list[int], seqs: list[Sequence]
    ) -> list[TokenLogprobs | None]:
        k = max(s.sampling_params.logprobs or 0 for s in seqs)
        chosen = compute_logprobs(logits, tokens).tolist()  # [N]
        top_values, top_ids = top_logprobs(logits, k)  # [N, k] each
        top_values, top_ids = top_values.tolist(), top_ids.tolist()
        out: list[TokenLogprobs | None] = []
        for i, seq in enumerate(seqs):
            n = seq.sampling_params.logprobs
            entry = TokenLogprobs(token_ids[i], chosen[i], top_ids[i][:n], top_values[i][:n]) if n is not None else None
            out.append(entry)
        return out

    def _prompt_logprobs(self, hidden: torch.Tensor, batch: Batch) -> dict[int, list[TokenLogprobs]]:
        """Log-probs of the prompt tokens this step's chunks predict that no earlier step recorded."""
        rows: list[int] = []
        targets: list[int] = []
        spans: dict[int, tuple[int, int]] = {}
        offset = 0
        for i, (seq, start, n) in enumerate(zip(batch.seqs, batch.start_positions, batch.num_new_tokens, strict=True)):
            if seq.wants_prompt_logprobs:
                # Token t is predicted by the hidden state at position t - 1.
                first = max(start + 1, len(seq.prompt_logprobs))
                end = min(start + n + 1, seq.num_prompt_tokens)
                if first < end:
                    spans[i] = (len(targets), end - first)
                    rows += range(offset + first - 1 - start, offset + end - 1 - start)
                    targets += seq.token_ids[first:end]
            offset += n
        if not targets:
            return {}
        logits = self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)])  # [M, V]
        target_ids = torch.tensor(targets, device=self.device)
        chosen = compute_logprobs(logits, target_ids).tolist()
        k = max(batch.seqs[i].sampling_params.prompt_logprobs for i in spans)
        top_values, top_ids = (t.tolist() for t in top_logprobs(logits, k))
        out = {}
        for i, (first, count) in spans.items():
            n = batch.seqs[i].sampling_params.prompt_logprobs
            span = range(first, first + count)
            out[i] = [TokenLogprobs(targets[j], chosen[j], top_ids[j][:n], top_values[j][:n]) for j in span]
        return out

    # ---- CUDA graphs ----

    def capture_graphs(self, batch_sizes: list[int]) -> None:
        from jetserve.engine.cuda_graph import GraphRunner

        assert self.device.type == "cuda", "CUDA graphs need a CUDA device"
        if max(batch_sizes) > self._decode_has_state.shape[0]:
            self._size_decode_constants(max(batch_sizes))
        self.graph_runner = GraphRunner(self, batch_sizes)
        self.graph_runner.capture()

    def use_prefill_graphs(self, buckets: list[int], max_seqs: int, capture: bool) -> None:
        """PREFILL steps of up to max(buckets) tokens in up to `max_seqs` sequences replay their bucket's graphs
        (`engine.prefill_graph`; after `attach_spec`; a graph pool of their own). Without `capture`
        (a device without graphs: the CPU tests) they run the same padded steps eagerly."""
        self.prefill_graphs = PrefillGraphs(self, buckets, max_seqs, capture)


@torch.inference_mode()
def profile_activation_bytes(
    model: JetNemotronForCausalLM, max_num_tokens: int, max_num_seqs: int, num_logit_rows: int | None = None
) -> int:
    """Peak device memory of the largest step (a `max_num_tokens` prefill, logits and sampling for `num_logit_rows`
    rows — default `max_num_seqs`; a verify step has T_d per sequence) above what is allocated now, measured with
    one-page/one-slot dummy caches that every row pads into."""
    config = model.config
    device = model.model.embed_tokens.weight.device
    dtype = model.model.embed_tokens.weight.dtype
    assert device.type == "cuda"
    ring_tokens = ring_tokens_for(config, 16, 0, config.max_position_embeddings)
    plan = MemoryPlan(16, 2, 2, ring_tokens, 16, 0, 0)
    pool = StatePool.for_model(config, 2, dtype, device)
    runner = ModelRunner(model, plan, pool)
    num_seqs = max(1, min(max_num_seqs, max_num_tokens))
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    lens = [max_num_tokens // num_seqs + (i < max_num_tokens % num_seqs) for i in range(num_seqs)]
    cu = torch.tensor([0, *np.cumsum(lens).tolist()], dtype=torch.int32, device=device)
    zeros_n = torch.zeros(num_seqs, dtype=torch.int32, device=device)
    fb = ForwardBatch(
        phase=Phase.PREFILL,
        input_ids=torch.zeros(max_num_tokens, dtype=torch.int64, device=device),
        positions=torch.cat([torch.arange(n, device=device) for n in lens]),
        cu_seqlens=cu,
        context_lens=cu.diff(),
        state_indices=zeros_n,
        has_initial_state=zeros_n.bool(),
        max_seqlen_q=max(lens),
        kv=KVMetadata(torch.full((max_num_tokens,), -1, device=device), zeros_n[:, None]),
        swa_kv=KVMetadata(
            torch.full((max_num_tokens,), -1, device=device),
            torch.zeros(num_seqs, max(1, ring_tokens // 16), dtype=torch.int32, device=device),
            ring_tokens=ring_tokens,
        ),
    )
    hidden = model(fb)
    rows = num_logit_rows or max_num_seqs
    logits = model.compute_logits(hidden[:1].expand(rows, -1))  # [rows, V]
    runner.sampler(logits, torch.zeros(rows, dtype=torch.int32, device=device),
                   torch.zeros(rows, dtype=torch.int64, device=device), slots=None)  # fmt: skip
    del hidden, logits, fb, runner, pool
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    torch.cuda.empty_cache()  # so the memory query that follows sees the profile's blocks as free
    return peak
