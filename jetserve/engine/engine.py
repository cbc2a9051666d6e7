"""LLMEngine: requests in, RequestOutputs out; a step is schedule → run → postprocess (Batch → ForwardBatch →
StepOutput)."""

from __future__ import annotations

import logging
import random
from pathlib import Path

import torch

from jetserve.engine.block_manager import BlockManager
from jetserve.engine.config import EngineConfig
from jetserve.engine.cuda_graph import default_batch_sizes
from jetserve.engine.memory_plan import MemoryPlan, cache_budget_bytes, plan_memory
from jetserve.engine.model_runner import ModelRunner, profile_activation_bytes
from jetserve.engine.output import OutputProcessor, RequestOutput
from jetserve.engine.scheduler import Scheduler
from jetserve.engine.sequence import FinishReason, Sequence
from jetserve.engine.state_pool import StatePool
from jetserve.model.jet_nemotron import JetNemotronForCausalLM
from jetserve.model.vision import VisionEncoder
from jetserve.multimodal.inputs import ImageInputs
from jetserve.sampling_params import SamplingParams

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
    """

    def __init__(
        self, config: EngineConfig, model: JetNemotronForCausalLM | None = None, tokenizer: object | None = None
    ) -> None:
        self.config = config
        if model is None:
            from jetserve.model.loader import load_model

            model = load_model(config.model, dtype=config.dtype, device=resolve_device(config.device))
        if tokenizer is None:
            tokenizer = _load_tokenizer_if_present(config.tokenizer or config.model)
        self.model = model
        self.vision = _load_vision_if_present(config.model, model)  # jet_vlm: SigLIP tower + projector, else None
        self.model_config = model.config
        self.tokenizer = tokenizer
        weight = model.model.embed_tokens.weight
        device, dtype = weight.device, weight.dtype
        self.plan = self._plan(model, device, dtype)
        logger.info("memory plan: %s", self.plan)
        self.state_pool = StatePool.for_model(self.model_config, self.plan.num_slots, dtype, device)
        self.block_manager = BlockManager(self.plan.num_pages, self.plan.page_size, self.plan.ring_tokens)
        eos = tuple(dict.fromkeys((*self.model_config.eos_token_ids, *getattr(tokenizer, "eos_token_ids", ()))))
        self.scheduler = Scheduler(
            self.block_manager, self.state_pool, config.max_num_seqs, config.max_num_batched_tokens, eos
        )
        self.runner = ModelRunner(model, self.plan, self.state_pool)
        if device.type == "cuda" and not config.enforce_eager:
            largest = min(config.cuda_graph_max_batch_size or config.max_num_seqs, self.plan.num_slots - 1)
            self.runner.capture_graphs(default_batch_sizes(largest))
        self.output_processor = OutputProcessor(tokenizer)
        self._requests: dict[str, Sequence] = {}
        self._seed_rng = random.Random(config.seed)

    @classmethod
    def from_engine_args(cls, model: str, **engine_args) -> LLMEngine:
        return cls(EngineConfig(model=model, **engine_args))

    def _plan(self, model: JetNemotronForCausalLM, device: torch.device, dtype: torch.dtype) -> MemoryPlan:
        config = self.config
        activation_bytes = 0
        if device.type == "cuda" and (config.num_pages is None or config.num_slots is None):
            activation_bytes = profile_activation_bytes(model, config.max_num_batched_tokens, config.max_num_seqs)
        budget = cache_budget_bytes(config, device, activation_bytes)
        return plan_memory(self.model_config, config, dtype, budget)

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
        batch = self.scheduler.schedule()
        if batch is None:
            return []
        out = self.runner.run(batch)
        for i, entries in out.prompt_logprobs.items():
            batch.seqs[i].prompt_logprobs.extend(entries)
        if out.logprobs is not None:
            for seq, sampled, entry in zip(batch.seqs, batch.is_sampling, out.logprobs, strict=True):
                if sampled and entry is not None:
                    seq.output_logprobs.append(entry)
        updated = self.scheduler.postprocess(batch, out.token_ids)
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

    # ---- introspection (tests, metrics) ----

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
