"""The tensor-parallel engine: one process per rank, each with an identical LLMEngine over its shard (built by
`jetserve.distributed`); rank 0 takes the requests and, before every step, broadcasts what changed (new requests,
aborts, its measured step times)."""

from __future__ import annotations

import atexit
import dataclasses
import gc
import logging
import multiprocessing as mp
import os
import sys
import threading
from dataclasses import dataclass, field

import torch

from jetserve.config import ModelConfig
from jetserve.distributed.group import TensorParallelGroup, free_port, init_tensor_parallel
from jetserve.distributed.loader import load_sharded_model, random_sharded_model
from jetserve.distributed.sharding import check_tensor_parallel
from jetserve.engine.config import EngineConfig
from jetserve.engine.engine import LLMEngine, resolve_device
from jetserve.engine.memory_plan import MemoryPlan
from jetserve.engine.output import RequestOutput
from jetserve.model.jet_nemotron import JetNemotronForCausalLM
from jetserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

WATCH_INTERVAL_S = 0.5  # how often rank 0 checks that the other ranks' processes still run


@dataclass
class StepMessage:
    """What rank 0 tells the other ranks before a step: the API calls since the last step, in order, and the step
    times its speculative policy recorded (the policy chooses by measured time, so every rank must see rank 0's)."""

    calls: list[tuple[str, tuple]] = field(default_factory=list)  # ("add", args) | ("abort", (request_id,))
    step_times: list[tuple[int, int, float]] = field(default_factory=list)  # spec.record_step arguments
    is_stop: bool = False


class TensorParallelEngine(LLMEngine):
    """An LLMEngine over this rank's shard. Every rank runs the whole engine — scheduler, model runner, sampler,
    speculation — on the same inputs: hidden states are all-reduced and logits all-gathered, so every rank computes
    bit-identical logits and samples (by seed and counter) the same tokens, and the schedulers stay in lockstep with
    no per-step batch to ship. Rank 0 is the one the caller drives: its `add_request`/`abort_request` are queued and
    broadcast at the next `step`; the other ranks sit in `serve_steps`.

    The one input that is not a function of the requests is time: the adaptive speculation policy picks tree sizes
    by measured step time, so the other ranks replay rank 0's measurements instead of their own.
    """

    def __init__(
        self,
        config: EngineConfig,
        group: TensorParallelGroup,
        tokenizer: object | None = None,
        workers: list[mp.process.BaseProcess] | None = None,
        random_config: str | None = None,
        seed: int = 0,
        stopping: threading.Event | None = None,
    ) -> None:
        """`random_config` (a preset name or config JSON; benchmarks) draws random weights instead of loading
        `config.model`. `stopping` (rank 0): set when this engine stops the other ranks on purpose, for the watchdog
        of their processes (`watch_workers`)."""
        if group.world_size != config.tensor_parallel_size:
            raise ValueError(
                f"tensor_parallel_size: {config.tensor_parallel_size}, but the process group has {group.world_size}"
            )
        self.group = group
        self._workers = workers or []
        self._message = StepMessage()
        self._is_shut_down = False
        self._stopping = stopping or threading.Event()
        if random_config is not None:
            from jetserve.checkpoint import preset_config

            model_config = ModelConfig.from_dict(preset_config(random_config))
            model = random_sharded_model(model_config, group, config.dtype, seed)
        else:
            model = load_sharded_model(config.model, group, dtype=config.dtype)
        super().__init__(config, model=model, tokenizer=tokenizer)
        if self.spec is not None:
            record = self.spec.record_step
            if group.is_first:

                def record_and_send(option: int, num_seqs: int, seconds: float) -> None:
                    record(option, num_seqs, seconds)
                    self._message.step_times.append((option, num_seqs, seconds))

                self.spec.record_step = record_and_send
            else:
                self.spec.record_step = lambda option, num_seqs, seconds: None
                self._replay_step_time = record

    def _plan(self, model: JetNemotronForCausalLM, device: torch.device, dtype: torch.dtype) -> MemoryPlan:
        """Every rank plans from its own free memory; all take the smallest (the ranks' pools must match)."""
        plan = super()._plan(model, device, dtype)
        agreed = {name: self.group.all_reduce_min(getattr(plan, name))
                  for name in ("num_pages", "num_slots", "ring_tokens", "max_model_len")}  # fmt: skip
        return dataclasses.replace(plan, **agreed)

    # ---- rank 0: the API the caller drives ----

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams | None = None, *args
    ) -> None:
        """As LLMEngine's (extra arguments, such as a VLM request's images, pass through and are broadcast too)."""
        super().add_request(request_id, prompt_token_ids, sampling_params, *args)  # raises before anything is sent
        if self.group.is_first:
            # Images go as pixels: each rank encodes them on its own device (rank 0's embeds live on its GPU).
            extra = tuple(dataclasses.replace(a, embeds=None) if hasattr(a, "embeds") else a for a in args)
            self._message.calls.append(("add", (request_id, list(prompt_token_ids), sampling_params, *extra)))

    def abort_request(self, request_id: str) -> bool:
        is_aborted = super().abort_request(request_id)
        if is_aborted and self.group.is_first:
            self._message.calls.append(("abort", (request_id,)))
        return is_aborted

    def step(self) -> list[RequestOutput]:
        assert self.group.is_first, "the other ranks step from serve_steps"
        assert not self._is_shut_down, "the engine was shut down"
        message, self._message = self._message, StepMessage()
        self.group.broadcast_object(message if (message.calls or message.step_times) else None)
        return super().step()

    def shutdown(self) -> None:
        """Rank 0: stop the other ranks and leave the process group (also run at exit)."""
        if self._is_shut_down or not self.group.is_first:
            return
        self._is_shut_down = True
        self._stopping.set()
        # The exit hook held this engine (its caches, sized to most of the device) for the life of the process: a
        # second engine built after this one found the first one's memory still in use (the GPU test's next case).
        atexit.unregister(self.shutdown)
        try:
            self.group.broadcast_object(StepMessage(is_stop=True))
        finally:
            # Leave the group while the other ranks leave theirs (NCCL's teardown waits for every rank: joining them
            # first hung until they were killed, and then for good), then reap their processes.
            self.leave_group()
            for worker in self._workers:
                worker.join(30)
                if worker.is_alive():
                    worker.kill()

    def leave_group(self) -> None:
        """Drop the CUDA graphs (their captured collectives hold the communicator), wait for the device, and leave
        the process group: every rank's last act."""
        self.runner.graph_runner = None
        if self.spec is not None:
            self.spec.graphs = None
        gc.collect()
        if self.group.device.type == "cuda":
            torch.cuda.synchronize(self.group.device)
        self.group.destroy()

    # ---- the other ranks ----

    def serve_steps(self) -> None:
        """Ranks > 0: apply rank 0's calls and step, until it stops."""
        assert not self.group.is_first
        while True:
            message = self.group.broadcast_object()
            if message is not None:
                if message.is_stop:
                    return
                for name, args in message.calls:
                    if name == "add":
                        super().add_request(*args)
                    else:
                        super().abort_request(*args)
                for option, num_seqs, seconds in message.step_times:
                    self._replay_step_time(option, num_seqs, seconds)
            super().step()


