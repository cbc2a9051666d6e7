"""LLMEngine: requests in, RequestOutputs out; a step is schedule → run → postprocess (Batch → ForwardBatch →
StepOutput), or with overlap scheduling: launch the next decode or verify step → postprocess the one in flight."""

from __future__ import annotations

import logging
import random
import time
from pathlib import Path

import torch

from jetserve.engine.block_manager import BlockManager
from jetserve.engine.config import EngineConfig
from jetserve.engine.cuda_graph import capture_batch_sizes
from jetserve.engine.memory_plan import (
    MemoryPlan,
    cache_budget_bytes,
    draft_page_bytes_for,
    draft_slot_bytes_for,
    plan_memory,
)
from jetserve.engine.model_runner import DecodeLaunch, ModelRunner, profile_activation_bytes
from jetserve.engine.output import OutputProcessor, RequestOutput
from jetserve.engine.prefill_graph import PREFILL_GRAPH_MAX_SEQS
from jetserve.engine.scheduler import Batch, Scheduler
from jetserve.engine.sequence import FinishReason, Sequence, SequenceStatus
from jetserve.engine.speculative import SpecDecoder, SpecStats, VerifyLaunch, draft_shapes
from jetserve.engine.state_pool import StatePool
from jetserve.model.forward_batch import Phase
from jetserve.model.fusion import fuse_projections
from jetserve.model.jet_nemotron import JetNemotronForCausalLM
from jetserve.model.vision import VisionEncoder
from jetserve.multimodal.inputs import ImageInputs
from jetserve.sampling_params import SamplingParams
from jetserve.spec.eagle3 import Eagle3DraftModel

logger = logging.getLogger(__name__)

Launch = DecodeLaunch | VerifyLaunch  # a step queued on the device, read by `LLMEngine._resolve`


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device: {name!r} asked for but CUDA is not available")
    return device


