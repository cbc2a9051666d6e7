"""RequestOutput and the output processing of a step: incremental detokenisation, stop strings, what to stream."""

from __future__ import annotations

from dataclasses import dataclass
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
    """

    request_id: str
    prompt_token_ids: list[int]
    new_token_ids: list[int]
    new_text: str
    output_token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    new_logprobs: list[TokenLogprobs] | None = None
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    num_preemptions: int = 0


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
        output_ids = seq.output_token_ids
        new_logprobs = None
        if seq.sampling_params.logprobs is not None:
            new_logprobs = seq.output_logprobs[seq.num_returned_logprobs :]
            seq.num_returned_logprobs = len(seq.output_logprobs)
        out = RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=seq.prompt_token_ids,
            new_token_ids=output_ids[seq.num_returned_tokens :],
            new_text=seq.output_text[seq.num_returned_chars : text_end],
            output_token_ids=output_ids,
            text=seq.output_text[:text_end],
            finished=seq.is_finished,
            finish_reason=seq.finish_reason.value if seq.finish_reason is not None else None,
            stop_reason=seq.stop_reason,
            new_logprobs=new_logprobs,
            logprobs=seq.output_logprobs if seq.sampling_params.logprobs is not None else None,
            prompt_logprobs=seq.prompt_logprobs if seq.sampling_params.prompt_logprobs is not None else None,
            num_preemptions=seq.num_preemptions,
        )
        seq.num_returned_tokens = len(output_ids)
        seq.num_returned_chars = text_end
        return out
