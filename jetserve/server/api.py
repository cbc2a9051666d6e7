"""The HTTP API on FastAPI: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics, and vLLM's
/tokenize, /detokenize and /tokenizer_info (lm-eval's remote tokenizer)."""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from jetserve.engine.output import RequestOutput
from jetserve.engine.sequence import TokenLogprobs
from jetserve.multimodal.inputs import ImageInputs
from jetserve.multimodal.processor import ImageError, ImageLimits, ImageProcessor, decode_data_url, decode_image
from jetserve.sampling_params import SamplingParams
from jetserve.server.async_engine import AsyncEngine, EngineDeadError, RequestRejectedError
from jetserve.server.metrics import CONTENT_TYPE, ServerMetrics
from jetserve.server.protocol import (
    SSE_DONE,
    ApiError,
    ChatCompletionRequest,
    CompletionLogprobs,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    chat_logprob_entry,
    new_id,
    now,
    parse_request,
    sse,
    usage,
)
from jetserve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


@dataclass
class _Choice:
    """One sequence the engine runs for a request: its place in `choices`, its prompt and its parameters."""

    index: int
    prompt_ids: list[int]
    prompt_text: str
    params: SamplingParams
    request_id: str
    images: ImageInputs | None = None  # shared by the choices of one chat request


