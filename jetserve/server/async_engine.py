"""AsyncEngine: runs LLMEngine's step loop in its own thread and fans its outputs out to per-request asyncio queues."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from jetserve.engine.engine import LLMEngine
from jetserve.engine.output import RequestOutput
from jetserve.multimodal.inputs import ImageInputs
from jetserve.sampling_params import SamplingParams
from jetserve.server.metrics import ServerMetrics

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.5  # how long the idle loop sleeps between checks when no command wakes it


class RequestRejectedError(Exception):
    """The engine refused a request (its ValueError, whose message names the field before a colon)."""


class EngineDeadError(RuntimeError):
    """The engine loop failed; every request in flight got this error and no new one is accepted."""


@dataclass
class _Stream:
    """One request's channel from the engine thread to the coroutine awaiting it."""

    queue: asyncio.Queue = field(default_factory=asyncio.Queue)  # RequestOutput | BaseException
    arrival_s: float = field(default_factory=time.perf_counter)
    last_token_s: float | None = None
    num_prompt_tokens: int = 0


class AsyncEngine:
    """The engine is not thread-safe, so only its thread touches it: coroutines hand `add`/`abort` commands over a
    locked list and wake the thread; after each step the thread posts all outputs to the event loop in one callback,
    which puts each into its request's queue. A request whose consumer goes away (a client disconnect cancels the
    awaiting coroutine) is aborted, so its pages and slot are freed at the next step boundary.
    """

    def __init__(self, engine: LLMEngine, metrics: ServerMetrics | None = None) -> None:
        self.engine = engine
        self.metrics = metrics
        self._streams: dict[str, _Stream] = {}  # touched only on the event loop
        self._loop: asyncio.AbstractEventLoop | None = None  # the one event loop the requests come from
        self._commands: list[tuple[str, str, list[int] | None, SamplingParams | None, ImageInputs | None]] = []
        self._lock = threading.Lock()
        self._wakeup = threading.Event()
        self._stopping = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="jetserve-engine", daemon=True)

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self._error is None

    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        self._stopping = True
        self._wakeup.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, images: ImageInputs | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs until it finishes; abandoning the iterator aborts the request. `images` (a VLM
        prompt's, placeholders expanded) may be shared by several requests: the engine encodes them once.

        Raises RequestRejectedError when the engine refuses the request, EngineDeadError when its loop has failed."""
        if self._error is not None:
            raise EngineDeadError(f"the engine loop failed: {self._error!r}")
        assert request_id not in self._streams, f"request id {request_id!r} is already in flight"
        loop = asyncio.get_running_loop()
        assert self._loop in (None, loop), "an AsyncEngine serves one event loop"
        self._loop = loop
        stream = _Stream(num_prompt_tokens=len(prompt_token_ids))
        self._streams[request_id] = stream
        self._command("add", request_id, list(prompt_token_ids), params, images)
        finished = False
        try:
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
            if not finished:
                self._command("abort", request_id, None, None, None)
                if self.metrics is not None:
                    self.metrics.request_aborted()

    def abort(self, request_id: str) -> None:
        self._command("abort", request_id, None, None, None)

    # ---- the engine thread ----

    def _command(
        self,
        kind: str,
        request_id: str,
        prompt: list[int] | None,
        params: SamplingParams | None,
        images: ImageInputs | None,
    ) -> None:
        with self._lock:
            self._commands.append((kind, request_id, prompt, params, images))
        self._wakeup.set()

    def _apply_commands(self) -> list[tuple[str, BaseException]]:
        with self._lock:
            commands, self._commands = self._commands, []
        rejected = []
        for kind, request_id, prompt, params, images in commands:
            if kind == "add":
                assert prompt is not None and params is not None
                try:
                    if images is None:
                        self.engine.add_request(request_id, prompt, params)
                    else:  # encodes the images (once for all the choices sharing them) on this thread
                        self.engine.add_request(request_id, prompt, params, images)
                except ValueError as e:
                    rejected.append((request_id, RequestRejectedError(str(e))))
            else:
                self.engine.abort_request(request_id)
        return rejected

    def _run(self) -> None:
        while not self._stopping:
            try:
                rejected = self._apply_commands()
                if rejected:
                    self._post(rejected)
                if not self.engine.has_unfinished_requests():
                    self._sample_metrics(0.0)
                    self._wakeup.wait(IDLE_WAIT_S)
                    self._wakeup.clear()
                    continue
                start = time.perf_counter()
                outputs = self.engine.step()
                self._sample_metrics(time.perf_counter() - start)
                if outputs:
                    self._post(outputs)
            except Exception as e:  # a bug or a device failure: fail every request rather than hang them
                logger.exception("engine loop failed")
                self._error = e
                self._fail_all(EngineDeadError(f"the engine loop failed: {e!r}"))
                return

    def _post(self, items: list) -> None:
        """Hand a step's outputs (or rejections) to the event loop in one callback."""
        self._call_on_loop(self._dispatch, items)

    def _call_on_loop(self, callback, *args) -> None:
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

    def _fail_all(self, error: BaseException) -> None:
        def fail_streams() -> None:
            for stream in self._streams.values():
                stream.queue.put_nowait(error)

        self._call_on_loop(fail_streams)

    def _sample_metrics(self, step_s: float) -> None:
        if self.metrics is not None:
            self.metrics.sample_engine(self.engine, step_s)
