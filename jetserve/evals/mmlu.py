"""MMLU: the standard k-shot prompt from the dev split (lm-eval's `mmlu` format), answered by log-likelihood of each
choice (default) or by generation; accuracy per subject and overall.

Prompt: "The following are multiple choice questions (with answers) about {subject}.\n\n", then each dev shot as
"{question}\nA. {a}\nB. {b}\nC. {c}\nD. {d}\nAnswer: {X}\n\n", then the test question ending in "Answer:". Questions are
stripped of surrounding whitespace as lm-eval does (the original hendrycks script does not; 979 rows differ).

Log-prob mode scores the four continuations " A".." D" with one /v1/completions request (`prompt` = the four full
strings, `echo`, `max_tokens` 0, `logprobs` 1): each choice's score is the sum of its prompt-token log-probs from the
first token where the four tokenisations differ. That is lm-eval's loglikelihood, and unlike reading the top-k of the
next token it works with any tokenizer (a byte-level one splits " A" into two tokens), never misses a letter that falls
outside the top-k, and does not depend on where the tokenizer puts the boundary between "Answer:" and " A".
"""

from __future__ import annotations

import csv
import io
import re
import time
from functools import lru_cache
from importlib import resources
from typing import Any

from jetserve.evals.client import EvalClient, EvalError, run_parallel, speculation_stats
from jetserve.evals.results import accuracy, default_label, format_accuracy, format_table, percent, result_header

LETTERS = ("A", "B", "C", "D")
MODES = ("logprob", "generate")
GENERATE_RE = re.compile(r"\b([ABCD])\b")


def _data_dir() -> Any:
    return resources.files("jetserve.evals").joinpath("data", "mmlu")


@lru_cache(maxsize=1)
def subjects() -> tuple[str, ...]:
    """The 57 subjects, sorted (file names of the dev split without `_dev.csv`)."""
    names = [p.name for p in _data_dir().joinpath("dev").iterdir() if p.name.endswith("_dev.csv")]
    return tuple(sorted(n[: -len("_dev.csv")] for n in names))


@lru_cache(maxsize=128)
def load_split(subject: str, split: str) -> tuple[tuple[str, ...], ...]:
    """Rows `(question, A, B, C, D, answer letter)` of one subject's `dev` or `test` CSV."""
    if subject not in subjects():
        raise ValueError(f"--subjects: {subject!r} is not an MMLU subject (see `jetserve eval mmlu --list-subjects`)")
    if split not in ("dev", "test"):
        raise ValueError(f"mmlu split: {split!r} is not dev or test")
    text = _data_dir().joinpath(split, f"{subject}_{split}.csv").read_text(encoding="utf-8")
    rows = tuple(tuple(row) for row in csv.reader(io.StringIO(text, newline="")))
    assert all(len(r) == 6 and r[5] in LETTERS for r in rows), f"{subject}_{split}.csv: malformed row"
    return rows


def format_subject(subject: str) -> str:
    return subject.replace("_", " ")


def format_question(row: tuple[str, ...], with_answer: bool) -> str:
    text = row[0].strip() + "".join(f"\n{letter}. {choice}" for letter, choice in zip(LETTERS, row[1:5], strict=True))
    return text + (f"\nAnswer: {row[5]}\n\n" if with_answer else "\nAnswer:")


def build_prompt(subject: str, row: tuple[str, ...], shots: tuple[tuple[str, ...], ...]) -> str:
    """The k-shot prompt for test `row` of `subject` (see the module docstring)."""
    header = f"The following are multiple choice questions (with answers) about {format_subject(subject)}.\n\n"
    return header + "".join(format_question(s, with_answer=True) for s in shots) + format_question(row, False)


def continuation_scores(choices: list[dict[str, Any]]) -> list[float]:
    """Each echoed prompt's log-prob summed from the first token where the prompts' tokenisations differ.

    The prompts share everything but their last characters, so their common token prefix has the same log-probs in
    theory; leaving it out keeps batch-dependent rounding in that prefix out of the comparison.
    """
    token_lists = [c["logprobs"]["tokens"] for c in choices]
    logprob_lists = [c["logprobs"]["token_logprobs"] for c in choices]
    common = 0
    while all(common < len(t) for t in token_lists) and len({t[common] for t in token_lists}) == 1:
        common += 1
    scores = []
    for tokens, logprobs in zip(token_lists, logprob_lists, strict=True):
        if common >= len(tokens):
            raise EvalError("mmlu: two echoed prompts tokenised identically; cannot tell the choices apart")
        tail = logprobs[common:]
        if any(lp is None for lp in tail):
            raise EvalError("mmlu: the server returned no log-prob for a continuation token (is echo supported?)")
        scores.append(float(sum(tail)))
    return scores


def extract_letter(text: str) -> str | None:
    """Generative mode: the first standalone A–D in the output, or None."""
    match = GENERATE_RE.search(text)
    return match.group(1) if match else None


