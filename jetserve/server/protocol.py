"""OpenAI wire format: request models (validated; errors name the field), response builders, the error body, SSE."""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from jetserve.sampling_params import MAX_LOGPROBS, SamplingParams

MAX_N = 128  # choices per request (each is a sequence in the engine)
MAX_STOP_STRINGS = 16


class ApiError(Exception):
    """An error the client sees as `{"error": {"message", "type", "param", "code"}}` with `status_code`."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        status_code: int = 400,
        type: str = "invalid_request_error",
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status_code = status_code
        self.type = type
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def error_from_validation(e: ValidationError) -> ApiError:
    """The first pydantic error as an ApiError whose `param` is the dotted path of the field (`messages.0.content`)."""
    first = e.errors(include_url=False)[0]
    path: list[str] = []
    for part in first["loc"]:
        if isinstance(part, str) and part in UNION_HINTS.get(path[-1] if path else "", {}).get("tags", ()):
            # A union member's name (`prompt` -> `list[int]`): the member that failed last says little; name the
            # field and the forms it accepts instead.
            param = ".".join(path)
            return ApiError(f"{param}: {UNION_HINTS[path[-1]]['hint']}", param=param)
        path.append(str(part))
    param = ".".join(path) or None
    message = first["msg"].removeprefix("Value error, ")
    if first["type"] == "missing":
        message = "field required"
    elif first["type"] == "extra_forbidden":
        message = "not a supported field"
    return ApiError(f"{param}: {message}" if param else message, param=param)


UNION_HINTS: dict[str, dict[str, Any]] = {
    "prompt": {
        "tags": ("str", "list[str]", "list[int]", "list[list[int]]"),
        "hint": "must be a string, a list of strings, a list of token ids or a list of token-id lists",
    },
    "content": {
        "tags": ("str", "list[tagged-union[TextPart,ImagePart]]", "none"),
        "hint": "must be a string or a list of {'type': 'text', 'text': ...} and {'type': 'image_url', 'image_url': "
        "{'url': ...}} parts",
    },
    "stop": {"tags": ("str", "list[str]", "none"), "hint": "must be a string or a list of non-empty strings"},
}


NonNegFloat = Annotated[float, Field(ge=0)]
Prob = Annotated[float, Field(ge=0, le=1)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False  # a last chunk with the request's usage
    continuous_usage_stats: bool = False  # vLLM's: every chunk carries the usage so far


class _SamplingFields(BaseModel):
    """The sampling fields both endpoints share (OpenAI's plus vLLM's extensions), bounds checked per field.

    Unknown fields are ignored (clients such as guidellm send extras); fields jetserve knows but does not implement
    are rejected unless they hold their neutral value, so a request never silently means something else.
    """

    model_config = ConfigDict(extra="ignore")

    model: str
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    temperature: NonNegFloat | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=-1, lt=2**31)] | None = None  # the sampler keeps it as int32
    min_p: Prob | None = None
    seed: Annotated[int, Field(ge=-(2**63), lt=2**63)] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    best_of: int | None = None
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        return v

    def check_unsupported(self) -> None:
        """Reject the fields jetserve parses but does not implement, unless they hold their neutral value."""
        for name, neutral in (("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0)):
            value = getattr(self, name)
            if value is not None and value != neutral:
                raise ApiError(f"{name}: not supported (only {neutral} is)", param=name)
        if self.logit_bias:
            raise ApiError("logit_bias: not supported", param="logit_bias")
        if self.best_of is not None and self.best_of != self.n:
            raise ApiError("best_of: not supported (it may only equal n)", param="best_of")
        if self.stream_options is not None and not self.stream:
            raise ApiError("stream_options: only allowed when stream is true", param="stream_options")

    def sampling_params(
        self, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None, seed_offset: int
    ) -> SamplingParams:
        """The engine's SamplingParams for choice `seed_offset` (choices of one request get seeds seed, seed+1, ...)."""
        seed = None if self.seed is None else (self.seed + seed_offset + 2**63) % 2**64 - 2**63
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        try:
            return self._make_sampling_params(max_tokens, logprobs, prompt_logprobs, seed, stop)
        except ValueError as e:  # SamplingParams names the field before a colon
            field = str(e).partition(":")[0]
            raise ApiError(str(e), param=field if field.isidentifier() else None) from None

    def _make_sampling_params(
        self, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None, seed: int | None, stop: list[str]
    ) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None or self.top_k == -1 else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            seed=seed,
            stop=tuple(stop),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
        )


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: Annotated[int, Field(ge=0)] | None = 16
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    prompt_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    suffix: str | None = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.suffix:
            raise ApiError("suffix: not supported", param="suffix")
        if self.max_tokens == 0 and not self.echo:
            raise ApiError("max_tokens: 0 is only allowed with echo (scoring the prompt)", param="max_tokens")


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ImageURL(BaseModel):
    model_config = ConfigDict(extra="ignore")
    url: str
    detail: Literal["auto", "low", "high"] | None = None  # accepted; the checkpoint's processor decides the tiling