@dataclass
class _Result:
    """What a finished choice accumulated from its outputs."""

    text: str = ""
    token_ids: list[int] | None = None
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class OpenAIServer:
    """Turns OpenAI requests into engine requests (one per choice) and engine outputs into OpenAI responses."""

    def __init__(
        self,
        engine: AsyncEngine,
        tokenizer: Tokenizer,
        model_names: list[str],
        api_key: str | None = None,
        metrics: ServerMetrics | None = None,
        allow_image_urls: bool = False,
        image_limits: ImageLimits | None = None,
    ) -> None:
        """`allow_image_urls` lets chat image parts name http(s) URLs the server then fetches (by default only
        data: URLs are accepted); `image_limits` bounds images per request, bytes and pixels per image."""
        assert model_names, "a server needs a model name"
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_names = model_names
        self.api_key = api_key
        self.metrics = metrics or ServerMetrics(model_names[0])
        self.vocab_size = engine.engine.model_config.vocab_size
        self.token_text = lru_cache(maxsize=1 << 16)(self._token_text)
        self.allow_image_urls = allow_image_urls
        self.image_limits = image_limits or ImageLimits()
        self.image_processor: ImageProcessor | None = None
        self.image_placeholder: str | None = None  # the image token's text, where an image part sits in the prompt
        llm_engine = engine.engine
        # Whether this server speculates is configuration, not what a window of traffic happened to show.
        self.metrics.spec_enabled.set(1 if getattr(getattr(llm_engine, "config", None), "draft", None) else 0)
        if getattr(llm_engine, "vision", None) is not None:
            line_feed = tokenizer.encode("\n")
            assert len(line_feed) == 1, "the tokenizer must encode a line feed as one token"
            self.image_processor = ImageProcessor.from_pretrained(llm_engine.config.model, line_feed[0])
            self.image_placeholder = tokenizer.decode([self.image_processor.image_token_id], skip_special_tokens=False)

    # ---- requests to choices ----

    def _check_model(self, model: str) -> None:
        if model not in self.model_names:
            raise ApiError(
                f"model: {model!r} is not served here (served: {', '.join(self.model_names)})",
                param="model",
                code="model_not_found",
            )

    def _check_prompt(self, ids: list[int], param: str) -> None:
        if not ids:
            raise ApiError(f"{param}: empty (it must hold at least one token)", param=param)
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ApiError(f"{param}: token id {bad} is outside the vocabulary [0, {self.vocab_size})", param=param)
        if len(ids) >= self.engine.max_model_len:
            raise ApiError(
                f"{param}: {len(ids)} tokens leave no room for output in the model's context of "
                f"{self.engine.max_model_len} tokens",
                param=param,
            )

    def _max_tokens(self, requested: int | None, num_prompt_tokens: int, param: str) -> int:
        """`requested` checked against the context; None means everything the context has left."""
        room = self.engine.max_model_len - num_prompt_tokens
        if requested is None:
            return room
        if requested > room:
            raise ApiError(
                f"{param}: the prompt ({num_prompt_tokens} tokens) plus {param} ({requested}) exceeds the model's "
                f"context of {self.engine.max_model_len} tokens",
                param=param,
            )
        return requested

    def _completion_prompts(self, prompt: str | list) -> list[tuple[list[int], str]]:
        """(token ids, text) of each prompt: a string, a list of strings, a list of ids or a list of id lists."""
        if isinstance(prompt, str):
            items: list = [prompt]
        elif prompt and isinstance(prompt[0], int):
            items = [prompt]
        else:
            items = list(prompt)
        if not items:
            raise ApiError("prompt: empty (give a string, token ids, or a non-empty list of them)", param="prompt")
        prompts = []
        for item in items:
            if isinstance(item, str):
                prompts.append((self.tokenizer.encode(item), item))
            else:
                self._check_prompt(list(item), "prompt")  # before decoding: the ids may be out of range
                prompts.append((list(item), self.tokenizer.decode(list(item), skip_special_tokens=False)))
        return prompts

    def _chat_prompt(self, req: ChatCompletionRequest) -> list[int]:
        """The rendered chat as token ids; each image part is one image placeholder token (not yet expanded)."""
        messages = [{"role": m.role, "content": m.text(self.image_placeholder)} for m in req.messages]
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt)
        except Exception as e:  # jinja errors and the template's own raise_exception
            raise ApiError(f"messages: the chat template rejected them: {e}", param="messages") from None
        return self.tokenizer.encode(text)

    async def _chat_inputs(self, req: ChatCompletionRequest) -> tuple[list[int], ImageInputs | None]:
        """The chat's prompt ids with each image's placeholder expanded, and its images ready for the engine. Image
        bytes arrive (data: URLs, or fetched) here; decoding and preprocessing run on a worker thread, off both the
        event loop and the engine's step loop."""
        parts = [(f"messages.{i}.content.{j}.image_url", url) for i, m in enumerate(req.messages)
                 for j, url in m.image_urls()]  # fmt: skip
        if not parts:
            return self._chat_prompt(req), None
        if self.image_processor is None:
            raise ApiError(f"{parts[0][0]}: this model does not take images", param=parts[0][0])
        limit = self.image_limits.max_images_per_request
        if len(parts) > limit:
            raise ApiError(f"messages: {len(parts)} images; at most {limit} per request", param="messages")
        prompt_ids = self._chat_prompt(req)
        data = [await self._image_bytes(param, url) for param, url in parts]
        return await asyncio.to_thread(self._prepare_images, prompt_ids, data, [param for param, _ in parts])

    async def _image_bytes(self, param: str, url: str) -> bytes:
        limits = self.image_limits
        if url.startswith("data:"):
            try:
                return decode_data_url(url, limits)
            except ImageError as e:
                raise ApiError(f"{param}: {e}", param=param) from None
        if not url.startswith(("http://", "https://")):
            raise ApiError(f"{param}: unsupported URL (expected data:image/...;base64,... or http(s))", param=param)
        if not self.allow_image_urls:
            raise ApiError(
                f"{param}: this server does not fetch image URLs; send the image inline as a data:image/...;base64 "
                "URL (or start the server with --allow-image-urls)",
                param=param,
            )
        return await _fetch_image(url, param, limits)

    def _prepare_images(
        self, prompt_ids: list[int], data: list[bytes], params: list[str]
    ) -> tuple[list[int], ImageInputs]:
        assert self.image_processor is not None
        images = []
        for raw, param in zip(data, params, strict=True):
            try:
                images.append(decode_image(raw, self.image_limits))
            except ImageError as e:
                raise ApiError(f"{param}: {e}", param=param) from None
        try:
            return self.image_processor.expand(prompt_ids, self.image_processor.tiles(images))
        except ImageError as e:
            raise ApiError(f"messages: {e}", param="messages") from None

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    # ---- running choices ----

    async def _results(self, choices: list[_Choice]) -> list[_Result]:
        results = [_Result() for _ in choices]
        async with aclosing(self._generate(choices)) as outputs:
            async for i, out in outputs:
                _accumulate(results[i], out)
        return results

    def _generate(self, choices: list[_Choice]) -> AsyncIterator[tuple[int, RequestOutput]]:
        return _merge([self.engine.generate(c.request_id, c.prompt_ids, c.params, c.images) for c in choices])

    # ---- /v1/completions ----

    async def completions(self, request: Request) -> Response:
        req: CompletionRequest = parse_request(CompletionRequest, await request.body())
        self._check_model(req.model)
        prompts = self._completion_prompts(req.prompt)
        k = req.logprobs
        prompt_k = k if req.echo and k is not None else req.prompt_logprobs
        choices = []
        base_id = new_id("cmpl")
        for p, (ids, text) in enumerate(prompts):
            self._check_prompt(ids, "prompt")
            max_tokens = self._max_tokens(req.max_tokens, len(ids), "max_tokens")
            for j in range(req.n):
                # max_tokens 0 (echo only) still samples one token, which is dropped: the prompt's log-probs come
                # from the same forward.
                params = req.sampling_params(max(max_tokens, 1), k, prompt_k, seed_offset=j)
                choices.append(_Choice(p * req.n + j, ids, text, params, f"{base_id}-{p * req.n + j}"))
        num_prompt_tokens = sum(len(ids) for ids, _ in prompts)
        score_only = req.max_tokens == 0
        if req.stream:
            return _SSEResponse(self._stream_completions(req, base_id, choices, num_prompt_tokens, score_only))
        results = await _unless_disconnected(request, self._results(choices))
        if results is None:
            return Response(status_code=499)
        body_choices = []
        completion_tokens = 0
        for choice, result in zip(choices, results, strict=True):
            assert result.token_ids is not None
            token_ids = [] if score_only else result.token_ids
            output_logprobs = [] if score_only else (result.logprobs or [])
            completion_tokens += len(token_ids)
            text = (choice.prompt_text if req.echo else "") + ("" if score_only else result.text)
            logprobs = None
            if k is not None:
                lp = CompletionLogprobs(0 if req.echo else len(choice.prompt_text))
                if req.echo:
                    self._add_prompt_logprobs(lp, choice.prompt_ids, result.prompt_logprobs)
                for entry in output_logprobs:
                    lp.append(self.token_text(entry.token_id), entry.logprob, self._top_dict(entry))
                logprobs = lp.to_dict()
            body_choices.append({
                "index": choice.index,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": "length" if score_only else result.finish_reason,
                "stop_reason": None if score_only else result.stop_reason,
                **({"prompt_logprobs": self._prompt_logprobs_json(result)} if req.prompt_logprobs is not None else {}),
            })  # fmt: skip
        return JSONResponse({
            "id": base_id,
            "object": "text_completion",
            "created": now(),
            "model": req.model,
            "choices": body_choices,
            "usage": usage(num_prompt_tokens, completion_tokens),
        })  # fmt: skip

    async def _stream_completions(
        self, req: CompletionRequest, base_id: str, choices: list[_Choice], num_prompt_tokens: int, score_only: bool
    ) -> AsyncIterator[bytes]:
        created = now()
        completion_tokens = 0
        has_started = [False] * len(choices)
        options = req.stream_options
        async with aclosing(self._generate(choices)) as outputs:
            async for i, out in outputs:
                if not score_only:
                    completion_tokens += len(out.new_token_ids)
                data = {"id": base_id, "object": "text_completion", "created": created, "model": req.model,
                        "choices": [self._completion_chunk(req, choices[i], out, has_started, score_only)]}  # fmt: skip
                if options is not None and options.continuous_usage_stats:
                    data["usage"] = usage(num_prompt_tokens, completion_tokens)
                yield sse(data)
        if options is not None and options.include_usage:
            yield sse({
                "id": base_id, "object": "text_completion", "created": created, "model": req.model, "choices": [],
                "usage": usage(num_prompt_tokens, completion_tokens),
            })  # fmt: skip
        yield SSE_DONE

    def _completion_chunk(
        self,
        req: CompletionRequest,
        choice: _Choice,
        out: RequestOutput,
        has_started: list[bool],
        score_only: bool,
    ) -> dict[str, Any]:
        """One choice of a streamed completion chunk; the first of each choice carries the echoed prompt."""
        i = choice.index
        lp = None if req.logprobs is None else CompletionLogprobs(0 if req.echo else len(choice.prompt_text))
        text = ""
        if not has_started[i]:
            has_started[i] = True
            if req.echo:
                text = choice.prompt_text
                if lp is not None:
                    self._add_prompt_logprobs(lp, choice.prompt_ids, out.prompt_logprobs)
        if not score_only:
            text += out.new_text
            if lp is not None:
                for entry in out.new_logprobs or []:
                    lp.append(self.token_text(entry.token_id), entry.logprob, self._top_dict(entry))
        finish = ("length" if score_only else out.finish_reason) if out.finished else None
        stop = None if score_only else out.stop_reason
        logprobs = None if lp is None else lp.to_dict()
        return {"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish, "stop_reason": stop}

    def _add_prompt_logprobs(
        self, lp: CompletionLogprobs, prompt_ids: list[int], entries: list[TokenLogprobs | None] | None
    ) -> None:
        assert entries is not None and len(entries) == len(prompt_ids), "echo asked the engine for prompt log-probs"
        for token_id, entry in zip(prompt_ids, entries, strict=True):
            if entry is None:  # the first token has no context to be predicted from
                lp.append(self.token_text(token_id), None, None)
            else:
                lp.append(self.token_text(token_id), entry.logprob, self._top_dict(entry))

    def _top_dict(self, entry: TokenLogprobs) -> dict[str, float]:
        """The top alternatives as {token text: log-prob}, the chosen token included (as vLLM returns them).

        Distinct tokens can share a text (byte pieces of one character all read "\ufffd"); such a key keeps the
        largest log-prob, so `max(top.values())` still equals the chosen token's exactly when it was the argmax."""
        top: dict[str, float] = {}
        pairs = [*zip(entry.top_ids, entry.top_logprobs, strict=True), (entry.token_id, entry.logprob)]
        for token_id, logprob in pairs:
            text = self.token_text(token_id)
            top[text] = max(logprob, top.get(text, logprob))
        return top

    def _prompt_logprobs_json(self, result: _Result) -> list[dict[str, Any] | None]:
        """vLLM's `prompt_logprobs`: per prompt token, {token id: {"logprob", "decoded_token"}} (None first)."""
        entries = result.prompt_logprobs or []
        out: list[dict[str, Any] | None] = []
        for entry in entries:
            if entry is None:
                out.append(None)
                continue
            pairs = [(entry.token_id, entry.logprob), *zip(entry.top_ids, entry.top_logprobs, strict=True)]
            out.append({str(t): {"logprob": lp, "decoded_token": self.token_text(t)} for t, lp in pairs})
        return out

    # ---- /v1/chat/completions ----

    async def chat_completions(self, request: Request) -> Response:
        req: ChatCompletionRequest = parse_request(ChatCompletionRequest, await request.body())
        self._check_model(req.model)
        prompt_ids, images = await self._chat_inputs(req)
        self._check_prompt(prompt_ids, "messages")
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = self._max_tokens(req.requested_max_tokens, len(prompt_ids), param)
        k = (req.top_logprobs or 0) if req.logprobs else None
        base_id = new_id("chatcmpl")
        choices = [
            _Choice(j, prompt_ids, "", req.sampling_params(max_tokens, k, None, seed_offset=j), f"{base_id}-{j}",
                    images)
            for j in range(req.n)
        ]  # fmt: skip
        if req.stream:
            return _SSEResponse(self._stream_chat(req, base_id, choices))
        results = await _unless_disconnected(request, self._results(choices))
        if results is None:
            return Response(status_code=499)
        body_choices = []
        for choice, result in zip(choices, results, strict=True):
            logprobs = None
            if k is not None:
                logprobs = {"content": [self._chat_logprob(e) for e in result.logprobs or []]}
            body_choices.append({
                "index": choice.index,
                "message": {"role": "assistant", "content": result.text},
                "logprobs": logprobs,
                "finish_reason": result.finish_reason,
                "stop_reason": result.stop_reason,
            })  # fmt: skip
        completion_tokens = sum(len(r.token_ids or []) for r in results)
        return JSONResponse({
            "id": base_id,
            "object": "chat.completion",
            "created": now(),
            "model": req.model,
            "choices": body_choices,
            "usage": usage(len(prompt_ids), completion_tokens),
        })  # fmt: skip

    def _chat_logprob(self, entry: TokenLogprobs) -> dict[str, Any]:
        top = [(self.token_text(t), lp) for t, lp in zip(entry.top_ids, entry.top_logprobs, strict=True)]
        return chat_logprob_entry(self.token_text(entry.token_id), entry.logprob, top)

    async def _stream_chat(
        self, req: ChatCompletionRequest, base_id: str, choices: list[_Choice]
    ) -> AsyncIterator[bytes]:
        created = now()
        options = req.stream_options
        num_prompt_tokens = len(choices[0].prompt_ids)
        completion_tokens = 0

        def chunk(choice: dict[str, Any]) -> bytes:
            data = {"id": base_id, "object": "chat.completion.chunk", "created": created, "model": req.model,
                    "choices": [choice]}  # fmt: skip
            if options is not None and options.continuous_usage_stats:
                data["usage"] = usage(num_prompt_tokens, completion_tokens)
            return sse(data)

        for choice in choices:
            yield chunk({"index": choice.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                         "finish_reason": None})  # fmt: skip
        async with aclosing(self._generate(choices)) as outputs:
            async for i, out in outputs:
                completion_tokens += len(out.new_token_ids)
                logprobs = None
                if req.logprobs:
                    logprobs = {"content": [self._chat_logprob(e) for e in out.new_logprobs or []]}
                yield chunk({
                    "index": choices[i].index,
                    "delta": {"content": out.new_text},
                    "logprobs": logprobs,
                    "finish_reason": out.finish_reason if out.finished else None,
                    "stop_reason": out.stop_reason if out.finished else None,
                })  # fmt: skip
        if options is not None and options.include_usage:
            yield sse({"id": base_id, "object": "chat.completion.chunk", "created": created, "model": req.model,
                       "choices": [], "usage": usage(num_prompt_tokens, completion_tokens)})  # fmt: skip
        yield SSE_DONE

    # ---- the rest ----

    def models(self) -> dict[str, Any]:
        created = now()
        return {
            "object": "list",
            "data": [
                {"id": name, "object": "model", "created": created, "owned_by": "jetserve", "root": name,
                 "max_model_len": self.engine.max_model_len}
                for name in self.model_names
            ],
        }  # fmt: skip

    async def tokenize(self, request: Request) -> dict[str, Any]:
        """vLLM's /tokenize: {"prompt"} or {"messages"} to token ids (what lm-eval's remote tokenizer calls)."""
        req: TokenizeRequest = parse_request(TokenizeRequest, await request.body())
        if req.messages is not None:
            chat = ChatCompletionRequest(model=self.model_names[0], messages=req.messages,
                                         add_generation_prompt=req.add_generation_prompt)  # fmt: skip
            tokens = self._chat_prompt(chat)
        else:
            assert req.prompt is not None
            tokens = self.tokenizer.encode(req.prompt)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": self.engine.max_model_len}

    async def detokenize(self, request: Request) -> dict[str, Any]:
        req: DetokenizeRequest = parse_request(DetokenizeRequest, await request.body())
        bad = next((t for t in req.tokens if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ApiError(f"tokens: token id {bad} is outside the vocabulary [0, {self.vocab_size})", param="tokens")
        return {"prompt": self.tokenizer.decode(req.tokens, skip_special_tokens=False)}

    def tokenizer_info(self) -> dict[str, Any]:
        config = self.tokenizer.config

        def special(name: str) -> str | None:
            value = config.get(name)
            return value.get("content") if isinstance(value, dict) else value

        return {
            "tokenizer_class": config.get("tokenizer_class"),
            "eos_token": special("eos_token"),
            "bos_token": special("bos_token"),
            "pad_token": special("pad_token"),
            "chat_template": self.tokenizer.chat_template,
            "model_max_length": self.engine.max_model_len,
        }

    def is_authorized(self, headers: Headers) -> bool:
        if self.api_key is None:
            return True
        header = headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.api_key.encode())


async def _fetch_image(url: str, param: str, limits: ImageLimits, timeout_s: float = 30.0) -> bytes:
    """GET an image URL (only with --allow-image-urls), reading at most `limits.max_image_bytes`."""
    import httpx

    try:
        async with httpx.AsyncClient(timeout=timeout_s, follow_redirects=True) as client:
            async with client.stream("GET", url) as response:
                if response.status_code != 200:
                    raise ApiError(f"{param}: fetching the image got HTTP {response.status_code}", param=param)
                data = bytearray()
                async for chunk in response.aiter_bytes():
                    data += chunk
                    if len(data) > limits.max_image_bytes:
                        raise ApiError(f"{param}: image too large: over {limits.max_image_bytes} bytes", param=param)
                return bytes(data)
    except httpx.HTTPError as e:
        raise ApiError(f"{param}: could not fetch the image ({type(e).__name__}: {e})", param=param) from None


def _accumulate(result: _Result, out: RequestOutput) -> None:
    if out.prompt_logprobs is not None:
        result.prompt_logprobs = out.prompt_logprobs
    result.text = out.text
    result.token_ids = out.output_token_ids
    result.logprobs = out.logprobs
    result.finish_reason = out.finish_reason
    result.stop_reason = out.stop_reason


async def _merge(gens: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several requests' outputs as they come, tagged with the generator's index. One generator is
    iterated directly; several run as tasks. Leaving early (an error, a disconnect) closes them all, which aborts
    their requests."""
    if len(gens) == 1:
        try:
            async for out in gens[0]:
                yield 0, out
        finally:
            await gens[0].aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, gen: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in gen:
                queue.put_nowait((i, out))
            queue.put_nowait((i, None))
        except Exception as e:
            queue.put_nowait((i, e))

    tasks = [asyncio.create_task(pump(i, gen)) for i, gen in enumerate(gens)]
    try:
        remaining = len(gens)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _unless_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """Await `work`, or cancel it (aborting its requests) and return None when the client disconnects first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.create_task(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    return None if task.cancelled() else task.result()


async def _wait_for_disconnect(request: Request) -> None:
    """Returns when the client goes away (the body has been read, so the next ASGI message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _SSEResponse(StreamingResponse):
    """A `text/event-stream` response that closes its body iterator however the stream ends, so an abandoned
    stream's requests are aborted at once rather than when the generator is garbage-collected."""

    def __init__(self, body: AsyncIterator[bytes]) -> None:
        super().__init__(_sse_errors(body), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def stream_response(self, send: Callable) -> None:
        try:
            await super().stream_response(send)
        finally:
            with anyio.CancelScope(shield=True):  # a disconnect cancels this task; the clean-up must still run
                await self.body_iterator.aclose()


async def _sse_errors(body: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Pass the body through; an error after the stream started becomes an `error` event and `[DONE]`."""
    try:
        async for data in body:
            yield data
    except ApiError as e:
        yield sse(e.body())
        yield SSE_DONE
    except RequestRejectedError as e:
        yield sse(_engine_rejection(e).body())
        yield SSE_DONE
    except EngineDeadError as e:
        yield sse(ApiError(str(e), status_code=503, type="server_error").body())
        yield SSE_DONE
    finally:
        await body.aclose()


def _engine_rejection(e: RequestRejectedError) -> ApiError:
    """The engine names the field before a colon (`max_tokens: ...`)."""
    message = str(e)
    field, sep, _ = message.partition(":")
    return ApiError(message, param=field if sep and field.isidentifier() else None)


class _ApiKeyMiddleware:
    """401 for /v1 requests without the server's key (a plain ASGI middleware: streamed bodies pass untouched)."""

    def __init__(self, app: ASGIApp, server: OpenAIServer) -> None:
        self.app = app
        self.server = server

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            if not self.server.is_authorized(Headers(scope=scope)):
                error = ApiError("invalid or missing API key", status_code=401, code="invalid_api_key")
                response = JSONResponse(error.body(), status_code=401, headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(server: OpenAIServer) -> FastAPI:
    """The FastAPI app around `server`; its lifespan starts and stops the engine thread."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        server.engine.start()
        try:
            yield
        finally:
            server.engine.shutdown()

    app = FastAPI(title="jetserve", lifespan=lifespan)

    app.add_middleware(_ApiKeyMiddleware, server=server)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status_code)

    @app.exception_handler(RequestRejectedError)
    async def engine_rejection(request: Request, e: RequestRejectedError) -> JSONResponse:
        error = _engine_rejection(e)
        return JSONResponse(error.body(), status_code=error.status_code)

    @app.exception_handler(EngineDeadError)
    async def engine_dead(request: Request, e: EngineDeadError) -> JSONResponse:
        return JSONResponse(ApiError(str(e), status_code=503, type="server_error").body(), status_code=503)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception) -> JSONResponse:
        logger.exception("internal error on %s", request.url.path)
        error = ApiError(f"internal server error: {type(e).__name__}", status_code=500, type="server_error")
        return JSONResponse(error.body(), status_code=500)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await server.completions(request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await server.chat_completions(request)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return server.models()

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        return await server.tokenize(request)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        return await server.detokenize(request)

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict[str, Any]:
        return server.tokenizer_info()

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if server.engine.is_alive else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    return app
