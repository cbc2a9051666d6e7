"""Servers for the eval tests: a scripted OpenAI-style server (exact, known answers: checks the evals' own logic) and
the real `jetserve serve` on a random tiny checkpoint (checks that the evals and the server speak the same protocol).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from scripted_server import FakeHandler, FakeState


@pytest.fixture
def fake_server() -> Iterator[tuple[str, FakeState]]:
    """(base URL, state) of a scripted server on a free loopback port."""
    state = FakeState()
    handler = type("Handler", (FakeHandler,), {"state": state})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", state
    finally:
        httpd.shutdown()
        httpd.server_close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve_command(checkpoint: Path, port: int) -> list[str]:
    """`jetserve serve` on the CPU with a small engine (the tiny model's 4096-token context, few pages)."""
    from jetserve.cli import build_parser

    subcommands = build_parser()._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    if "serve" not in subcommands:
        pytest.skip("`jetserve serve` (issue 6) is not in the CLI yet")
    return [sys.executable, "-m", "jetserve.cli", "serve", "--model", str(checkpoint), "--served-model-name", "tiny",
            "--host", "127.0.0.1", "--port", str(port), "--device", "cpu", "--max-num-seqs", "8",
            "--log-level", "warning"]  # fmt: skip


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from jetserve.checkpoint import make_checkpoint

    return make_checkpoint("tiny", tmp_path_factory.mktemp("evals") / "tiny", seed=5)


@pytest.fixture(scope="session")
def tiny_server(tmp_path_factory: pytest.TempPathFactory, tiny_checkpoint: Path) -> Iterator[str]:
    """Base URL of a real `jetserve serve` on a random tiny checkpoint (reference backend, CPU)."""
    port = _free_port()
    command = _serve_command(tiny_checkpoint, port)
    log = (tmp_path_factory.getbasetemp() / "tiny_server.log").open("w+")
    env = os.environ | {"JETSERVE_BACKEND": "reference"}
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if process.poll() is not None:
                log.seek(0)
                pytest.fail(f"jetserve serve exited with {process.returncode}:\n{log.read()[-4000:]}")
            try:
                if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("jetserve serve did not answer /health within 120 s")
            time.sleep(0.25)
        yield base_url
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()