class ImagePart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["image_url"]
    image_url: ImageURL


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self, image_placeholder: str | None = None) -> str:
        """The content as one string; each image part becomes `image_placeholder` (an error when it is None)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        pieces = []
        for part in self.content:
            if isinstance(part, TextPart):
                pieces.append(part.text)
            elif image_placeholder is None:
                raise ApiError("messages: image parts are not supported by this model", param="messages")
            else:
                pieces.append(image_placeholder)
        return "".join(pieces)

    def image_urls(self) -> list[tuple[int, str]]:
        """(part index, URL) of each image part, in order."""
        if not isinstance(self.content, list):
            return []
        return [(j, part.image_url.url) for j, part in enumerate(self.content) if isinstance(part, ImagePart)]


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    add_generation_prompt: bool = True
    tools: list[dict[str, Any]] | None = None
    response_format: dict[str, Any] | None = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if not self.messages:
            raise ApiError("messages: must hold at least one message", param="messages")
        if self.tools:
            raise ApiError("tools: tool calling is not supported", param="tools")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise ApiError("response_format: only {'type': 'text'} is supported", param="response_format")
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError("top_logprobs: requires logprobs to be true", param="top_logprobs")
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            if self.max_tokens != self.max_completion_tokens:
                raise ApiError("max_completion_tokens: differs from max_tokens; give one of them", param="max_tokens")

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize body: a prompt, or chat messages rendered with the chat template."""

    model_config = ConfigDict(extra="ignore")
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = False  # the byte-level BPE tokenizers jetserve serves add none
    add_generation_prompt: bool = True

    def check_unsupported(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise ApiError("prompt: give exactly one of prompt and messages", param="prompt")


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    tokens: list[int]

    def check_unsupported(self) -> None:
        pass


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not a JSON value")


def parse_request(model: type[BaseModel], body: bytes) -> Any:
    """Decode a JSON body into `model`, raising ApiError (400) for malformed JSON or an invalid field."""
    try:
        data = json.loads(body, parse_constant=_reject_constant)
    except ValueError as e:  # bad syntax, bad UTF-8, or NaN/±Infinity (Python's parser takes them; JSON has none)
        raise ApiError(f"malformed JSON body: {e}", code="malformed_json") from None
    if not isinstance(data, dict):
        raise ApiError("the request body must be a JSON object", code="malformed_json")
    try:
        request = model.model_validate(data)
    except ValidationError as e:
        raise error_from_validation(e) from None
    request.check_unsupported()
    return request


# Responses.


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def sse(data: dict[str, Any] | str) -> bytes:
    """One server-sent event: `data: <json>` and a blank line."""
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    return f"data: {text}\n\n".encode()


SSE_DONE = sse("[DONE]")


class CompletionLogprobs:
    """The legacy completions `logprobs` object (tokens, token_logprobs, top_logprobs, text_offset), built up."""

    def __init__(self, text_offset: int = 0) -> None:
        self.tokens: list[str] = []
        self.token_logprobs: list[float | None] = []
        self.top_logprobs: list[dict[str, float] | None] = []
        self.text_offset: list[int] = []
        self._offset = text_offset

    def append(self, token: str, logprob: float | None, top: dict[str, float] | None) -> None:
        self.tokens.append(token)
        self.token_logprobs.append(logprob)
        self.top_logprobs.append(top)
        self.text_offset.append(self._offset)
        self._offset += len(token)

    def to_dict(self) -> dict[str, Any]:
        return {
            "tokens": self.tokens,
            "token_logprobs": self.token_logprobs,
            "top_logprobs": self.top_logprobs,
            "text_offset": self.text_offset,
        }


def chat_logprob_entry(token: str, logprob: float, top: list[tuple[str, float]]) -> dict[str, Any]:
    """One element of a chat choice's `logprobs.content`."""
    return {
        "token": token,
        "logprob": logprob,
        "bytes": list(token.encode()),
        "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode())} for t, lp in top],
    }
