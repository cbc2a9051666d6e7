"""GSM8K: few-shot chain-of-thought prompts in lm-eval's `gsm8k` format, greedy generation over /v1/completions, and
lm-eval's strict-match and flexible-extract answer filters.

Format (lm-eval `gsm8k`, version 3): each shot is "Question: {question}\nAnswer: {answer}\n\n" with the train split's
full worked answer (calculator annotations and the final "#### N" kept), then "Question: {question}\nAnswer:".
Shots are the first `num_shots` train rows (lm-eval's `first_n` sampler), so every prompt shares one prefix.
Generation stops at "Question:", "</s>" or "<|im_end|>". Both the prediction and the reference are normalised as
lm-eval's exact_match does (remove ",", "$", everything up to "#### ", one trailing ".", lower-case) and compared as
strings.
"""

from __future__ import annotations

import json
import re
import time
from functools import lru_cache
from importlib import resources
from typing import Any

from jetserve.evals.client import EvalClient, run_parallel, speculation_stats
from jetserve.evals.results import accuracy, default_label, format_accuracy, format_table, percent, result_header

STOP = ("Question:", "</s>", "<|im_end|>")
INVALID = "[invalid]"
STRICT_RE = re.compile(r"#### (\-?[0-9\.\,]+)")
FLEXIBLE_RE = re.compile(r"(-?[$0-9.,]{2,})|(-?[0-9]+)")
_IGNORE_RES = (re.compile(","), re.compile(r"\$"), re.compile(r"(?s).*#### "), re.compile(r"\.$"))


@lru_cache(maxsize=2)
def load_split(split: str) -> tuple[dict[str, str], ...]:
    """Rows `{"question", "answer"}` of the vendored `test` split or `train` (its first 64 rows: the shot pool)."""
    names = {"test": "test.jsonl", "train": "train_head64.jsonl"}
    if split not in names:
        raise ValueError(f"gsm8k split: {split!r} is not one of {', '.join(names)}")
    text = resources.files("jetserve.evals").joinpath("data", "gsm8k", names[split]).read_text(encoding="utf-8")
    return tuple(json.loads(line) for line in text.splitlines() if line.strip())


def fewshot_prefix(shots: list[dict[str, str]] | tuple[dict[str, str], ...]) -> str:
    return "".join(f"Question: {s['question']}\nAnswer: {s['answer']}\n\n" for s in shots)


def build_prompt(question: str, shots: list[dict[str, str]] | tuple[dict[str, str], ...]) -> str:
    """The few-shot prompt for `question` (see the module docstring for the format)."""
    return fewshot_prefix(shots) + f"Question: {question}\nAnswer:"


def extract_strict(text: str) -> str:
    """lm-eval's strict-match: the number after the first "#### ", else "[invalid]"."""
    match = STRICT_RE.search(text)
    return match.group(1) if match else INVALID


def extract_flexible(text: str) -> str:
    """lm-eval's flexible-extract: the last number-like run in the text (a lone digit, or ≥ 2 of `$0-9.,` with an
    optional leading minus), else "[invalid]"."""
    matches = FLEXIBLE_RE.findall(text)
    if not matches:
        return INVALID
    long, short = matches[-1]
    return long or short


def normalize(answer: str) -> str:
    """lm-eval exact_match's normalisation for GSM8K: drop commas, `$`, anything up to "#### ", one trailing period."""
    for pattern in _IGNORE_RES:
        answer = pattern.sub("", answer)
    return answer.lower()


def reference_answer(answer: str) -> str:
    """The normalised gold answer of a GSM8K `answer` field (the text after "#### ")."""
    assert "#### " in answer, answer
    return normalize(answer)


def is_correct(extracted: str, reference: str) -> bool:
    return extracted != INVALID and normalize(extracted) == reference