def watch_workers(workers: list[mp.process.BaseProcess], stopping: threading.Event) -> None:
    """Rank 0's watchdog: a rank whose process ends leaves rank 0 blocked in its next collective for good (gloo and
    NCCL wait for every rank, and a blocked collective cannot be interrupted), so when one ends before `stopping` is
    set, say which on stderr and end this process with status 1 instead of hanging."""
    while not stopping.wait(WATCH_INTERVAL_S):
        for rank, worker in enumerate(workers, start=1):
            if worker.exitcode is not None and not stopping.is_set():
                print(
                    f"jetserve: tensor-parallel rank {rank} (pid {worker.pid}) exited with status {worker.exitcode} "
                    "while the engine ran (its error, if any, is above); stopping rank 0",
                    file=sys.stderr,
                    flush=True,
                )
                for other in workers:
                    other.kill()
                os._exit(1)


def rank_device(config: EngineConfig, rank: int) -> torch.device:
    """Rank r's device: cuda:(base + r) from the configured cuda device (cuda:0 for "auto"), or the CPU."""
    base = resolve_device(config.device)
    if base.type != "cuda":
        return base
    index = (base.index or 0) + rank
    if index >= torch.cuda.device_count():
        raise ValueError(
            f"tensor_parallel_size: {config.tensor_parallel_size} ranks from {base} need cuda:{index}, but there "
            f"are {torch.cuda.device_count()} GPUs"
        )
    return torch.device("cuda", index)


def _worker_main(
    rank: int, config: EngineConfig, port: int, num_threads: int, random_config: str | None, seed: int
) -> None:
    torch.set_num_threads(num_threads)
    group = init_tensor_parallel(rank, config.tensor_parallel_size, port, rank_device(config, rank))
    engine = TensorParallelEngine(config, group, random_config=random_config, seed=seed)
    try:
        engine.serve_steps()
    finally:
        engine.leave_group()


def build_engine(
    config: EngineConfig, tokenizer: object | None = None, random_config: str | None = None, seed: int = 0
) -> LLMEngine:
    """The engine `config` describes: an LLMEngine, or with `tensor_parallel_size` N > 1 rank 0's
    TensorParallelEngine in this process and ranks 1..N-1 spawned (one process each, on the next devices).
    `random_config` (tensor parallel only; benchmarks): random weights of that preset or config JSON."""
    if config.data_parallel_size > 1:
        raise ValueError(
            "data_parallel_size: replicas are the server's (jetserve serve --data-parallel-size); an engine is one"
        )
    if config.tensor_parallel_size == 1:
        assert random_config is None, "random weights in one process: jetserve.engine.bench_offline.random_model"
        return LLMEngine(config, tokenizer=tokenizer)
    if random_config is not None:
        from jetserve.checkpoint import preset_config

        model_config = ModelConfig.from_dict(preset_config(random_config))
    elif not config.model:
        raise ValueError("model: tensor parallelism loads each rank's shard from a checkpoint folder")
    else:
        model_config = ModelConfig.from_hf(config.model)
    check_tensor_parallel(model_config, config.tensor_parallel_size)
    devices = [rank_device(config, r) for r in range(config.tensor_parallel_size)]  # fail before spawning
    port = free_port()
    ctx = mp.get_context("spawn")
    args = (config, port, torch.get_num_threads(), random_config, seed)
    workers = [ctx.Process(target=_worker_main, args=(r, *args), daemon=True, name=f"jetserve-tp{r}")
               for r in range(1, config.tensor_parallel_size)]  # fmt: skip
    for worker in workers:
        worker.start()
    stopping = threading.Event()
    threading.Thread(target=watch_workers, args=(workers, stopping), daemon=True, name="jetserve-tp-watch").start()
    try:
        group = init_tensor_parallel(0, config.tensor_parallel_size, port, devices[0])
        engine = TensorParallelEngine(config, group, tokenizer, workers, random_config, seed, stopping)
    except BaseException:
        stopping.set()  # this rank failed first: the others wait in a collective; stop them
        for worker in workers:
            worker.kill()
        raise
    atexit.register(engine.shutdown)
    logger.info("tensor parallel: %d ranks on %s", config.tensor_parallel_size, ", ".join(map(str, devices)))
    return engine
