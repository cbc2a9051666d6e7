"""Data parallel 2 behind one HTTP front end (two replica processes, CPU): concurrent requests get the outputs one
engine gives, both replicas serve, /metrics sums the replicas, and nothing leaks."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

import httpx  # noqa: E402
import uvicorn  # noqa: E402

from jetserve.engine.config import EngineConfig  # noqa: E402
from jetserve.llm import LLM  # noqa: E402
from jetserve.sampling_params import SamplingParams  # noqa: E402
from jetserve.server.launch import build_server  # noqa: E402
from jetserve.server.router import DataParallelRouter, EngineStats, replica_config  # noqa: E402

BASE = dict(dtype="float32", device="cpu", max_num_seqs=8, max_model_len=256, cpu_cache_bytes=32 << 20)
PROMPTS = [f"request {i}: " + "the quick brown fox " * (i % 4 + 1) for i in range(8)]
MAX_TOKENS = 10


def metric(base_url: str, name: str) -> float:
    for line in httpx.get(base_url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


@pytest.fixture(scope="module")
def dp_server(tiny_checkpoint):
    config = EngineConfig(model=str(tiny_checkpoint), data_parallel_size=2, **BASE)
    server, app = build_server(config, ["tiny"])  # what `jetserve serve --data-parallel-size 2` builds
    router = server.engine
    assert isinstance(router, DataParallelRouter)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    uv = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not uv.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    yield router, f"http://127.0.0.1:{sock.getsockname()[1]}"
    uv.should_exit = True
    thread.join(30)
    sock.close()
    assert not any(r.process.is_alive() for r in router._replicas), "replicas still running after shutdown"


def test_dp2_serves_concurrent_requests_like_one_engine(tiny_checkpoint, dp_server):
    router, base_url = dp_server
    llm = LLM(str(tiny_checkpoint), **BASE)
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    params = [greedy if i % 2 == 0 else SamplingParams(temperature=0.8, seed=i, max_tokens=MAX_TOKENS, ignore_eos=True)
              for i in range(8)]  # fmt: skip
    want = [o.text for o in llm.generate(PROMPTS, params)]

    async def ask_all() -> list[str]:
        client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0)
        calls = [client.completions.create(model="tiny", prompt=p, max_tokens=MAX_TOKENS, temperature=s.temperature,
                                           seed=s.seed, extra_body={"ignore_eos": True})
                 for p, s in zip(PROMPTS, params, strict=True)]  # fmt: skip
        return [r.choices[0].text for r in await asyncio.gather(*calls)]

    got = asyncio.run(ask_all())
    assert got == want
    assert router.num_assigned == [4, 4] and router.num_in_flight == [0, 0]
    # Streaming through a replica, and an abandoned stream (its request is aborted on its replica).
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0)
    text = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny", prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0, stream=True,
        extra_body={"ignore_eos": True}))  # fmt: skip
    assert text == want[0]
    with client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=200, stream=True) as stream:
        next(iter(stream))
    # The pools of both replicas are summed, and come back empty.
    usable = metric(base_url, "jetserve:num_usable_slots")
    assert usable == 2 * BASE["max_num_seqs"]  # each replica has a slot per sequence it may run
    deadline = time.monotonic() + 30
    while metric(base_url, "jetserve:num_free_slots") != usable or metric(base_url, "jetserve:num_requests_running"):
        assert time.monotonic() < deadline, "replicas did not free their slots"
        time.sleep(0.1)
    assert metric(base_url, "jetserve:generation_tokens_total") >= 9 * MAX_TOKENS
    assert httpx.get(base_url + "/health", timeout=10).status_code == 200


def test_replica_devices_and_stats():
    config = EngineConfig(model="x", data_parallel_size=3, device="cpu", seed=5)
    configs = [replica_config(config, i) for i in range(3)]
    assert [(c.device, c.data_parallel_size, c.seed) for c in configs] == [("cpu", 1, 5), ("cpu", 1, 6), ("cpu", 1, 7)]
    total = EngineStats(1, 2, 3, 4, 5, 6, 7, 8, 9, 10) + EngineStats(1, 1, 1, 1, 1, 1, 1, 1, 1, 1)
    view = total.as_engine()
    assert len(view.scheduler.running) == 2 and view.block_manager.num_usable_pages == 5 and view.num_drafts == 11
    with pytest.raises(ValueError, match="data_parallel_size"):
        DataParallelRouter(EngineConfig(model="x"))
