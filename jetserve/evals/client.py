"""The evals' side of the wire: an HTTP client of a running jetserve server (OpenAI-compatible endpoints, /metrics),
requests fanned out over a bounded thread pool with a progress bar, and speculative-decoding stats read from /metrics.
"""

from __future__ import annotations

import json
import math
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from typing import Any, TextIO, TypeVar

import httpx

T = TypeVar("T")
R = TypeVar("R")

# The server's speculative-decoding counters (jetserve/server/metrics.py; prometheus_client adds `_total`).
METRIC_DRAFT_TOKENS = "jetserve:spec_decode_num_draft_tokens_total"
METRIC_ACCEPTED_TOKENS = "jetserve:spec_decode_num_accepted_tokens_total"
# Verify steps, when the server counts them (vLLM's `spec_decode_num_drafts`); else τ is derived from output tokens.
METRIC_VERIFY_STEPS = "jetserve:spec_decode_num_drafts_total"
METRIC_GENERATION_TOKENS = "jetserve:generation_tokens_total"
METRIC_SPEC_ENABLED = "jetserve:spec_decode_enabled"  # a gauge: 1 when the server runs a draft model


class EvalError(ValueError):
    """A request the server refused or could not answer; a ValueError so the CLI prints it as one line."""


class EvalClient:
    """One connection pool to `base_url` (with or without a trailing `/v1`), shared by the worker threads."""

    def __init__(
        self, base_url: str, api_key: str | None = None, timeout_s: float = 1800.0, max_connections: int = 64
    ) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"--base-url: {base_url!r} must start with http:// or https://")
        url = base_url.rstrip("/")
        self.base_url = url[: -len("/v1")] if url.endswith("/v1") else url
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        self._http = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout_s, limits=limits)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> EvalClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _send(self, method: str, path: str, body: dict[str, Any] | None = None) -> httpx.Response:
        try:
            response = self._http.request(method, path, json=body)
        except httpx.HTTPError as e:
            raise EvalError(f"{method} {self.base_url}{path}: {type(e).__name__}: {e}") from None
        if response.status_code >= 400:
            raise EvalError(f"{method} {self.base_url}{path}: HTTP {response.status_code}: {_error_message(response)}")
        return response

    def post_json(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return self._send("POST", path, body).json()

    def get_json(self, path: str) -> dict[str, Any]:
        return self._send("GET", path).json()

    def stream_events(self, path: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """POST with `stream: true` and yield each server-sent event's JSON until `data: [DONE]`."""
        try:
            with self._http.stream("POST", path, json=body | {"stream": True}) as response:
                if response.status_code >= 400:
                    response.read()
                    raise EvalError(f"POST {self.base_url}{path}: HTTP {response.status_code}: "
                                    f"{_error_message(response)}")  # fmt: skip
                for line in response.iter_lines():
                    if not line.startswith("data:"):
                        continue  # blank separators and SSE comments
                    data = line[len("data:") :].strip()
                    if data == "[DONE]":
                        return
                    event = json.loads(data)
                    if "error" in event:
                        raise EvalError(f"POST {self.base_url}{path}: stream error: {event['error']}")
                    yield event
        except httpx.HTTPError as e:
            raise EvalError(f"POST {self.base_url}{path}: {type(e).__name__}: {e}") from None
        raise EvalError(f"POST {self.base_url}{path}: the stream ended without data: [DONE]")

    def model_name(self, requested: str | None) -> str:
        """`requested`, or else the first model the server lists at /v1/models."""
        if requested:
            return requested
        models = self.get_json("/v1/models").get("data") or []
        if not models:
            raise EvalError(f"GET {self.base_url}/v1/models: the server lists no model; pass --model")
        return str(models[0]["id"])

    def metrics(self) -> dict[str, float] | None:
        """The server's /metrics, summed over label sets per sample name; None when it has no /metrics."""
        try:
            response = self._http.get("/metrics")
        except httpx.HTTPError as e:
            raise EvalError(f"GET {self.base_url}/metrics: {type(e).__name__}: {e}") from None
        if response.status_code == 404:
            return None
        if response.status_code >= 400:
            raise EvalError(f"GET {self.base_url}/metrics: HTTP {response.status_code}: {_error_message(response)}")
        return parse_prometheus(response.text)


def _error_message(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text[:500]
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return str(body["error"].get("message", body["error"]))
    return json.dumps(body)[:500]


def parse_prometheus(text: str) -> dict[str, float]:
    """Prometheus text exposition → {sample name: value summed over its label sets}. Comments are skipped."""
    totals: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if "{" in line:
            name, _, rest = line.partition("{")
            rest = rest[rest.rindex("}") + 1 :]  # label values may hold spaces, never an unescaped '}' after them
        else:
            name, _, rest = line.partition(" ")
        fields = rest.split()
        if not fields:
            raise ValueError(f"/metrics: a sample without a value: {line!r}")
        totals[name.strip()] = totals.get(name.strip(), 0.0) + float(fields[0])
    return totals


def speculation_stats(
    before: dict[str, float] | None, after: dict[str, float] | None, num_requests: int
) -> dict[str, Any]:
    """τ (mean acceptance length: tokens emitted per target verify step) over the window between two /metrics reads.

    With a verify-step counter, τ = 1 + accepted / steps. Without one, each verify step emits its accepted drafts
    plus one token and each request's first token comes from prefill, so steps = generated − requests − accepted.
    """
    if before is None or after is None:
        return {"tau": None, "acceptance_rate": None, "reason": "the server has no /metrics"}
    if METRIC_DRAFT_TOKENS not in after or METRIC_ACCEPTED_TOKENS not in after:
        return {"tau": None, "acceptance_rate": None, "reason": "the server exposes no speculative acceptance metric"}

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    drafts, accepted = delta(METRIC_DRAFT_TOKENS), delta(METRIC_ACCEPTED_TOKENS)
    stats: dict[str, Any] = {"draft_tokens": int(drafts), "accepted_tokens": int(accepted)}
    if METRIC_SPEC_ENABLED in after:
        stats["enabled"] = after[METRIC_SPEC_ENABLED] > 0
    if drafts <= 0:
        return stats | {"tau": None, "acceptance_rate": None, "reason": "the server proposed no draft tokens"}
    stats["acceptance_rate"] = accepted / drafts
    if METRIC_VERIFY_STEPS in after and delta(METRIC_VERIFY_STEPS) > 0:
        steps = delta(METRIC_VERIFY_STEPS)
        stats |= {"tau": 1.0 + accepted / steps, "verify_steps": int(steps), "tau_source": METRIC_VERIFY_STEPS}
        return stats
    steps = delta(METRIC_GENERATION_TOKENS) - num_requests - accepted
    if steps <= 0:
        return stats | {"tau": None, "reason": "too few generated tokens to derive verify steps"}
    stats |= {"tau": 1.0 + accepted / steps, "verify_steps": int(steps), "tau_source": "generation_tokens"}
    return stats


class ProgressBar:
    """A one-line progress bar on stderr (redrawn at most 10 times a second; on a pipe, a line every 10%)."""

    def __init__(self, total: int, desc: str, stream: TextIO | None = None) -> None:
        self.total, self.desc = total, desc
        self.stream = stream if stream is not None else sys.stderr
        self.is_tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.done = 0
        self.start = time.perf_counter()
        self._last_draw = -math.inf
        self._last_decile = -1

    def update(self, n: int = 1) -> None:
        self.done += n
        now = time.perf_counter()
        if self.is_tty:
            if now - self._last_draw >= 0.1 or self.done == self.total:
                self._last_draw = now
                self.stream.write("\r" + self.render(now))
                self.stream.flush()
        else:
            decile = 10 * self.done // max(self.total, 1)
            if decile != self._last_decile:
                self._last_decile = decile
                self.stream.write(self.render(now) + "\n")
                self.stream.flush()

    def render(self, now: float) -> str:
        elapsed = now - self.start
        frac = self.done / self.total if self.total else 1.0
        width = 30
        filled = int(frac * width)
        rate = self.done / elapsed if elapsed > 0 else 0.0
        eta = (self.total - self.done) / rate if rate > 0 else math.inf
        eta_text = f"{eta:.0f}s" if math.isfinite(eta) else "?"
        bar = "#" * filled + "." * (width - filled)
        return f"{self.desc} [{bar}] {self.done}/{self.total} {elapsed:.0f}s {rate:.2f}/s eta {eta_text}"

    def close(self) -> None:
        if self.is_tty:
            self.stream.write("\n")
            self.stream.flush()


def run_parallel(
    fn: Callable[[T], R], items: Sequence[T], parallel: int, desc: str, stream: TextIO | None = None
) -> list[R]:
    """`[fn(x) for x in items]` on `parallel` threads, in order, with a progress bar; a failure cancels the rest."""
    if parallel < 1:
        raise ValueError(f"--parallel: {parallel} must be ≥ 1")
    bar = ProgressBar(len(items), desc, stream)
    lock = threading.Lock()

    def tracked(x: T) -> R:
        result = fn(x)
        with lock:
            bar.update()
        return result

    with ThreadPoolExecutor(max_workers=parallel) as pool:
        futures: list[Future[R]] = [pool.submit(tracked, x) for x in items]
        try:
            done, pending = wait(futures, return_when=FIRST_EXCEPTION)
            for f in pending:
                f.cancel()
            for f in futures:
                if f in done and f.exception() is not None:
                    raise f.exception()  # the first failure in item order, not a CancelledError of a later item
            results = [f.result() for f in futures]
        except BaseException:
            for f in futures:
                f.cancel()
            raise
        finally:
            bar.close()
    return results
