"""VLM test fixtures: one random `tiny-vlm` checkpoint (jet_vlm: tiny SigLIP, 9 tokens per tile, all three text layer
kinds, fp32) per session, images as PNG data URLs, and a real server on loopback."""

from __future__ import annotations

import socket
import threading
import time

import pytest
from vlm_helpers import vlm_engine_config

from jetserve.checkpoint import make_checkpoint


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
