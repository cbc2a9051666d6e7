"""Data-parallel replicas behind one HTTP front end: each replica is its own process (pinned to its devices, possibly
tensor parallel) running an engine loop; the router sends each request to the least-loaded one and aggregates the
replicas' engine metrics."""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import threading
import time
import traceback
from dataclasses import dataclass
from types import SimpleNamespace

from jetserve.config import ModelConfig, is_vlm_config
from jetserve.engine.config import EngineConfig
from jetserve.multimodal.inputs import ImageInputs
from jetserve.sampling_params import SamplingParams
from jetserve.server.metrics import ServerMetrics
from jetserve.server.request_streams import EngineDeadError, RequestRejectedError, RequestStreams

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.5  # how long an idle replica waits for a command before looking again
START_TIMEOUT_S = 1800.0  # loading a large checkpoint (and capturing graphs) may take minutes


@dataclass
class EngineStats:
    """The engine numbers /metrics reports, read in a replica after a step and summed over replicas."""

    num_running: int = 0
    num_waiting: int = 0
    num_free_pages: int = 0
    num_usable_pages: int = 0
    num_free_slots: int = 0
    num_usable_slots: int = 0
    num_preemptions: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_drafts: int = 0

    @classmethod
    def of(cls, engine) -> EngineStats:
        scheduler = engine.scheduler
        return cls(
            len(scheduler.running), len(scheduler.waiting), engine.block_manager.num_free_pages,
            engine.block_manager.num_usable_pages, engine.state_pool.num_free_slots,
            engine.state_pool.num_usable_slots, scheduler.num_preemptions, getattr(engine, "num_draft_tokens", 0),
            getattr(engine, "num_accepted_tokens", 0), getattr(engine, "num_drafts", 0),
        )  # fmt: skip

    def __add__(self, other: EngineStats) -> EngineStats:
        return EngineStats(*(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other), strict=True)))

    def as_engine(self) -> SimpleNamespace:
        """The sum shaped like the parts of an LLMEngine that `ServerMetrics.sample_engine` reads."""
        return SimpleNamespace(
            scheduler=SimpleNamespace(running=range(self.num_running), waiting=range(self.num_waiting),
                                      num_preemptions=self.num_preemptions),
            block_manager=SimpleNamespace(num_free_pages=self.num_free_pages, num_usable_pages=self.num_usable_pages),
            state_pool=SimpleNamespace(num_free_slots=self.num_free_slots, num_usable_slots=self.num_usable_slots),
            num_draft_tokens=self.num_draft_tokens, num_accepted_tokens=self.num_accepted_tokens,
            num_drafts=self.num_drafts,
        )  # fmt: skip


def replica_config(config: EngineConfig, index: int) -> EngineConfig:
    """Replica `index`'s engine: one of `data_parallel_size`, on devices `[index * tp, (index + 1) * tp)` of the
    configured CUDA device's numbering, its own request-seed stream."""
    device = config.device
    if device == "auto" or device.startswith("cuda"):
        import torch

        if torch.cuda.is_available():
            base = torch.device("cuda" if device == "auto" else device).index or 0
            first = base + index * config.tensor_parallel_size
            needed = base + config.data_parallel_size * config.tensor_parallel_size
            if needed > torch.cuda.device_count():
                raise ValueError(
                    f"data_parallel_size: {config.data_parallel_size} replicas of {config.tensor_parallel_size} "
                    f"GPU(s) from cuda:{base} need {needed} GPUs, but there are {torch.cuda.device_count()}"
                )
            device = f"cuda:{first}"
    return dataclasses.replace(config, data_parallel_size=1, device=device, seed=config.seed + index)


def _replica_main(config: EngineConfig, conn, num_threads: int) -> None:
    """A replica: build its engine, then apply the router's commands and step until told to stop. Messages out:
    ("ready", max_model_len) | ("failed", traceback) once; then ("outputs", outputs, rejections, stats, step_s)."""
    import torch

    from jetserve.engine.tensor_parallel import build_engine

    torch.set_num_threads(num_threads)
    try:
        engine = build_engine(config)
    except BaseException:
        conn.send(("failed", traceback.format_exc()))
        return
    conn.send(("ready", engine.max_model_len))
    is_stopping = False
    is_reported_idle = True
    while True:
        rejections = []
        if conn.poll(0 if engine.has_unfinished_requests() else IDLE_WAIT_S):
            while conn.poll():
                kind, *args = conn.recv()
                if kind == "add":
                    try:
                        engine.add_request(*args)
                    except ValueError as e:
                        rejections.append((args[0], str(e)))
                elif kind == "abort":
                    engine.abort_request(*args)
                else:
                    is_stopping = True
        if is_stopping:
            break
        outputs, step_s = [], 0.0
        if engine.has_unfinished_requests():
            start = time.perf_counter()
            outputs = engine.step()
            step_s = time.perf_counter() - start
            is_reported_idle = False
        elif is_reported_idle and not rejections:
            continue
        else:
            is_reported_idle = True  # one report after the last step, so /metrics shows the pools empty again
        conn.send(("outputs", outputs, rejections, EngineStats.of(engine), step_s))
    if hasattr(engine, "shutdown"):
        engine.shutdown()


