"""SamplingParams: how one request samples and when it stops (vLLM's meanings), validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

MAX_LOGPROBS = 20  # the most top log-probs a request may ask for, per token (vLLM's default cap)


@dataclass(frozen=True)
class SamplingParams:
    """One request's sampling and stopping rules.

    temperature 0 is greedy (argmax); top_k 0 or -1, top_p 1 and min_p 0 switch those filters off. `seed` makes the
    request's draws reproducible whatever else is in the batch. `stop` strings end the text (excluded from it unless
    `include_stop_str_in_output`); `stop_token_ids` and the model's EOS (unless `ignore_eos`) end it too. `logprobs`
    = k returns, per output token, the log-prob of the sampled token plus the k most likely; `prompt_logprobs` = k the
    same for every prompt token after the first. Log-probs are of the raw model distribution (before temperature and
    filters). `max_tokens` None generates until the model's context is full.
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default=())
    stop_token_ids: tuple[int, ...] = field(default=())
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        # Accept a bare string or any sequence for the tuple fields (frozen: set through object.__setattr__).
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)  # vLLM's spelling of "off"
        self._validate()

    def _validate(self) -> None:
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens: must be an integer ≥ 1 or None, got {self.max_tokens!r}")
        if not _is_number(self.temperature) or not 0 <= self.temperature < math.inf:
            raise ValueError(f"temperature: must be a finite number ≥ 0, got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p!r}")
        # The sampler keeps top_k per slot in int32 on the device.
        if not _is_int(self.top_k) or not 0 <= self.top_k < 2**31:
            raise ValueError(f"top_k: must be an integer in [0, 2**31) (0 or -1 disables it), got {self.top_k!r}")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p: must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and (not _is_int(self.seed) or not -(2**63) <= self.seed < 2**63):
            raise ValueError(f"seed: must be a 64-bit integer or None, got {self.seed!r}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop: every stop string must be a non-empty string, got {s!r}")
        for t in self.stop_token_ids:
            if not _is_int(t) or t < 0:
                raise ValueError(f"stop_token_ids: every id must be an integer ≥ 0, got {t!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise ValueError(f"{name}: must be an integer in [0, {MAX_LOGPROBS}] or None, got {value!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x  # x == x rejects NaN
