"""LLMEngine: requests in, RequestOutputs out; a step is schedule → run → postprocess (Batch → ForwardBatch →
StepOutput)."""

from __future__ import annotations

import logging
import random
import time
from pathlib import Path

import torch

from jetserve.engine.block_manager import BlockManager
from jetserve.engine.config import EngineConfig
from jetserve.engine.cuda_graph import default_batch_sizes
from jetserve.engine.memory_plan import MemoryPlan, cache_budget_bytes, draft_page_bytes_for, plan_memory
from jetserve.engine.model_runner import ModelRunner, profile_activation_bytes
from jetserve.engine.output import OutputProcessor, RequestOutput
from jetserve.engine.scheduler import Scheduler
from jetserve.engine.sequence import FinishReason, Sequence
from jetserve.engine.speculative import SpecDecoder, SpecStats, draft_shapes
from jetserve.engine.state_pool import StatePool
from jetserve.model.forward_batch import Phase
from jetserve.model.fusion import fuse_projections
from jetserve.model.jet_nemotron import JetNemotronForCausalLM
from jetserve.model.vision import VisionEncoder
from jetserve.multimodal.inputs import ImageInputs
from jetserve.sampling_params import SamplingParams
from jetserve.spec.eagle3 import Eagle3DraftModel

logger = logging.getLogger(__name__)


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
    `forced_acceptance` ("right" / "wrong", benchmarks only) replaces every drafted token by the request's known
    continuation (set in `spec.forced_continuations`) or a token that is never it.
    """

    def __init__(
        self,
        config: EngineConfig,
        model: JetNemotronForCausalLM | None = None,
        tokenizer: object | None = None,
        draft: Eagle3DraftModel | None = None,
        forced_acceptance: str | None = None,
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
            self.spec = SpecDecoder(self.runner, draft, shapes, config.spec_adaptive, forced_acceptance)
            self.runner.attach_spec(self.spec)
        self.scheduler = Scheduler(
            self.block_manager, self.state_pool, config.max_num_seqs, config.max_num_batched_tokens, eos,
            verify_planner=self.spec, max_model_len=self.plan.max_model_len,
        )  # fmt: skip
        if device.type == "cuda" and not config.enforce_eager:
            largest = min(config.cuda_graph_max_batch_size or config.max_num_seqs, self.plan.num_slots - 1)
            self.runner.capture_graphs(default_batch_sizes(largest))
            if self.spec is not None:
                self.spec.capture_graphs(default_batch_sizes(largest))
        self.output_processor = OutputProcessor(tokenizer)
        self._requests: dict[str, Sequence] = {}
        self._seed_rng = random.Random(config.seed)

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
        budget = cache_budget_bytes(config, device, activation_bytes)
        draft_page_bytes = 0
        if self.draft is not None:
            attn = self.draft.midlayer.self_attn
            draft_page_bytes = draft_page_bytes_for(attn.num_kv_heads, attn.head_dim, config.page_size, dtype)
        return plan_memory(self.model_config, config, dtype, budget, draft_page_bytes)

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
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def num_unfinished_requests(self) -> int:
        return len(self._requests)

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Run one step; returns an output for every request that got a token (finished ones included)."""
        start = time.perf_counter()
        batch = self.scheduler.schedule()
        if batch is None:
            return []
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
        if self.spec is not None and batch.phase is not Phase.PREFILL:
            option = batch.draft_shape if batch.phase is Phase.VERIFY else -1
            self.spec.record_step(option, batch.num_seqs, time.perf_counter() - start)
        return [self._process(seq) for seq in updated]

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
            and self.block_manager.num_free_pages == self.block_manager.num_usable_pages
            and self.state_pool.num_free_slots == self.state_pool.num_usable_slots
        )


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
