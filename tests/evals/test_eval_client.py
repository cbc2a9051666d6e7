"""The eval client's pieces: Prometheus parsing, τ from metric deltas, the ordered thread pool, the progress bar."""

import io
import threading
import time

import pytest

from jetserve.evals.client import (
    METRIC_ACCEPTED_TOKENS,
    METRIC_DRAFT_TOKENS,
    METRIC_GENERATION_TOKENS,
    METRIC_SPEC_ENABLED,
    METRIC_VERIFY_STEPS,
    EvalClient,
    ProgressBar,
    parse_prometheus,
    run_parallel,
    speculation_stats,
)
from jetserve.evals.results import default_label


def test_parse_prometheus_sums_label_sets():
    text = (
        "# HELP jetserve:request_success_total Requests finished.\n"
        "# TYPE jetserve:request_success_total counter\n"
        'jetserve:request_success_total{finished_reason="stop",model_name="m"} 3.0\n'
        'jetserve:request_success_total{finished_reason="length",model_name="a {b}"} 2.0\n'
        "jetserve:num_requests_running 4\n"
        'jetserve:step_seconds_bucket{le="+Inf"} 7.0 1700000000\n'
        "\n"
    )
    assert parse_prometheus(text) == {
        "jetserve:request_success_total": 5.0,
        "jetserve:num_requests_running": 4.0,
        "jetserve:step_seconds_bucket": 7.0,
    }


def test_parse_prometheus_from_the_server_registry():
    prometheus_client = pytest.importorskip("prometheus_client")
    registry = prometheus_client.CollectorRegistry()
    counter = prometheus_client.Counter("jetserve:spec_decode_num_accepted_tokens", "Accepted.", ["model_name"],
                                        registry=registry)  # fmt: skip
    counter.labels(model_name="x").inc(41)
    counter.labels(model_name="y").inc(1)
    parsed = parse_prometheus(prometheus_client.generate_latest(registry).decode())
    assert parsed[METRIC_ACCEPTED_TOKENS] == 42.0


def test_tau_from_generated_tokens():
    # 10 requests, 100 tokens in all: 10 come from prefill; 90 from verify steps that accepted 60 drafts → 30 steps.
    before = {METRIC_DRAFT_TOKENS: 5.0, METRIC_ACCEPTED_TOKENS: 2.0, METRIC_GENERATION_TOKENS: 50.0}
    after = {METRIC_DRAFT_TOKENS: 125.0, METRIC_ACCEPTED_TOKENS: 62.0, METRIC_GENERATION_TOKENS: 150.0}
    stats = speculation_stats(before, after, num_requests=10)
    assert stats["tau"] == pytest.approx(3.0) and stats["verify_steps"] == 30
    assert stats["acceptance_rate"] == pytest.approx(0.5) and stats["tau_source"] == "generation_tokens"


def test_tau_from_a_verify_step_counter():
    before = {METRIC_DRAFT_TOKENS: 0.0, METRIC_ACCEPTED_TOKENS: 0.0, METRIC_VERIFY_STEPS: 0.0}
    after = {METRIC_DRAFT_TOKENS: 40.0, METRIC_ACCEPTED_TOKENS: 25.0, METRIC_VERIFY_STEPS: 10.0}
    assert speculation_stats(before, after, num_requests=3)["tau"] == pytest.approx(3.5)


def test_tau_not_available():
    assert speculation_stats(None, None, 1)["tau"] is None
    no_spec = {METRIC_GENERATION_TOKENS: 10.0}
    assert "no speculative" in speculation_stats(no_spec, no_spec, 1)["reason"]
    idle = {METRIC_DRAFT_TOKENS: 3.0, METRIC_ACCEPTED_TOKENS: 1.0, METRIC_GENERATION_TOKENS: 10.0}
    stats = speculation_stats(idle, idle, 1)
    assert stats["tau"] is None and stats["draft_tokens"] == 0 and "no draft" in stats["reason"]


def test_label_follows_the_servers_draft_gauge():
    # A log-likelihood eval proposes no drafts even on a speculating server: the gauge, not the traffic, decides.
    quiet = {METRIC_DRAFT_TOKENS: 3.0, METRIC_ACCEPTED_TOKENS: 1.0, METRIC_GENERATION_TOKENS: 10.0}
    stats = speculation_stats(quiet, quiet | {METRIC_SPEC_ENABLED: 1.0}, 1)
    assert stats["enabled"] is True and default_label(stats) == "speculative"
    assert default_label(speculation_stats(quiet, quiet | {METRIC_SPEC_ENABLED: 0.0}, 1)) == "standard"
    busy = {METRIC_DRAFT_TOKENS: 9.0, METRIC_ACCEPTED_TOKENS: 4.0, METRIC_GENERATION_TOKENS: 20.0}
    assert default_label(speculation_stats(quiet, busy, 1)) == "speculative"  # an older server: drafts decide
    assert default_label(speculation_stats(quiet, quiet, 1)) == "standard"


def test_run_parallel_keeps_order_and_bounds_concurrency():
    active, peak, lock = 0, 0, threading.Lock()

    def work(x):
        nonlocal active, peak
        with lock:
            active += 1
            peak = max(peak, active)
        time.sleep(0.01 * (x % 3))
        with lock:
            active -= 1
        return x * x

    stream = io.StringIO()
    assert run_parallel(work, list(range(20)), 4, "sq", stream) == [x * x for x in range(20)]
    assert 1 < peak <= 4
    lines = stream.getvalue().splitlines()
    assert lines[-1].startswith("sq [##############################] 20/20")


def test_run_parallel_raises_the_first_failure():
    def work(x):
        if x == 3:
            raise ValueError("item 3 failed")
        time.sleep(0.05)
        return x

    with pytest.raises(ValueError, match="item 3 failed"):
        run_parallel(work, list(range(50)), 2, "x", io.StringIO())
    with pytest.raises(ValueError, match="--parallel"):
        run_parallel(work, [1], 0, "x", io.StringIO())


def test_progress_bar_on_a_pipe_prints_the_first_item_and_every_tenth():
    stream = io.StringIO()
    bar = ProgressBar(100, "demo", stream)
    for _ in range(100):
        bar.update()
    bar.close()
    lines = stream.getvalue().splitlines()
    assert len(lines) == 11 and "1/100" in lines[0] and "10/100" in lines[1] and "100/100" in lines[-1]


def test_client_rejects_a_bad_url_and_strips_v1():
    with pytest.raises(ValueError, match="--base-url"):
        EvalClient("localhost:8000")
    with EvalClient("http://127.0.0.1:1/v1/") as client:
        assert client.base_url == "http://127.0.0.1:1"
