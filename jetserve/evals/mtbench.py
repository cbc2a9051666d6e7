"""MT-bench speed: the 80 two-turn questions answered greedily over streamed /v1/chat/completions (turn two sees the
model's own first answer); output tokens/s, time to first token, time per output token, and τ from /metrics. No judge.
"""

from __future__ import annotations

import json
import statistics
import time
from functools import lru_cache
from importlib import resources
from typing import Any

from jetserve.evals.client import EvalClient, EvalError, run_parallel, speculation_stats
from jetserve.evals.results import default_label, format_table, result_header


@lru_cache(maxsize=1)
def load_questions() -> tuple[dict[str, Any], ...]:
    """The 80 questions `{"question_id", "category", "turns": [turn1, turn2], ...}` in file order."""
    text = resources.files("jetserve.evals").joinpath("data", "mtbench", "question.jsonl").read_text(encoding="utf-8")
    return tuple(json.loads(line) for line in text.splitlines() if line.strip())


def chat_turn(client: EvalClient, model: str, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    """One streamed greedy chat completion: its text, token count, TTFT and time per output token after the first."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
            "stream_options": {"include_usage": True}}  # fmt: skip
    start = time.perf_counter()
    first_s: float | None = None
    pieces: list[str] = []
    usage: dict[str, int] | None = None
    finish_reason = None
    for event in client.stream_events("/v1/chat/completions", body):
        for choice in event.get("choices") or []:
            text = (choice.get("delta") or {}).get("content") or ""
            if text and first_s is None:
                first_s = time.perf_counter() - start
            pieces.append(text)
            finish_reason = choice.get("finish_reason") or finish_reason
        if event.get("usage"):
            usage = event["usage"]
    latency_s = time.perf_counter() - start
    if usage is None:
        raise EvalError("mtbench: the stream carried no usage (stream_options.include_usage); cannot count tokens")
    n = usage["completion_tokens"]
    ttft_s = first_s if first_s is not None else latency_s
    return {
        "text": "".join(pieces),
        "completion_tokens": n,
        "prompt_tokens": usage["prompt_tokens"],
        "finish_reason": finish_reason,
        "latency_s": latency_s,
        "ttft_s": ttft_s,
        "tpot_s": (latency_s - ttft_s) / (n - 1) if n > 1 else None,
    }


def run(
    client: EvalClient,
    model: str,
    limit: int | None = None,
    parallel: int = 1,
    max_tokens: int = 1024,
    label: str | None = None,
) -> dict[str, Any]:
    """Both turns of the first `limit` questions (all 80 when None), `parallel` questions at a time; the result dict."""
    if limit is not None and limit < 1:
        raise ValueError(f"--limit: {limit} must be ≥ 1")
    if max_tokens < 1:
        raise ValueError(f"--max-tokens: {max_tokens} must be ≥ 1")
    questions = load_questions()
    questions = questions[:limit] if limit is not None else questions

    def answer(question: dict[str, Any]) -> dict[str, Any]:
        messages: list[dict[str, str]] = []
        turns = []
        for user_text in question["turns"]:
            messages.append({"role": "user", "content": user_text})
            turn = chat_turn(client, model, messages, max_tokens)
            messages.append({"role": "assistant", "content": turn["text"]})
            turns.append(turn)
        return {"question_id": question["question_id"], "category": question["category"], "turns": turns}

    before = client.metrics()
    start = time.perf_counter()
    samples = run_parallel(answer, questions, parallel, "mtbench")
    wall_s = time.perf_counter() - start
    after = client.metrics()

    turns = [t for s in samples for t in s["turns"]]
    output_tokens = sum(t["completion_tokens"] for t in turns)
    tpots = [t["tpot_s"] for t in turns if t["tpot_s"] is not None]
    ttfts = [t["ttft_s"] for t in turns]
    metrics = {
        "num_questions": len(samples),
        "num_requests": len(turns),
        "output_tokens": output_tokens,
        "wall_seconds": wall_s,
        "output_tokens_per_s": output_tokens / wall_s if wall_s > 0 else None,
        "mean_tpot_ms": 1000 * statistics.fmean(tpots) if tpots else None,
        "median_tpot_ms": 1000 * statistics.median(tpots) if tpots else None,
        "mean_ttft_ms": 1000 * statistics.fmean(ttfts),
        "num_truncated": sum(t["finish_reason"] == "length" for t in turns),
        "speculation": speculation_stats(before, after, num_requests=len(turns)),
    }
    config = {"limit": limit, "parallel": parallel, "max_tokens": max_tokens, "temperature": 0.0, "stream": True}
    header = result_header("mtbench", client.base_url, model, label or default_label(metrics["speculation"]), config)
    return header | {"metrics": metrics, "samples": samples}


def summary_table(result: dict[str, Any]) -> str:
    m = result["metrics"]
    spec = m["speculation"]

    def fixed(x: float | None, digits: int) -> str | None:
        return None if x is None else f"{x:.{digits}f}"

    rows = [
        ["questions / requests", f"{m['num_questions']} / {m['num_requests']}"],
        ["output tokens", m["output_tokens"]],
        ["output tokens/s", fixed(m["output_tokens_per_s"], 1)],
        ["mean time per output token (ms)", fixed(m["mean_tpot_ms"], 2)],
        ["median time per output token (ms)", fixed(m["median_tpot_ms"], 2)],
        ["mean time to first token (ms)", fixed(m["mean_ttft_ms"], 1)],
        ["τ (mean acceptance length)", fixed(spec.get("tau"), 2) or f"n/a ({spec.get('reason')})"],
        ["draft acceptance rate", fixed(spec.get("acceptance_rate"), 3)],
        ["truncated at --max-tokens", m["num_truncated"]],
    ]
    return f"{result['model']} ({result['label']}), parallel {result['config']['parallel']}\n" + format_table(
        ["mtbench", "value"], rows
    )
