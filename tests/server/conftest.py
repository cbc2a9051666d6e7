"""A real server on loopback for the server tests: the tiny checkpoint, reference ops, uvicorn in a thread."""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("openai")

import httpx  # noqa: E402
import openai  # noqa: E402
import uvicorn  # noqa: E402

from jetserve.checkpoint import make_checkpoint  # noqa: E402
from jetserve.engine.config import EngineConfig  # noqa: E402
from jetserve.server.api import OpenAIServer  # noqa: E402
from jetserve.server.launch import build_server  # noqa: E402

API_KEY = "test-key"
MODEL_NAME = "tiny"
MAX_MODEL_LEN = 512


@dataclass
class RunningServer:
    server: OpenAIServer
    base_url: str  # http://127.0.0.1:PORT
    checkpoint: str
    engine_config: EngineConfig
    api_key: str = API_KEY

    def client(self, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url + "/v1", api_key=API_KEY, max_retries=0, **kwargs)

    def async_client(self, **kwargs) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.base_url + "/v1", api_key=API_KEY, max_retries=0, **kwargs)

    def post(self, path: str, body: object, key: str | None = API_KEY, raw: bytes | None = None) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
        if raw is not None:
            headers["Content-Type"] = "application/json"
            return httpx.post(self.base_url + path, content=raw, headers=headers, timeout=60)
        return httpx.post(self.base_url + path, json=body, headers=headers, timeout=60)

    def metric(self, name: str) -> float:
        """One sample of /metrics by metric name (the first series)."""
        text = httpx.get(self.base_url + "/metrics", timeout=10).text
        for line in text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)

    def wait_idle_and_clean(self, timeout_s: float = 30.0) -> None:
        """Wait until the engine holds no request and every page and slot is back (the leak check)."""
        engine = self.server.engine.engine
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if engine.is_idle_and_clean():
                return
            time.sleep(0.05)
        raise AssertionError(
            f"engine not clean after {timeout_s}s: running {len(engine.scheduler.running)}, waiting "
            f"{len(engine.scheduler.waiting)}, free pages {engine.num_free_pages()}/"
            f"{engine.block_manager.num_usable_pages}, free slots {engine.num_free_slots()}/"
            f"{engine.state_pool.num_usable_slots}"
        )


def engine_config(checkpoint: str) -> EngineConfig:
    return EngineConfig(
        model=checkpoint, dtype="float32", device="cpu", max_num_seqs=32, max_model_len=MAX_MODEL_LEN,
        cpu_cache_bytes=64 << 20,
    )  # fmt: skip


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> str:
    return str(make_checkpoint("tiny", tmp_path_factory.mktemp("server") / "tiny", seed=0))


@pytest.fixture(scope="session")
def tiny_engine_config(tiny_checkpoint) -> EngineConfig:
    return engine_config(tiny_checkpoint)


@pytest.fixture(scope="session")
def running_server(tiny_checkpoint):
    config = engine_config(tiny_checkpoint)
    server, app = build_server(config, [MODEL_NAME], API_KEY)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    uv = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_keep_alive=30))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not uv.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    yield RunningServer(server, f"http://127.0.0.1:{port}", tiny_checkpoint, config)
    uv.should_exit = True
    thread.join(30)
    sock.close()
