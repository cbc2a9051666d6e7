"""LLM: offline batch generation over the engine (`LLM(model=...).generate(prompts, sampling_params)`)."""

from __future__ import annotations

import itertools
import sys

from jetserve.engine.config import EngineConfig
from jetserve.engine.engine import LLMEngine
from jetserve.engine.output import RequestOutput
from jetserve.model.jet_nemotron import JetNemotronForCausalLM
from jetserve.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    """`LLM(model=DIR, **engine_args)`: engine_args are EngineConfig fields (dtype, device, max_num_seqs, ...)."""

    def __init__(
        self, model: str = "", *, model_instance: JetNemotronForCausalLM | None = None, tokenizer=None, **engine_args
    ) -> None:
        config = EngineConfig(model=model, **engine_args)
        if model_instance is None:
            from jetserve.engine.tensor_parallel import build_engine  # tensor parallel when the config asks for it

            self.engine = build_engine(config, tokenizer)
        elif config.tensor_parallel_size > 1 or config.data_parallel_size > 1:
            raise ValueError("model_instance: a built model runs in one process (tensor/data parallel load their own)")
        else:
            self.engine = LLMEngine(config, model=model_instance, tokenizer=tokenizer)
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | list[Prompt],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Complete every prompt (text, or a list of token ids); returns the final outputs in prompt order."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"sampling_params: {len(sampling_params)} given for {len(prompts)} prompts")
        request_ids = []
        for prompt, params in zip(prompts, sampling_params, strict=True):
            request_id = str(next(self._ids))
            self.engine.add_request(request_id, self._encode(prompt), params)
            request_ids.append(request_id)
        finished: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    finished[out.request_id] = out
                    if use_tqdm:
                        print(f"\rfinished {len(finished)}/{len(request_ids)}", end="", file=sys.stderr)
        if use_tqdm:
            print(file=sys.stderr)
        return [finished[r] for r in request_ids]

    def _encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompts: text prompts need a tokenizer, and this model has none; pass token ids")
            return self.tokenizer.encode(prompt)
        return list(prompt)