class LLMEngine:
    """The engine API the server drives: `add_request`, `abort_request`, `step`, `has_unfinished_requests`.

    Not thread-safe: one caller steps it (the server's engine loop); requests added between steps join the next one.

    With `config.draft`, decoding is speculative (EAGLE-3): `spec` is the SpecDecoder, and `num_draft_tokens`,
    `num_accepted_tokens`, `num_verify_steps`, `num_drafts` (sequence-rounds) and `spec_stats` count its work.
    `forced_acceptance` ("right" / "all" / "wrong", benchmarks only) replaces every drafted token by the request's
    known continuation (set in `spec.forced_continuations`) or a token that is never it; "all" also accepts every
    tree's deepest path without the target's check (its text is the continuation by construction), or its first
    `forced_depth` drafts where given (τ = forced_depth + 1 on trees that deep: the forced speed-up curve).
    """

    def __init__(
        self,
        config: EngineConfig,
        model: JetNemotronForCausalLM | None = None,
        tokenizer: object | None = None,
        draft: Eagle3DraftModel | None = None,
        forced_acceptance: str | None = None,
        forced_depth: int | None = None,
    ) -> None:
        self.config = config
        if config.data_parallel_size > 1 or (config.tensor_parallel_size > 1 and not hasattr(model, "tensor_parallel")):
            raise ValueError(
                "tensor_parallel_size/data_parallel_size: an LLMEngine is one process; build parallel engines with "
                "jetserve.engine.tensor_parallel.build_engine (tensor) or serve with --data-parallel-size (replicas)"
            )
        if model is None:
            from jetserve.model.loader import load_model

            model = load_model(config.model, dtype=config.dtype, device=resolve_device(config.device))
        if tokenizer is None:
            tokenizer = _load_tokenizer_if_present(config.tokenizer or config.model)
        self.model = fuse_projections(model)  # a no-op for the loaders' models; a model built otherwise is fused here
        self.vision = _load_vision_if_present(config.model, model)  # jet_vlm: SigLIP tower + projector, else None
        self.model_config = model.config
        self.tokenizer = tokenizer
        weight = model.model.embed_tokens.weight
        device, dtype = weight.device, weight.dtype
        if config.draft and draft is None:
            from jetserve.spec.eagle3 import load_draft_model

            draft = load_draft_model(config.draft, model)
        if draft is not None and not config.draft:
            raise ValueError("draft: a draft model was passed, but config.draft is not set (it sets speculation on)")
        if forced_acceptance is not None and draft is None:
            raise ValueError("forced_acceptance: needs speculative decoding (a draft)")
        if forced_depth is not None and forced_acceptance != "all":
            raise ValueError("forced_depth: needs forced_acceptance 'all'")
        self.draft = draft if draft is None else fuse_projections(draft)
        self.plan = self._plan(model, device, dtype)
        logger.info("memory plan: %s", self.plan)
        self.state_pool = StatePool.for_model(self.model_config, self.plan.num_slots, dtype, device)
        self.block_manager = BlockManager(self.plan.num_pages, self.plan.page_size)
        eos = tuple(dict.fromkeys((*self.model_config.eos_token_ids, *getattr(tokenizer, "eos_token_ids", ()))))
        self.runner = ModelRunner(model, self.plan, self.state_pool)
        self.spec: SpecDecoder | None = None
        if draft is not None:
            topk, steps = config.speculation
            shapes = draft_shapes(topk, steps, config.draft_tree_size)
            self.spec = SpecDecoder(
                self.runner, draft, shapes, config.spec_adaptive, forced_acceptance,
                ring=config.feature_ring, max_flush_tokens=config.max_num_batched_tokens, forced_depth=forced_depth,
            )  # fmt: skip
            self.runner.attach_spec(self.spec)
        self.scheduler = Scheduler(
            self.block_manager, self.state_pool, config.max_num_seqs, config.max_num_batched_tokens, eos,
            verify_planner=self.spec, max_model_len=self.plan.max_model_len,
        )  # fmt: skip
        if device.type == "cuda" and not config.enforce_eager:
            batch_sizes = capture_batch_sizes(config, self.plan.num_slots)
            self.runner.capture_graphs(batch_sizes)
            if self.spec is not None:
                self.spec.capture_graphs(batch_sizes)
            buckets = config.prefill_graph_buckets(self.plan.max_model_len)
            if buckets:
                self.runner.use_prefill_graphs(buckets, self.prefill_graph_seqs, capture=True)
        self.output_processor = OutputProcessor(tokenizer)
        self._requests: dict[str, Sequence] = {}
        self._seed_rng = random.Random(config.seed)
        self._in_flight: Launch | None = None  # the step launched ahead (overlap scheduling)

    @classmethod
    def from_engine_args(cls, model: str, **engine_args) -> LLMEngine:
        return cls(EngineConfig(model=model, **engine_args))

    def _plan(self, model: JetNemotronForCausalLM, device: torch.device, dtype: torch.dtype) -> MemoryPlan:
        config = self.config
        activation_bytes = 0
        num_logit_rows = config.max_num_seqs * max(1, config.draft_tree_size)
        if device.type == "cuda" and (config.num_pages is None or config.num_slots is None):
            activation_bytes = profile_activation_bytes(
                model, config.max_num_batched_tokens, config.max_num_seqs, num_logit_rows
            )
            # The prefill graphs' pool holds their largest step's activations (its bucket at most the model's).
            buckets = config.prefill_graph_buckets(config.max_model_len or self.model_config.max_position_embeddings)
            if buckets:
                seqs = self.prefill_graph_seqs
                activation_bytes += profile_activation_bytes(model, buckets[-1], seqs, seqs + 1)
        budget = cache_budget_bytes(config, device, activation_bytes)
        draft_page_bytes = draft_slot_bytes = 0
        if self.draft is not None:
            attn = self.draft.midlayer.self_attn
            draft_page_bytes = draft_page_bytes_for(attn.num_kv_heads, attn.head_dim, config.page_size, dtype)
            draft_slot_bytes = draft_slot_bytes_for(
                self.model_config.hidden_size, len(self.draft.capture_layers), config.feature_ring,
                self.draft.config.hidden_size, dtype,
            )  # fmt: skip
        return plan_memory(self.model_config, config, dtype, budget, draft_page_bytes, draft_slot_bytes)

    @property
    def prefill_graph_seqs(self) -> int:
        """Sequences a graphed PREFILL step may hold."""
        return min(self.config.max_num_seqs, PREFILL_GRAPH_MAX_SEQS)

    @property
    def max_model_len(self) -> int:
        return self.plan.max_model_len

    # ---- the API ----

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams | None = None,
        images: ImageInputs | None = None,
    ) -> None:
        """Queue a request; raises ValueError (naming the problem) for one that could never run. `images` (a VLM's,
        placeholders already expanded in the prompt) are encoded here, once, however many choices share them."""
        params = sampling_params or SamplingParams()
        if request_id in self._requests:
            raise ValueError(f"request_id: {request_id!r} is already in flight")
        if not prompt_token_ids:
            raise ValueError("prompt: empty (it must hold at least one token)")
        vocab = self.model_config.vocab_size
        bad = next((t for t in prompt_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt: token id {bad} is outside the vocabulary [0, {vocab})")
        num_prompt = len(prompt_token_ids)
        room = self.max_model_len - num_prompt
        if room < 1:
            raise ValueError(f"prompt: {num_prompt} tokens leave no room in the context ({self.max_model_len})")
        if params.max_tokens is not None and params.max_tokens > room:
            raise ValueError(
                f"max_tokens: prompt ({num_prompt}) + max_tokens ({params.max_tokens}) exceeds the context "
                f"({self.max_model_len})"
            )
        if params.stop and self.tokenizer is None:
            raise ValueError("stop: stop strings need a tokenizer, and this model has none")
        if params.logprobs is not None or params.prompt_logprobs is not None:
            limit = max(params.logprobs or 0, params.prompt_logprobs or 0)
            if limit > vocab:
                raise ValueError(f"logprobs: {limit} exceeds the vocabulary size {vocab}")
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        if images is not None:
            self._encode_images(images, num_prompt)
        seq = Sequence(request_id, list(prompt_token_ids), params, seed, params.max_tokens or room, images)
        if params.prompt_logprobs is not None:
            seq.prompt_logprobs = [None]
        self.scheduler.add(seq)
        self._requests[request_id] = seq

    def abort_request(self, request_id: str) -> bool:
        """Stop a request now, freeing its pages and slot; False when it is not in flight."""
        seq = self._requests.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.finish(seq, FinishReason.ABORT)
        self._drop_ended_launch()
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def num_unfinished_requests(self) -> int:
        return len(self._requests)

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Run one step; returns an output for every request that got a token (finished ones included).

        With `config.overlap_scheduling`, decode and verify steps run one ahead: a call launches the step after the
        one in flight (its inputs are that step's tokens or result, still on the device), and only then waits for
        the one in flight and postprocesses it, so the host's work overlaps the device's. Each call still returns
        one step's outputs. Anything else (prefill, log-probs) runs synchronously, once the pipeline has drained
        (`_launch_next` says when).
        """
        start = time.perf_counter()
        launch = self._in_flight
        ahead = launch is not None  # launched by the previous call: this call's time is an overlapped step's
        if launch is None:
            batch = self.scheduler.schedule()
            if batch is None:
                return []
            if self._can_overlap(batch):
                launch = self.runner.launch_decode(batch)
            elif batch.phase is Phase.VERIFY and self.config.overlap_scheduling:
                launch = self.runner.launch_verify(batch)
            else:
                return self._run(batch, start)
        self._in_flight = self._launch_next(launch)
        outputs = self._resolve(launch)
        if self.runner.spec is not None and ahead:
            # The policy weighs each option by what its steps take launched ahead. A step started here (the
            # pipeline empty: after a prefill step or a switch between plain decoding and a draft shape) runs
            # unoverlapped: timing plain ones made plain decoding look slower the more often a draft shape was
            # chosen, and the policy chose one ever more often (session 17: 77% verify steps at batch 1, 0.51x).
            self.spec.record_step(launch.option, len(launch.seqs), time.perf_counter() - start)
        return outputs

    def _run(self, batch: Batch, start: float) -> list[RequestOutput]:
        """Run `batch` synchronously: the model, then postprocessing (`start`: when the step began)."""
        out = self.runner.run(batch)
        if batch.phase is Phase.VERIFY:
            updated = self.scheduler.postprocess_verify(batch, out.emitted)
            self.runner.pages_trimmed(batch.seqs)
        else:
            for i, entries in out.prompt_logprobs.items():
                batch.seqs[i].prompt_logprobs.extend(entries)
            if out.logprobs is not None:
                for seq, sampled, entry in zip(batch.seqs, batch.is_sampling, out.logprobs, strict=True):
                    if sampled and entry is not None:
                        seq.output_logprobs.append(entry)
            updated = self.scheduler.postprocess(batch, out.token_ids)
        self._score_shadows()
        if self.spec is not None and batch.phase is not Phase.PREFILL:
            # A verify step that first caught the draft up on a plain stretch is not verifying's steady state: timing
            # it charged the stretch's catch-up to the draft shape, which then lost to plain decoding (session 41).
            if batch.phase is Phase.DECODE or not self.spec.verify_caught_up:
                option = batch.draft_shape if batch.phase is Phase.VERIFY else -1
                self.spec.record_step(option, batch.num_seqs, time.perf_counter() - start)
        return [self._process(seq) for seq in updated]

    def _can_overlap(self, batch: Batch) -> bool:
        """Whether `batch` may start a run of decode steps launched ahead: a plain DECODE batch (with speculation, one
        the policy chose plain) and no request asking for log-probs (they are computed from the step's logits, which
        the next launch overwrites). (A VERIFY batch starts a run of verify steps whenever overlap is on.)"""
        return (
            self.config.overlap_scheduling
            and batch.phase is Phase.DECODE
            and all(s.sampling_params.logprobs is None for s in batch.seqs)
        )

    def _launch_next(self, prev: Launch) -> Launch | None:
        """Launch the step after `prev` (not yet resolved) for its sequences that will still run after it; None to
        drain instead, so that the next call schedules: when a waiting request could be admitted, when every
        sequence ends at `prev` (or has ended), when the pages for the step do not fit (the scheduler then
        preempts), or, speculating, when the policy picks another option for the step (a draft ring that a plain
        step would wrap catches up behind `prev` instead: `SpecDecoder.plan_decode_ahead`)."""
        if not self.config.overlap_scheduling or self.scheduler.can_admit():
            return None
        if isinstance(prev, VerifyLaunch):
            return self._launch_next_verify(prev)
        # A sequence whose token from `prev` reaches its length limit runs no further step: it would only be
        # discarded, and could ask for a page past what the sequence may ever hold (`Scheduler.add` lets prompt +
        # max tokens exceed the pool by the one token that is never cached). One that stops on EOS or a stop string
        # at `prev` is only found at the resolve; its token of the step launched here is discarded then (`_resolve`).
        keep = [i for i, seq in enumerate(prev.seqs) if _runs_after_one_more_token(seq)]
        if not keep:
            return None
        seqs = [prev.seqs[i] for i in keep]
        # Each holds `num_computed_tokens` cached tokens and the page for the one `prev` caches; this step caches one
        # more.
        needed = sum(self.block_manager.pages_needed(seq, 2) for seq in seqs)
        if needed > self.block_manager.num_free_pages:
            return None
        slots, positions = prev.next_rows(keep)  # [N] each, on the host
        spec = self.runner.spec
        if spec is not None and not spec.plan_decode_ahead(seqs, slots, positions):  # the policy wants a VERIFY step
            return None
        for seq in seqs:
            self.block_manager.append(seq, 2)
        return self.runner.launch_next(prev, keep, seqs, slots, positions)

    def _launch_next_verify(self, prev: VerifyLaunch) -> VerifyLaunch | None:
        """The verify step after `prev`, for all of its sequences (a run of verify steps drains when one ends): only
        when `prev` cannot end any by length, and the pages and the context hold the longest path `prev` may accept
        (T_d nodes, root included) and this step's tree (T_d more) past the cached tokens."""
        num_nodes = self.spec.shapes[prev.shape].num_draft_tokens
        reach = 2 * num_nodes
        for seq in prev.seqs:
            if seq.status != SequenceStatus.RUNNING or seq.num_output_tokens + num_nodes >= seq.max_output_tokens:
                return None
            if seq.num_computed_tokens + reach > self.max_model_len:
                return None
        needed = sum(self.block_manager.pages_needed(seq, reach) for seq in prev.seqs)
        if needed > self.block_manager.num_free_pages or not self.spec.plan_verify_ahead(len(prev.seqs), prev.shape):
            return None
        for seq in prev.seqs:
            self.block_manager.append(seq, reach)
        return self.runner.launch_verify_next(prev)

    def _resolve(self, launch: Launch) -> list[RequestOutput]:
        """Wait for `launch`'s tokens and postprocess them for its sequences that still run; outputs as `step`.

        A sequence that finished (EOS, a stop token or string) or was aborted since `launch` was launched gets no
        token from it: its pages and slot were freed when it ended, and whatever reuses them next is queued on the
        device behind `launch`, so its late writes into them are overwritten before anyone reads them.
        """
        if isinstance(launch, VerifyLaunch):
            return self._resolve_verify(launch)
        token_ids = launch.token_ids()
        rows = [i for i, seq in enumerate(launch.seqs) if seq.status == SequenceStatus.RUNNING]
        outputs = []
        if rows:
            # Built now: Batch reads each sequence's progress, which is the launch's own only once the step before
            # it was postprocessed.
            batch = Batch(Phase.DECODE, [launch.seqs[i] for i in rows], [1] * len(rows))
            assert all(batch.is_sampling), "a launched decode step computes each sequence's last token"
            updated = self.scheduler.postprocess(batch, [token_ids[i] for i in rows])
            outputs = [self._process(seq) for seq in updated]
        self._score_shadows()
        self._drop_ended_launch()
        return outputs

    def _resolve_verify(self, launch: VerifyLaunch) -> list[RequestOutput]:
        """`_resolve` for a VERIFY step: its accepted tokens; with a verify step launched after it in flight, each
        sequence keeps the pages of that step's tree."""
        rows = [i for i, seq in enumerate(launch.seqs) if seq.status == SequenceStatus.RUNNING]
        followed = self._in_flight is not None
        emitted = self.spec.finish_verify(launch, rows, followed)
        outputs = []
        if rows:
            num_nodes = self.spec.shapes[launch.shape].num_draft_tokens
            seqs = [launch.seqs[i] for i in rows]
            batch = Batch(Phase.VERIFY, seqs, [1] * len(rows), num_draft_tokens=num_nodes, draft_shape=launch.shape)
            updated = self.scheduler.postprocess_verify(batch, emitted, num_nodes if followed else 1)
            self.runner.pages_trimmed(seqs)
            outputs = [self._process(seq) for seq in updated]
        self._score_shadows()
        self._drop_ended_launch()
        return outputs

    def _score_shadows(self) -> None:
        """Score the speculating engine's shadow drafts and first guesses that the tokens just postprocessed complete
        (`SpecDecoder.resolve_shadows`)."""
        if self.spec is not None and (self.spec.shadows or self.spec.first_guesses):
            self.spec.resolve_shadows()

    def _drop_ended_launch(self) -> None:
        """Forget the launch in flight once none of its sequences runs (all finished or aborted): its device work
        still runs, and nothing reads it."""
        launch = self._in_flight
        if launch is not None and all(seq.status != SequenceStatus.RUNNING for seq in launch.seqs):
            self._in_flight = None

    def _process(self, seq: Sequence) -> RequestOutput:
        processor = self.output_processor
        num_old_chars = len(seq.output_text)
        seq.output_text += processor.decode_new_text(seq, flush=seq.is_finished)
        stop = processor.find_stop_string(seq, num_old_chars)
        if stop is not None:
            if seq.is_finished:  # it also hit EOS or its length this step: the stop string came first in the text
                seq.finish_reason, seq.stop_reason = FinishReason.STOP, stop
            else:
                self.scheduler.finish(seq, FinishReason.STOP, stop)
        if seq.is_finished:
            self._requests.pop(seq.request_id, None)
        return processor.make_output(seq)

    def _encode_images(self, images: ImageInputs, num_prompt_tokens: int) -> None:
        if self.vision is None:
            raise ValueError("images: this model takes no image input")
        expected = images.pixel_values.shape[0] * self.vision.tokens_per_tile
        if images.num_tokens != expected or (images.num_tokens and images.positions[-1] >= num_prompt_tokens):
            raise ValueError(
                f"images: {images.num_tokens} placeholder positions for {expected} image embeddings, or a position "
                f"past the {num_prompt_tokens}-token prompt"
            )
        if images.embeds is None:
            images.embeds = self.vision(images.pixel_values)  # [M, hidden]

    def set_speculation(self, enabled: bool) -> None:
        """Turn speculative decoding off (plain decoding, no draft catch-up) or back on, between runs: with nothing
        in flight, since a sequence decoded without the draft has no draft cache to speculate from (benchmarks)."""
        if self.spec is None:
            raise ValueError("set_speculation: this engine has no draft")
        if self.has_unfinished_requests():
            raise ValueError("set_speculation: only with no request in flight")
        self._drop_ended_launch()
        assert self._in_flight is None, "a decode step launched ahead outlived its requests"
        self.runner.spec = self.spec if enabled else None
        self.scheduler.verify_planner = self.spec if enabled else None

    # ---- introspection (tests, metrics) ----

    @property
    def spec_stats(self) -> SpecStats:
        """Speculative decoding's totals (all zero without a draft)."""
        return self.spec.stats if self.spec is not None else SpecStats()

    @property
    def num_draft_tokens(self) -> int:
        """Drafted tokens verified so far (the root of each tree not counted)."""
        return self.spec_stats.num_draft_tokens

    @property
    def num_accepted_tokens(self) -> int:
        """Drafted tokens accepted so far (bonus tokens not counted)."""
        return self.spec_stats.num_accepted_tokens

    @property
    def num_verify_steps(self) -> int:
        """Engine steps that verified draft trees (each covers every sequence of its batch)."""
        return self.spec_stats.num_verify_steps

    @property
    def num_drafts(self) -> int:
        """Draft trees verified: one per sequence per verify step (vLLM's `num_drafts`; τ = 1 + accepted / this)."""
        return self.spec_stats.num_drafts

    def num_free_pages(self) -> int:
        return self.block_manager.num_free_pages

    def num_free_slots(self) -> int:
        return self.state_pool.num_free_slots

    def is_idle_and_clean(self) -> bool:
        """Nothing in flight and every page and slot back in its pool (the leak check)."""
        return (
            not self.has_unfinished_requests()
            and self._in_flight is None
            and self.block_manager.num_free_pages == self.block_manager.num_usable_pages
            and self.state_pool.num_free_slots == self.state_pool.num_usable_slots
        )


def _runs_after_one_more_token(seq: Sequence) -> bool:
    """Whether `seq` still runs, and one more token cannot end it by length."""
    return seq.status == SequenceStatus.RUNNING and seq.num_output_tokens + 1 < seq.max_output_tokens


def _load_vision_if_present(path: str, model: JetNemotronForCausalLM) -> VisionEncoder | None:
    """The image encoder of a jet_vlm checkpoint at `path` (beside its text model `model`), else None."""
    from jetserve.config import is_vlm_config

    if not path or not is_vlm_config(path):
        return None
    from jetserve.model.loader import load_vision_encoder

    weight = model.model.embed_tokens.weight
    return load_vision_encoder(path, dtype=weight.dtype, device=weight.device)


def _load_tokenizer_if_present(path: str) -> object | None:
    if not path or not (Path(path) / "tokenizer.json").is_file():
        return None
    from jetserve.tokenizer import load_tokenizer

    return load_tokenizer(path)