class _Replica:
    def __init__(self, index: int, config: EngineConfig, num_threads: int) -> None:
        ctx = mp.get_context("spawn")
        self.index = index
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_replica_main, args=(config, child, num_threads), daemon=False,
                                   name=f"jetserve-dp{index}")  # fmt: skip
        self.process.start()
        child.close()
        self.lock = threading.Lock()
        self.num_in_flight = 0
        self.num_assigned = 0
        self.stats = EngineStats()
        self.is_alive = True
        self.reader: threading.Thread | None = None

    def send(self, *message) -> None:
        with self.lock:
            self.conn.send(message)


class DataParallelRouter(RequestStreams):
    """AsyncEngine's interface (what OpenAIServer and the app's lifespan use) over `data_parallel_size` replica
    processes (multiprocessing spawn). Each replica owns its devices (cuda:i·tp … on a GPU host) and an engine
    loop; the router keeps one asyncio queue per request (RequestStreams, as AsyncEngine), fed by one reader thread
    per replica.

    A request goes to the replica with the fewest requests in flight (ties: the one given fewer so far), and stays
    there. The replicas send their engine numbers with every step's outputs; /metrics shows their sum.
    """

    def __init__(self, config: EngineConfig, metrics: ServerMetrics | None = None, num_threads: int = 1) -> None:
        if config.data_parallel_size < 2:
            raise ValueError(f"data_parallel_size: the router needs ≥ 2 replicas, got {config.data_parallel_size}")
        super().__init__(metrics)
        self.config = config
        configs = [replica_config(config, i) for i in range(config.data_parallel_size)]  # fails before spawning
        model_config = ModelConfig.from_hf(config.model)
        # What OpenAIServer reads of an engine; a VLM's images travel to the replicas as pixels.
        self.engine = SimpleNamespace(
            model_config=model_config, config=config, vision=True if is_vlm_config(config.model) else None
        )
        self._replicas = [_Replica(i, c, num_threads) for i, c in enumerate(configs)]
        self._is_stopping = False
        lens = []
        try:
            for replica in self._replicas:
                if not replica.conn.poll(START_TIMEOUT_S):
                    raise RuntimeError(f"replica {replica.index} did not start in {START_TIMEOUT_S:.0f} s")
                kind, value = replica.conn.recv()
                if kind == "failed":
                    raise RuntimeError(f"replica {replica.index} failed to start:\n{value}")
                lens.append(value)
        except BaseException:
            self.shutdown()
            raise
        self._max_model_len = min(lens)

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def is_alive(self) -> bool:
        return self._error is None and all(r.is_alive for r in self._replicas)

    @property
    def num_in_flight(self) -> list[int]:
        """Requests in flight per replica (tests, logs)."""
        return [r.num_in_flight for r in self._replicas]

    @property
    def num_assigned(self) -> list[int]:
        """Requests sent to each replica so far."""
        return [r.num_assigned for r in self._replicas]

    def start(self) -> None:
        for replica in self._replicas:
            replica.reader = threading.Thread(target=self._read, args=(replica,), daemon=True,
                                              name=f"jetserve-dp{replica.index}-reader")  # fmt: skip
            replica.reader.start()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        self._is_stopping = True
        for replica in self._replicas:
            if replica.process.is_alive():
                try:
                    replica.send("stop")
                except OSError:
                    pass
        for replica in self._replicas:
            replica.process.join(timeout_s)
            if replica.process.is_alive():
                replica.process.kill()
                replica.process.join(timeout_s)
            replica.is_alive = False

    def _dead_error(self) -> EngineDeadError | None:
        return None if self.is_alive else EngineDeadError(f"a replica has stopped: {self._error!r}")

    def _assign(self) -> int:
        replica = min(self._replicas, key=lambda r: (r.num_in_flight, r.num_assigned, r.index))
        replica.num_in_flight += 1
        replica.num_assigned += 1
        return replica.index

    def _release(self, engine_index: int) -> None:
        self._replicas[engine_index].num_in_flight -= 1

    def _send_add(
        self, engine_index: int, request_id: str, prompt: list[int], params: SamplingParams, images: ImageInputs | None
    ) -> None:
        self._replicas[engine_index].send("add", request_id, prompt, params, images)

    def _send_abort(self, engine_index: int, request_id: str) -> None:
        replica = self._replicas[engine_index]
        if replica.is_alive:
            try:
                replica.send("abort", request_id)
            except OSError:
                pass

    # ---- reader threads ----

    def _read(self, replica: _Replica) -> None:
        while True:
            try:
                kind, outputs, rejections, stats, step_s = replica.conn.recv()
            except (EOFError, OSError) as e:
                if not self._is_stopping:  # the replica died
                    logger.error("replica %d stopped: %r", replica.index, e)
                    replica.is_alive = False
                    self._error = EngineDeadError(f"replica {replica.index} stopped")
                    self._fail(self._error, replica.index)
                return
            assert kind == "outputs"
            replica.stats = stats
            if self.metrics is not None:
                total = sum((r.stats for r in self._replicas), EngineStats())
                self.metrics.sample_engine(total.as_engine(), step_s)
            items = [*outputs, *((rid, RequestRejectedError(msg)) for rid, msg in rejections)]
            if items:
                self._post(items)
