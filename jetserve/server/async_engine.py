"""AsyncEngine: runs LLMEngine's step loop in its own thread and fans its outputs out to per-request asyncio queues
(RequestStreams, whose errors it re-exports, shared with the data-parallel router)."""

from __future__ import annotations

import logging
import threading
import time

from jetserve.engine.engine import LLMEngine
from jetserve.multimodal.inputs import ImageInputs
from jetserve.sampling_params import SamplingParams
from jetserve.server.metrics import ServerMetrics
from jetserve.server.request_streams import EngineDeadError, RequestRejectedError, RequestStreams

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.5  # how long the idle loop sleeps between checks when no command wakes it


class AsyncEngine(RequestStreams):
    """The engine is not thread-safe, so only its thread touches it: coroutines hand `add`/`abort` commands over a
    locked list and wake the thread; after each step the thread posts all outputs to the event loop in one callback,
    which puts each into its request's queue. A request whose consumer goes away (a client disconnect cancels the
    awaiting coroutine) is aborted, so its pages and slot are freed at the next step boundary.
    """

    def __init__(self, engine: LLMEngine, metrics: ServerMetrics | None = None) -> None:
        super().__init__(metrics)
        self.engine = engine
        self._commands: list[tuple[str, str, list[int] | None, SamplingParams | None, ImageInputs | None]] = []
        self._lock = threading.Lock()
        self._wakeup = threading.Event()
        self._stopping = False
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

    def _dead_error(self) -> EngineDeadError | None:
        return None if self._error is None else EngineDeadError(f"the engine loop failed: {self._error!r}")

    def _send_add(
        self, engine_index: int, request_id: str, prompt: list[int], params: SamplingParams, images: ImageInputs | None
    ) -> None:
        self._command("add", request_id, prompt, params, images)

    def _send_abort(self, engine_index: int, request_id: str) -> None:
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
                self._fail(EngineDeadError(f"the engine loop failed: {e!r}"))
                return

    def _sample_metrics(self, step_s: float) -> None:
        if self.metrics is not None:
            self.metrics.sample_engine(self.engine, step_s)
