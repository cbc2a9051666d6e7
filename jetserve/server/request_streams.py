"""RequestStreams: the asyncio side shared by AsyncEngine (an engine in a thread) and DataParallelRouter (engines in
processes): one queue per request, fed on the event loop from the thread that receives the engines' outputs."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from jetserve.engine.output import RequestOutput
from jetserve.multimodal.inputs import ImageInputs
from jetserve.sampling_params import SamplingParams
from jetserve.server.metrics import ServerMetrics


class RequestRejectedError(Exception):
    """The engine refused a request (its ValueError, whose message names the field before a colon)."""


class EngineDeadError(RuntimeError):
    """The engine loop failed; every request in flight got this error and no new one is accepted."""


@dataclass
class _Stream:
    """One request's channel from the thread receiving engine outputs to the coroutine awaiting it."""

    engine_index: int  # the engine that runs it (a router's replica; 0 for a lone engine)
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)  # RequestOutput | BaseException
    arrival_s: float = field(default_factory=time.perf_counter)
    last_token_s: float | None = None
    num_prompt_tokens: int = 0


class RequestStreams:
    """The part of AsyncEngine's interface that lives on the event loop. A subclass says how a request reaches its
    engine (`_send_add`, `_send_abort`; `_assign`/`_release` when there are several) and when no request may start
    (`_dead_error`); its receiving thread hands outputs and rejections over with `_post`, failures with `_fail`.
    """

    def __init__(self, metrics: ServerMetrics | None) -> None:
        self.metrics = metrics
        self._streams: dict[str, _Stream] = {}  # touched only on the event loop
        self._loop: asyncio.AbstractEventLoop | None = None  # the one event loop the requests come from
        self._error: BaseException | None = None

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, images: ImageInputs | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs until it finishes; abandoning the iterator aborts the request. `images` (a VLM
        prompt's, placeholders expanded) may be shared by several requests: the engine encodes them once.

        Raises RequestRejectedError when the engine refuses the request, EngineDeadError when its loop has failed."""
        error = self._dead_error()
        if error is not None:
            raise error
        assert request_id not in self._streams, f"request id {request_id!r} is already in flight"
        loop = asyncio.get_running_loop()
        assert self._loop in (None, loop), f"a {type(self).__name__} serves one event loop"
        self._loop = loop
        index = self._assign()
        stream = _Stream(index, num_prompt_tokens=len(prompt_token_ids))
        self._streams[request_id] = stream
        finished = False
        try:
            self._send_add(index, request_id, list(prompt_token_ids), params, images)
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True  # the engine never started it, or has already dropped it
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            self._release(index)
            if not finished:
                self._send_abort(index, request_id)
                if self.metrics is not None:
                    self.metrics.request_aborted()

    def abort(self, request_id: str) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            self._send_abort(stream.engine_index, request_id)

    # ---- what a subclass provides ----

    def _dead_error(self) -> EngineDeadError | None:
        """The error a new request gets, or None while it may start."""
        raise NotImplementedError

    def _assign(self) -> int:
        """Pick the engine for a new request (and count it there)."""
        return 0

    def _release(self, engine_index: int) -> None:
        """A request of that engine has left `generate`."""

    def _send_add(
        self,
        engine_index: int,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        images: ImageInputs | None,
    ) -> None:
        raise NotImplementedError

    def _send_abort(self, engine_index: int, request_id: str) -> None:
        raise NotImplementedError

    # ---- from the receiving thread ----

    def _post(self, items: list) -> None:
        """Hand outputs (and (request_id, error) rejections) to the event loop in one callback."""
        self._call_on_loop(self._dispatch, items)

    def _fail(self, error: BaseException, engine_index: int | None = None) -> None:
        """End every stream of one engine (of all engines when None) with `error`."""

        def fail_streams() -> None:
            for stream in self._streams.values():
                if engine_index is None or stream.engine_index == engine_index:
                    stream.queue.put_nowait(error)

        self._call_on_loop(fail_streams)

    def _call_on_loop(self, callback: Callable[..., None], *args) -> None:
        loop = self._loop
        if loop is None:
            return
        try:
            loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:  # the loop has closed (server shutting down)
            pass

    def _dispatch(self, items: list) -> None:
        """On the event loop: route each output (or (request_id, error) rejection) to its request's queue."""
        now = time.perf_counter()
        for item in items:
            if isinstance(item, tuple):
                request_id, error = item
                stream = self._streams.get(request_id)
                if stream is not None:
                    stream.queue.put_nowait(error)
                continue
            stream = self._streams.get(item.request_id)
            if stream is None:
                continue  # its consumer left; the abort is on its way
            if self.metrics is not None:
                self.metrics.output_received(item, stream.num_prompt_tokens, stream.arrival_s, stream.last_token_s, now)
            stream.last_token_s = now
            stream.queue.put_nowait(item)
