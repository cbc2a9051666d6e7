"""VLM test fixtures: one random `tiny-vlm` checkpoint (jet_vlm: tiny SigLIP, 9 tokens per tile, all three text layer
kinds, fp32) per session, images as PNG data URLs, and a real server on loopback."""

from __future__ import annotations

import base64
import io
import socket
import threading
import time

import numpy as np
import pytest

from jetserve.checkpoint import make_checkpoint
from jetserve.engine.config import EngineConfig

MAX_MODEL_LEN = 512


def png_bytes(width: int, height: int, seed: int) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def vlm_engine_config(checkpoint: str, **overrides) -> EngineConfig:
    fields = dict(model=checkpoint, dtype="float32", device="cpu", max_num_seqs=8, max_model_len=MAX_MODEL_LEN,
                  cpu_cache_bytes=64 << 20)  # fmt: skip
    return EngineConfig(**(fields | overrides))


@pytest.fixture(scope="session")
def vlm_checkpoint(tmp_path_factory) -> str:
    return str(make_checkpoint("tiny-vlm", tmp_path_factory.mktemp("vlm") / "tiny-vlm", seed=0))


@pytest.fixture(scope="session")
def vlm_server(vlm_checkpoint):
    """(OpenAIServer, base URL) of a real server on 127.0.0.1 serving the tiny-vlm checkpoint."""
    pytest.importorskip("fastapi")
    import uvicorn

    from jetserve.server.launch import build_server

    server, app = build_server(vlm_engine_config(vlm_checkpoint), ["tiny-vlm"])
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    uv = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not uv.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    yield server, f"http://127.0.0.1:{port}"
    uv.should_exit = True
    thread.join(30)
    sock.close()
