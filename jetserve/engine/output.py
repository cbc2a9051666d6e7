"""RequestOutput and the output processing of a step: incremental detokenisation, stop strings, what to stream."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from jetserve.engine.sequence import Sequence, TokenLogprobs


class Detokenizer(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


@dataclass
class RequestOutput:
    """One request's progress after a step: what is new since the last output, and everything so far.

    `finish_reason` is "stop" (EOS, stop token or stop string; `stop_reason` names the token id or string, None for
    EOS), "length" or "abort". `prompt_logprobs` (position 0 has none) and `logprobs` are the whole lists so far,
    `new_logprobs` those of `new_token_ids`.

    `output_token_ids` (every output token so far) is sliced when read, out of the sequence's token list (which only
    grows): copying it into every request's output at every step made a decode step's host work grow with the output
    length (batch 256 after 1000 tokens: 2.9 ms per step against 0.9 ms at the start, on this project's CPU machine).
    Pickling (the data-parallel replicas send outputs to the front end) takes the slice, not the whole list.
    """

    request_id: str
    prompt_token_ids: list[int]
    new_token_ids: list[int]
    new_text: str
    text: str
    finished: bool
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    new_logprobs: list[TokenLogprobs] | None = None
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    num_preemptions: int = 0
    sequence_token_ids: list[int] = field(default_factory=list, repr=False, compare=False)  # prompt ++ output, shared
    output_span: tuple[int, int] = (0, 0)  # [start, end) of this output's tokens in `sequence_token_ids`

    @property
    def output_token_ids(self) -> list[int]:
        start, end = self.output_span
        return self.sequence_token_ids[start:end]

    def __getstate__(self) -> dict:
        output = self.output_token_ids
        return self.__dict__ | {"sequence_token_ids": output, "output_span": (0, len(output))}


class OutputProcessor:
    """Turns sequences that got tokens into RequestOutputs. Text is decoded incrementally: each step decodes only a
    short window of the newest tokens, and holds back an incomplete UTF-8 character until the next token completes it.
    With stop strings, the last `len(longest stop) - 1` characters are held back too until they cannot start one."""

    def __init__(self, tokenizer: Detokenizer | None) -> None:
        self.tokenizer = tokenizer

    def decode_new_text(self, seq: Sequence, flush: bool = False) -> str:
        """The text the newest output tokens add (everything pending when `flush`)."""
        if self.tokenizer is None:
            return ""
        # Offsets count output tokens; slice the window out of token_ids directly (no copy of the whole output).
        ids, first = seq.token_ids, seq.num_prompt_tokens
        skip = seq.sampling_params.skip_special_tokens
        window = ids[first + seq.detok_prefix_offset :]
        read = seq.detok_read_offset - seq.detok_prefix_offset
        prefix = self.tokenizer.decode(window[:read], skip_special_tokens=skip)
        full = self.tokenizer.decode(window, skip_special_tokens=skip)
        if len(full) <= len(prefix) or (full.endswith("\ufffd") and not flush):
            return ""
        seq.detok_prefix_offset = seq.detok_read_offset
        seq.detok_read_offset = len(ids) - first
        return full[len(prefix) :]

    def find_stop_string(self, seq: Sequence, num_old_chars: int) -> str | None:
        """Look for a stop string in the text added since `num_old_chars`; truncate the text at the first one."""
        params = seq.sampling_params
        if not params.stop:
            return None
        longest = max(len(s) for s in params.stop)
        search_from = max(0, num_old_chars - longest + 1)
        found: tuple[int, str] | None = None
        for stop in params.stop:
            index = seq.output_text.find(stop, search_from)
            if index >= 0 and (found is None or index < found[0]):
                found = (index, stop)
        if found is None:
            return None
        index, stop = found
        seq.output_text = seq.output_text[: index + (len(stop) if params.include_stop_str_in_output else 0)]
        return stop

    def make_output(self, seq: Sequence) -> RequestOutput:
        """What is new in `seq` since its last RequestOutput (call after its text and finish state are final)."""
        text_end = len(seq.output_text)
        stops = seq.sampling_params.stop
        if stops and not seq.is_finished:
            text_end = max(seq.num_returned_chars, text_end - (max(len(s) for s in stops) - 1))
        num_tokens = seq.num_tokens
        new_logprobs = None
        if seq.sampling_params.logprobs is not None:
            new_logprobs = seq.output_logprobs[seq.num_returned_logprobs :]
            seq.num_returned_logprobs = len(seq.output_logprobs)
        out = RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=seq.prompt_token_ids,
            new_token_ids=seq.token_ids[seq.num_prompt_tokens + seq.num_returned_tokens : num_tokens],
            new_text=seq.output_text[seq.num_returned_chars : text_end],
            text=seq.output_text[:text_end],
            finished=seq.is_finished,
            finish_reason=seq.finish_reason.value if seq.finish_reason is not None else None,
            stop_reason=seq.stop_reason,
            new_logprobs=new_logprobs,
            logprobs=seq.output_logprobs if seq.sampling_params.logprobs is not None else None,
            prompt_logprobs=seq.prompt_logprobs if seq.sampling_params.prompt_logprobs is not None else None,
            num_preemptions=seq.num_preemptions,
            sequence_token_ids=seq.token_ids,
            output_span=(seq.num_prompt_tokens, num_tokens),
        )
        seq.num_returned_tokens = num_tokens - seq.num_prompt_tokens
        seq.num_returned_chars = text_end
        return out
