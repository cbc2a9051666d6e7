"""Sequence: one request's tokens, its progress through the model, and the cache it holds (pages and a state slot)."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

from jetserve.multimodal.inputs import ImageInputs
from jetserve.sampling_params import SamplingParams

_seq_ids = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued, holds no cache (new, or preempted and waiting to be recomputed)
    RUNNING = "running"  # holds a state slot and the pages of its computed tokens
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the context length reached
    ABORT = "abort"


@dataclass
class TokenLogprobs:
    """The log-prob of one chosen token, and the top-k alternatives (ids and log-probs, most likely first)."""

    token_id: int
    logprob: float
    top_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)


class Sequence:
    """A request in flight. `token_ids` = prompt ++ output; tokens `[0, num_computed_tokens)` are in the caches.

    The next forward computes tokens from `num_computed_tokens` on; when a step computes the last token, the model's
    output at it is sampled and appended. Preemption drops the cache and sets `num_computed_tokens` back to 0, so the
    sequence is recomputed (prompt and output so far) when it runs again.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        seed: int,
        max_output_tokens: int,
        images: ImageInputs | None = None,
    ) -> None:
        assert prompt_token_ids, "a sequence needs at least one prompt token"
        assert max_output_tokens >= 1
        self.request_id = request_id
        self.seq_id = next(_seq_ids)  # admission order: lower is older
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        # Kept apart from token_ids: every step's RequestOutput hands it on, and slicing a long prompt out of
        # token_ids per sequence per step was the largest host cost of a decode step at batch 64 and 4K context.
        self._prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.seed = seed  # the effective seed (the request's, or one drawn by the engine)
        self.max_output_tokens = max_output_tokens
        self.images = images  # image embeddings spliced over prompt placeholders at every prefill (recompute too)
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.pages: list[int] = []  # physical KV pages of `attn` layers, logical order
        self.slot = 0  # StatePool slot while RUNNING; 0 (the padding slot) otherwise
        self.num_preemptions = 0
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | str | None = None  # the stop token id or stop string that ended it
        # Output bookkeeping (the engine's output processor fills these).
        self.output_logprobs: list[TokenLogprobs] = []
        self.prompt_logprobs: list[TokenLogprobs | None] = []  # position 0 has none
        self.output_text = ""
        self.num_returned_tokens = 0  # output tokens already handed back in a RequestOutput
        self.num_returned_chars = 0
        self.num_returned_logprobs = 0
        self.detok_prefix_offset = 0  # incremental detokenisation window over output tokens
        self.detok_read_offset = 0

    def __len__(self) -> int:
        return len(self.token_ids)

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, tokens={len(self.token_ids)}, computed={self.num_computed_tokens}, "
            f"status={self.status.value}, slot={self.slot}, pages={len(self.pages)})"
        )

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        """The prompt (the same list every call: read it, do not change it)."""
        return self._prompt_token_ids

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def is_decoding(self) -> bool:
        """Only the last sampled token is left to compute, and the earlier ones are cached."""
        return self.num_computed_tokens > 0 and self.num_uncomputed_tokens == 1

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Prompt log-probs were asked for and not every prompt position has them yet."""
        k = self.sampling_params.prompt_logprobs
        return k is not None and len(self.prompt_logprobs) < self.num_prompt_tokens
