"""Prometheus metrics of one server: request counts, token counters, latency histograms, page and slot usage."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from jetserve.engine.engine import LLMEngine
from jetserve.engine.output import RequestOutput

CONTENT_TYPE = CONTENT_TYPE_LATEST

# Bucket edges in seconds: CPU test runs land in the upper ones, an H200 decode step (about 1 ms) in the lower ones.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
ITL_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.015, 0.02, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)


class ServerMetrics:
    """All metrics live in the server's own registry (two servers in one process do not collide).

    The engine thread samples the engine's queues and pools after every step (`sample_engine`); the event loop
    records token counts and latencies as outputs arrive (`output_received`). Speculative-decoding counters read the
    engine's `num_draft_tokens` / `num_accepted_tokens` / `num_drafts` totals (0 without a draft); a draft is one
    sequence's tree in one verify step, so τ = 1 + accepted / drafts.
    """

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}
        reg = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labelnames=list(labels), registry=reg).labels(**labels)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labelnames=list(labels), registry=reg).labels(**labels)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labelnames=list(labels), buckets=buckets, registry=reg).labels(**labels)

        self.num_running = gauge("jetserve:num_requests_running", "Sequences in the running set.")
        self.num_waiting = gauge("jetserve:num_requests_waiting", "Sequences queued (new or preempted).")
        self.prompt_tokens = counter("jetserve:prompt_tokens", "Prompt tokens of requests that started.")
        self.generation_tokens = counter("jetserve:generation_tokens", "Output tokens generated.")
        self._finished = Counter(
            "jetserve:request_success", "Requests finished, by reason (stop, length, abort).",
            labelnames=["model_name", "finished_reason"], registry=reg,
        )  # fmt: skip
        self._model_name = model_name
        self.ttft = histogram("jetserve:time_to_first_token_seconds", "Arrival to first output token.", TTFT_BUCKETS)
        self.itl = histogram("jetserve:inter_token_latency_seconds", "Time between output tokens.", ITL_BUCKETS)
        self.e2e = histogram("jetserve:e2e_request_latency_seconds", "Arrival to the last token.", E2E_BUCKETS)
        self.step_time = histogram("jetserve:engine_step_seconds", "Duration of one engine step.", ITL_BUCKETS)
        self.page_usage = gauge("jetserve:kv_page_usage_perc", "Share of usable KV pages in use (0 to 1).")
        self.num_free_pages = gauge("jetserve:num_free_pages", "KV pages free.")
        self.num_usable_pages = gauge("jetserve:num_usable_pages", "KV pages that can be handed out.")
        self.slot_usage = gauge("jetserve:state_slot_usage_perc", "Share of usable state slots in use (0 to 1).")
        self.num_free_slots = gauge("jetserve:num_free_slots", "State slots free.")
        self.num_usable_slots = gauge("jetserve:num_usable_slots", "State slots that can be handed out.")
        self.preemptions = counter("jetserve:num_preemptions", "Sequences preempted (to be recomputed).")
        self.draft_tokens = counter("jetserve:spec_decode_num_draft_tokens", "Draft tokens proposed.")
        self.accepted_tokens = counter("jetserve:spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.drafts = counter("jetserve:spec_decode_num_drafts", "Draft trees verified (one per sequence per step).")
        self.acceptance_rate = gauge(
            "jetserve:spec_decode_acceptance_rate", "Accepted over proposed draft tokens (0 without drafts)."
        )
        self.spec_enabled = gauge(
            "jetserve:spec_decode_enabled", "1 when the engine runs a draft model (speculative decoding), else 0."
        )
        self._last_totals = {"preemptions": 0, "draft_tokens": 0, "accepted": 0, "drafts": 0}

    def finished(self, reason: str) -> None:
        self._finished.labels(model_name=self._model_name, finished_reason=reason).inc()

    def request_aborted(self) -> None:
        self.finished("abort")

    def output_received(
        self,
        out: RequestOutput,
        num_prompt_tokens: int,
        arrival_s: float,
        last_token_s: float | None,
        now_s: float,
    ) -> None:
        """Count an output's tokens; the first output of a request gives its TTFT, later ones its inter-token gaps."""
        n = len(out.new_token_ids)
        self.generation_tokens.inc(n)
        if last_token_s is None:
            self.prompt_tokens.inc(num_prompt_tokens)
            self.ttft.observe(now_s - arrival_s)
        elif n > 0:
            gap = (now_s - last_token_s) / n  # several tokens at once (speculation) share the gap
            for _ in range(n):
                self.itl.observe(gap)
        if out.finished:
            self.e2e.observe(now_s - arrival_s)
            self.finished(out.finish_reason or "stop")

    def sample_engine(self, engine: LLMEngine, step_s: float) -> None:
        """Read the engine's queues, pools and totals (on the engine thread, between steps)."""
        if step_s > 0:
            self.step_time.observe(step_s)
        scheduler, pages, slots = engine.scheduler, engine.block_manager, engine.state_pool
        self.num_running.set(len(scheduler.running))
        self.num_waiting.set(len(scheduler.waiting))
        self.num_free_pages.set(pages.num_free_pages)
        self.num_usable_pages.set(pages.num_usable_pages)
        self.page_usage.set(1 - pages.num_free_pages / pages.num_usable_pages)
        self.num_free_slots.set(slots.num_free_slots)
        self.num_usable_slots.set(slots.num_usable_slots)
        self.slot_usage.set(1 - slots.num_free_slots / slots.num_usable_slots)
        totals = {
            "preemptions": scheduler.num_preemptions,
            "draft_tokens": getattr(engine, "num_draft_tokens", 0),
            "accepted": getattr(engine, "num_accepted_tokens", 0),
            "drafts": getattr(engine, "num_drafts", 0),
        }
        for key, metric in (("preemptions", self.preemptions), ("draft_tokens", self.draft_tokens),
                            ("accepted", self.accepted_tokens), ("drafts", self.drafts)):  # fmt: skip
            delta = totals[key] - self._last_totals[key]
            if delta > 0:
                metric.inc(delta)
        self._last_totals = totals
        self.acceptance_rate.set(totals["accepted"] / totals["draft_tokens"] if totals["draft_tokens"] else 0.0)

    def render(self) -> bytes:
        return generate_latest(self.registry)