def run(
    client: EvalClient,
    model: str,
    num_shots: int = 5,
    subject_names: list[str] | None = None,
    limit: int | None = None,
    mode: str = "logprob",
    parallel: int = 64,
    max_tokens: int = 8,
    label: str | None = None,
) -> dict[str, Any]:
    """MMLU test over `subject_names` (all when None), the first `limit` questions of each; the result dict."""
    if mode not in MODES:
        raise ValueError(f"--mode: {mode!r} is not one of {', '.join(MODES)}")
    if not 0 <= num_shots <= 5:
        raise ValueError(f"--num-shots: {num_shots} must be in [0, 5] (the dev split has 5 rows per subject)")
    if limit is not None and limit < 1:
        raise ValueError(f"--limit: {limit} must be ≥ 1")
    if max_tokens < 1:
        raise ValueError(f"--max-tokens: {max_tokens} must be ≥ 1")
    names = list(subject_names) if subject_names else list(subjects())
    if len(set(names)) != len(names):
        raise ValueError("--subjects: a subject is listed twice")
    docs = []
    for subject in names:
        shots = load_split(subject, "dev")[:num_shots]
        rows = load_split(subject, "test")
        for i, row in enumerate(rows[:limit] if limit is not None else rows):
            docs.append((subject, i, build_prompt(subject, row, shots), row[5]))

    def answer(doc: tuple[str, int, str, str]) -> dict[str, Any]:
        subject, index, prompt, reference = doc
        start = time.perf_counter()
        if mode == "logprob":
            body = {"model": model, "prompt": [f"{prompt} {x}" for x in LETTERS], "max_tokens": 0, "echo": True,
                    "logprobs": 1, "temperature": 0.0}  # fmt: skip
            response = client.post_json("/v1/completions", body)
            choices = sorted(response["choices"], key=lambda c: c["index"])
            if len(choices) != len(LETTERS):
                raise EvalError(f"mmlu: asked to score {len(LETTERS)} prompts, got {len(choices)} choices")
            scores = continuation_scores(choices)
            predicted: str | None = LETTERS[max(range(len(LETTERS)), key=lambda k: scores[k])]
            out: dict[str, Any] = {"scores": scores}
        else:
            body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stop": ["\n"]}
            response = client.post_json("/v1/completions", body)
            text = response["choices"][0]["text"]
            predicted = extract_letter(text)
            out = {"text": text, "completion_tokens": response["usage"]["completion_tokens"]}
        seconds = time.perf_counter() - start
        return {"subject": subject, "index": index, "reference": reference, "predicted": predicted,
                "is_correct": predicted == reference, "seconds": seconds} | out  # fmt: skip

    before = client.metrics()
    start = time.perf_counter()
    samples = run_parallel(answer, docs, parallel, f"mmlu ({mode})")
    wall_s = time.perf_counter() - start
    after = client.metrics()

    per_subject = {}
    for subject in names:
        mine = [s for s in samples if s["subject"] == subject]
        per_subject[subject] = accuracy(sum(s["is_correct"] for s in mine), len(mine))
    subject_accs = [v["accuracy"] for v in per_subject.values()]
    overall = accuracy(sum(s["is_correct"] for s in samples), len(samples))
    metrics = {
        "overall": overall,  # micro average: every question counts once (lm-eval's group aggregate)
        "macro_accuracy": sum(subject_accs) / len(subject_accs),
        "per_subject": per_subject,
        "num_questions": len(samples),
        "invalid_rate": sum(s["predicted"] is None for s in samples) / len(samples),
        "wall_seconds": wall_s,
        "speculation": speculation_stats(before, after, num_requests=len(samples)),
    }
    config = {"num_shots": num_shots, "subjects": names, "limit_per_subject": limit, "mode": mode,
              "parallel": parallel, "max_tokens": max_tokens if mode == "generate" else None,
              "format": "lm-eval mmlu (first_n shots from dev, question stripped)"}  # fmt: skip
    header = result_header("mmlu", client.base_url, model, label or default_label(metrics["speculation"]), config)
    return header | {"metrics": metrics, "samples": samples}


def summary_table(result: dict[str, Any]) -> str:
    m = result["metrics"]
    rows = [[name, format_accuracy(v), f"{v['num_correct']}/{v['num_total']}"] for name, v in m["per_subject"].items()]
    rows.append(["OVERALL (micro)", format_accuracy(m["overall"]),
                 f"{m['overall']['num_correct']}/{m['overall']['num_total']}"])  # fmt: skip
    table = format_table(["subject", "accuracy % [95% CI]", "correct"], rows)
    return (f"{result['model']} ({result['label']}), mode {result['config']['mode']}\n{table}\n"
            f"macro average {percent(m['macro_accuracy'])}%; invalid {percent(m['invalid_rate'])}%; "
            f"{m['wall_seconds']:.1f} s")  # fmt: skip