def run(
    client: EvalClient,
    model: str,
    num_shots: int = 8,
    limit: int | None = None,
    parallel: int = 64,
    max_tokens: int = 256,
    label: str | None = None,
) -> dict[str, Any]:
    """GSM8K test (the first `limit` questions) → the result dict (metrics plus one sample per question)."""
    train, test = load_split("train"), load_split("test")
    if not 0 <= num_shots <= len(train):
        raise ValueError(f"--num-shots: {num_shots} must be in [0, {len(train)}]")
    if limit is not None and limit < 1:
        raise ValueError(f"--limit: {limit} must be ≥ 1")
    if max_tokens < 1:
        raise ValueError(f"--max-tokens: {max_tokens} must be ≥ 1")
    shots = train[:num_shots]
    docs = test[:limit] if limit is not None else test

    def answer(doc: dict[str, str]) -> dict[str, Any]:
        body = {
            "model": model,
            "prompt": build_prompt(doc["question"], shots),
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "stop": list(STOP),
        }
        start = time.perf_counter()
        response = client.post_json("/v1/completions", body)
        seconds = time.perf_counter() - start
        choice = response["choices"][0]
        return {
            "text": choice["text"],
            "finish_reason": choice.get("finish_reason"),
            "completion_tokens": response["usage"]["completion_tokens"],
            "prompt_tokens": response["usage"]["prompt_tokens"],
            "seconds": seconds,
        }

    before = client.metrics()
    start = time.perf_counter()
    outputs = run_parallel(answer, docs, parallel, "gsm8k")
    wall_s = time.perf_counter() - start
    after = client.metrics()

    samples = []
    for i, (doc, out) in enumerate(zip(docs, outputs, strict=True)):
        reference = reference_answer(doc["answer"])
        strict, flexible = extract_strict(out["text"]), extract_flexible(out["text"])
        samples.append({
            "index": i,
            "reference": reference,
            "strict": strict,
            "flexible": flexible,
            "is_correct_strict": is_correct(strict, reference),
            "is_correct_flexible": is_correct(flexible, reference),
        } | out)  # fmt: skip
    n = len(samples)
    output_tokens = sum(s["completion_tokens"] for s in samples)
    speculation = speculation_stats(before, after, num_requests=n)
    metrics = {
        "flexible": accuracy(sum(s["is_correct_flexible"] for s in samples), n)
        | {"invalid_rate": sum(s["flexible"] == INVALID for s in samples) / n},
        "strict": accuracy(sum(s["is_correct_strict"] for s in samples), n)
        | {"invalid_rate": sum(s["strict"] == INVALID for s in samples) / n},
        "num_questions": n,
        "output_tokens": output_tokens,
        "prompt_tokens": sum(s["prompt_tokens"] for s in samples),
        "wall_seconds": wall_s,
        "output_tokens_per_s": output_tokens / wall_s if wall_s > 0 else None,
        "num_truncated": sum(s["finish_reason"] == "length" for s in samples),
        "speculation": speculation,
    }
    config = {"num_shots": num_shots, "limit": limit, "parallel": parallel, "max_tokens": max_tokens,
              "format": "lm-eval gsm8k v3 (first_n shots from train)", "stop": list(STOP)}  # fmt: skip
    header = result_header("gsm8k", client.base_url, model, label or default_label(speculation), config)
    return header | {"metrics": metrics, "samples": samples}


def summary_table(result: dict[str, Any]) -> str:
    m = result["metrics"]
    rows = [
        [f"gsm8k {name}", format_accuracy(m[name]), f"{m[name]['num_correct']}/{m[name]['num_total']}",
         percent(m[name]["invalid_rate"])]
        for name in ("flexible", "strict")
    ]  # fmt: skip
    table = format_table(["metric", "accuracy % [95% CI]", "correct", "invalid %"], rows)
    tau = m["speculation"].get("tau")
    tau_text = "n/a" if tau is None else f"{tau:.2f}"
    speed = (f"output {m['output_tokens']} tokens in {m['wall_seconds']:.1f} s = {m['output_tokens_per_s']:.1f} tok/s"
             f"; truncated at --max-tokens: {m['num_truncated']}; τ: {tau_text}")  # fmt: skip
    return f"{result['model']} ({result['label']})\n{table}\n{speed}"
