"""A scripted OpenAI-style server with exact, known answers, so the eval tests can check the evals' own numbers."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler
from typing import Any

# The scripted server's speculation: every request emits FAKE_TOKENS tokens, one from prefill, then verify steps of
# FAKE_DRAFTS drafts each with one accepted (+1 bonus token), so τ = 2 and the acceptance rate is 1/FAKE_DRAFTS.
FAKE_TOKENS = 7
FAKE_DRAFTS = 3
FAKE_GSM8K_TEXT = " She sells 16 - 3 - 4 = 9 eggs for $2 each, 9 * 2 = $18.\n#### 18"  # right for test row 0 only
FAKE_MODEL = "fake-model"


class FakeState:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests: list[tuple[str, dict[str, Any]]] = []
        self.generation_tokens = 0
        self.draft_tokens = 0
        self.accepted_tokens = 0

    def generated(self, n: int) -> None:
        steps = (n - 1) // 2
        with self.lock:
            self.generation_tokens += n
            self.accepted_tokens += steps
            self.draft_tokens += steps * FAKE_DRAFTS

    def metrics_text(self) -> str:
        labels = f'{{model_name="{FAKE_MODEL}"}}'
        return (
            "# HELP jetserve:generation_tokens_total Output tokens generated.\n"
            "# TYPE jetserve:generation_tokens_total counter\n"
            f"jetserve:generation_tokens_total{labels} {float(self.generation_tokens)}\n"
            f"jetserve:generation_tokens_created{labels} 1.7e9\n"
            f"jetserve:spec_decode_num_draft_tokens_total{labels} {float(self.draft_tokens)}\n"
            f"jetserve:spec_decode_num_accepted_tokens_total{labels} {float(self.accepted_tokens)}\n"
            f'jetserve:request_success_total{{finished_reason="stop",model_name="{FAKE_MODEL}"}} 3.0\n'
        )


def _echo_logprobs(prompt: str) -> dict[str, Any]:
    """One token per character; the final character decides: "B" is likeliest, then "C", "A", "D"."""
    tokens = list(prompt)
    last = {"A": -2.0, "B": -0.5, "C": -1.0, "D": -3.0}.get(tokens[-1], -4.0)
    logprobs: list[float | None] = [None] + [-1.25] * (len(tokens) - 2) + [last]
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": [None] * len(tokens),
            "text_offset": list(range(len(tokens)))}  # fmt: skip


class FakeHandler(BaseHTTPRequestHandler):
    state: FakeState

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass

    def _json(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/v1/models":
            self._json(200, {"object": "list", "data": [{"id": FAKE_MODEL, "object": "model"}]})
        elif self.path == "/metrics":
            data = self.state.metrics_text().encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        else:
            self._json(404, {"error": {"message": "not found"}})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with self.state.lock:
            self.state.requests.append((self.path, body))
        if body.get("model") != FAKE_MODEL:
            self._json(400, {"error": {"message": f"model: unknown model {body.get('model')!r}", "param": "model"}})
        elif self.path == "/v1/completions" and body.get("echo"):
            prompts = body["prompt"] if isinstance(body["prompt"], list) else [body["prompt"]]
            choices = [{"index": i, "text": p, "logprobs": _echo_logprobs(p), "finish_reason": "length"}
                       for i, p in enumerate(prompts)]  # fmt: skip
            self._json(200, {"choices": choices[::-1], "usage": {"prompt_tokens": 9, "completion_tokens": 0}})
        elif self.path == "/v1/completions":
            text = FAKE_GSM8K_TEXT if body["prompt"].endswith("\nAnswer:") and "Question:" in body["prompt"] else " B"
            self.state.generated(FAKE_TOKENS)
            self._json(200, {"choices": [{"index": 0, "text": text, "finish_reason": "stop", "logprobs": None}],
                             "usage": {"prompt_tokens": 100, "completion_tokens": FAKE_TOKENS}})  # fmt: skip
        elif self.path == "/v1/chat/completions":
            self._stream_chat(body)
        else:
            self._json(404, {"error": {"message": "not found"}})

    def _stream_chat(self, body: dict[str, Any]) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()

        def send(data: dict[str, Any] | str) -> None:
            self.wfile.write(f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode())
            self.wfile.flush()

        turn = sum(m["role"] == "user" for m in body["messages"])
        send({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]})
        for i in range(FAKE_TOKENS):
            time.sleep(0.002)
            send({"choices": [{"index": 0, "delta": {"content": f"t{turn}w{i} "}, "finish_reason": None}]})
        send({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]})
        send({"choices": [], "usage": {"prompt_tokens": 20, "completion_tokens": FAKE_TOKENS,
                                       "total_tokens": 20 + FAKE_TOKENS}})  # fmt: skip
        send("[DONE]")
        self.state.generated(FAKE_TOKENS)
