"""MMMU: the multimodal benchmark's published parquet layout read from a local folder, its standard prompt (lettered
options, images in place of their `<image N>` tags) over /v1/chat/completions, and answers extracted and scored as
the MMMU reference code does (`parse_multi_choice_response`, `parse_open_response`, `eval_multi_choice`, `eval_open`).

Layout (Hugging Face `MMMU/MMMU`): one folder per subject (`Accounting/`, `Art/`, ...), each holding
`<split>-0000i-of-0000n.parquet` files with columns id, question, options (a string holding a Python list), answer,
image_1..image_7 ({"bytes", "path"} or null), question_type ("multiple-choice" or "open"), subfield, and more.
Prompt (the reference's LLaVA config): "{question}\\n(A) {option}\\n(B) ...\\n\\nAnswer with the option's letter from
the given choices directly." or "{question}\\nAnswer the question using a single word or phrase."; greedy.
"""

from __future__ import annotations

import ast
import base64
import random
import re
import time
from pathlib import Path
from typing import Any

from jetserve.evals.client import EvalClient, run_parallel, speculation_stats
from jetserve.evals.results import accuracy, default_label, format_accuracy, format_table, result_header

MAX_IMAGES = 7
MULTI_CHOICE_INSTRUCTION = "Answer with the option's letter from the given choices directly."
OPEN_INSTRUCTION = "Answer the question using a single word or phrase."
IMAGE_TAG_RE = re.compile(r"<image (\d+)>")
SEED = 42  # the reference seeds its random fallback for unparseable multiple-choice answers with 42


def load_rows(data_dir: str | Path, split: str, subjects: list[str] | None = None) -> dict[str, list[dict[str, Any]]]:
    """{subject: rows in file order} for every subject folder with `<split>-*.parquet` files (or only `subjects`)."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError("eval mmmu: needs pyarrow to read the parquet files (pip install pyarrow)") from None
    root = Path(data_dir)
    if not root.is_dir():
        raise ValueError(f"--data-dir: {data_dir} is not a folder")
    found = {d.name: sorted(d.glob(f"{split}-*.parquet")) for d in sorted(root.iterdir()) if d.is_dir()}
    found = {name: files for name, files in found.items() if files}
    if not found:
        raise ValueError(f"--data-dir: no <subject>/{split}-*.parquet files under {data_dir} (the MMMU/MMMU layout)")
    if subjects:
        unknown = [s for s in subjects if s not in found]
        if unknown:
            raise ValueError(f"--subjects: {', '.join(unknown)} not found (have {', '.join(found)})")
        found = {s: found[s] for s in subjects}
    out = {}
    for subject, files in found.items():
        rows = []
        for file in files:
            rows += pq.read_table(file).to_pylist()
        missing = {"id", "question", "options", "answer", "question_type"} - set(rows[0]) if rows else set()
        if missing:
            raise ValueError(f"{files[0]}: columns {sorted(missing)} missing (not the MMMU layout)")
        out[subject] = rows
    return out


def parse_options(options: str | list[str]) -> list[str]:
    """The options column: a string holding a Python list (as published), or already a list."""
    if isinstance(options, list):
        return [str(o) for o in options]
    try:
        value = ast.literal_eval(options) if options else []
    except (ValueError, SyntaxError):
        raise ValueError(f"options: {options[:80]!r} is not a Python list literal") from None
    if not isinstance(value, list):
        raise ValueError(f"options: {options[:80]!r} is not a list")
    return [str(o) for o in value]


def is_multiple_choice(row: dict[str, Any]) -> bool:
    return row["question_type"] == "multiple-choice"


def prompt_text(row: dict[str, Any]) -> str:
    """The reference prompt (before images replace their tags)."""
    if is_multiple_choice(row):
        lettered = "".join(f"({chr(ord('A') + i)}) {o}\n" for i, o in enumerate(parse_options(row["options"])))
        return f"{row['question']}\n{lettered}\n{MULTI_CHOICE_INSTRUCTION}"
    return f"{row['question']}\n{OPEN_INSTRUCTION}"


def image_data_url(image: dict[str, Any]) -> str:
    data = image["bytes"]
    mime = "image/png"
    for magic, kind in ((b"\xff\xd8\xff", "image/jpeg"), (b"GIF8", "image/gif"), (b"BM", "image/bmp"),
                        (b"RIFF", "image/webp")):  # fmt: skip
        if data.startswith(magic):
            mime = kind
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def message_content(row: dict[str, Any]) -> list[dict[str, Any]]:
    """Chat content parts: the prompt with each `<image N>` tag replaced by image N (in order of appearance); images
    no tag mentions go first, in column order. A tag naming an absent image stays as text."""
    images = {n: row.get(f"image_{n}") for n in range(1, MAX_IMAGES + 1)}
    images = {n: img for n, img in images.items() if img and img.get("bytes")}
    text = prompt_text(row)
    tagged = {int(n) for n in IMAGE_TAG_RE.findall(text)}
    parts: list[dict[str, Any]] = [
        {"type": "image_url", "image_url": {"url": image_data_url(img)}} for n, img in images.items() if n not in tagged
    ]
    last = 0
    for match in IMAGE_TAG_RE.finditer(text):
        n = int(match.group(1))
        if n not in images:
            continue
        if match.start() > last:
            parts.append({"type": "text", "text": text[last : match.start()]})
        parts.append({"type": "image_url", "image_url": {"url": image_data_url(images[n])}})
        last = match.end()
    if last < len(text):
        parts.append({"type": "text", "text": text[last:]})
    return parts


# ---- answer extraction and scoring (the MMMU reference's rules, reimplemented) ----


def parse_multi_choice(response: str, choices: list[str], index2ans: dict[str, str], rng: random.Random) -> str:
    """The predicted letter: "(X)" mentions first, else " X " mentions, else (for responses of more than 5 words)
    option texts it contains; several candidates → the one mentioned last; none → a random letter from `rng`."""
    for char in (",", ".", "!", "?", ";", ":", "'"):
        response = response.strip(char)
    response = f" {response} "
    candidates = [c for c in choices if f"({c})" in response]
    by_bracket = bool(candidates)
    by_text = False
    if not candidates:
        candidates = [c for c in choices if f" {c} " in response]
    if not candidates and len(response.split()) > 5:
        candidates = [c for c, text in index2ans.items() if text.lower() in response.lower()]
        by_text = bool(candidates)
    if not candidates:
        return rng.choice(choices)
    if len(candidates) == 1:
        return candidates[0]
    if by_text:
        where = [response.lower().rfind(index2ans[c].lower()) for c in candidates]
    elif by_bracket:
        where = [response.rfind(f"({c})") for c in candidates]
    else:
        where = [response.rfind(f" {c} ") for c in candidates]
    return candidates[max(range(len(where)), key=lambda i: (where[i], -i))]


def _is_number(text: str) -> bool:
    try:
        float(text.replace(",", ""))
    except ValueError:
        return False
    return True


def normalize_answer(text: str) -> list[str | float]:
    """A number → [its value rounded to 2 decimals]; else the lower-cased string (a single character padded with a
    space on either side, to avoid trivial substring matches)."""
    text = text.strip()
    if _is_number(text):
        return [round(float(text.replace(",", "")), 2)]
    text = text.lower()
    return [" " + text, text + " "] if len(text) == 1 else [text]


_NUMBER_RES = (
    re.compile(r"-?\b\d{1,3}(?:,\d{3})+\b"),  # with thousands separators
    re.compile(r"-?\d+(?:\.\d+)?[eE][+-]?\d+"),  # scientific
    re.compile(r"-?(?:\d+\.\d+|\.\d+|\d+\b)(?![eE][+-]?\d+)(?![,\d])"),  # plain
)
_KEY_INDICATORS = ("could be ", "so ", "is ", "thus ", "therefore ", "final ", "answer ", "result ")


def extract_numbers(text: str) -> list[str]:
    return [number for pattern in _NUMBER_RES for number in pattern.findall(text)]


def parse_open(response: str) -> list[str | float]:
    """Candidate answers of an open response: per sentence/line, the shortest tail after a key phrase ("is ",
    "therefore ", ... and "=" in the last one), or the whole response when none has one; plus every number in them;
    all normalised (`normalize_answer`), duplicates dropped."""
    response = response.strip().strip(".").lower()
    pieces = re.split(r"\.\s(?=[A-Z])|\n", response)
    keys: list[str] = []
    for i, piece in enumerate(pieces):
        indicators = _KEY_INDICATORS + (("=",) if i == len(pieces) - 1 else ())
        shortest = ""
        for tail in (piece.split(ind)[-1].strip() for ind in indicators if ind in piece):
            # As the reference: an empty pick is replaced by the next tail whatever its length.
            if not shortest or len(tail) < len(shortest):
                shortest = tail
        if shortest and shortest not in (":", ",", ".", "!", "?", ";", "'"):
            keys.append(shortest)
    if not keys:
        keys = [response]
    found = keys + [n for key in keys for n in extract_numbers(key)]
    out: list[str | float] = []
    for item in found:
        for value in normalize_answer(item):
            if value not in out:
                out.append(value)
    return out


def gold_answers(answer: str) -> list[str]:
    """An open question's answer: one string, or a string holding a Python list of accepted answers."""
    text = answer.strip()
    if text.startswith("["):
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            return [answer]
        if isinstance(value, list):
            return [str(v) for v in value]
    return [answer]


def is_open_correct(gold: list[str], predictions: list[str | float]) -> bool:
    """A string prediction is right when it contains a normalised gold string; a number when it equals a gold one."""
    normalized = [value for g in gold for value in normalize_answer(g)]
    for pred in predictions:
        if isinstance(pred, str):
            if any(isinstance(g, str) and g in pred for g in normalized):
                return True
        elif pred in normalized:
            return True
    return False


def score(row: dict[str, Any], response: str, rng: random.Random) -> dict[str, Any]:
    if is_multiple_choice(row):
        options = parse_options(row["options"])
        choices = [chr(ord("A") + i) for i in range(len(options))]
        if not choices:
            return {"predicted": None, "is_correct": False}
        predicted = parse_multi_choice(response, choices, dict(zip(choices, options, strict=True)), rng)
        return {"predicted": predicted, "is_correct": predicted == row["answer"]}
    predictions = parse_open(response)
    return {"predicted": predictions, "is_correct": is_open_correct(gold_answers(str(row["answer"])), predictions)}


# ---- the run ----


def run(
    client: EvalClient,
    model: str,
    data_dir: str | Path,
    split: str = "validation",
    subjects: list[str] | None = None,
    limit: int | None = None,
    parallel: int = 16,
    max_tokens: int = 64,
    label: str | None = None,
) -> dict[str, Any]:
    """MMMU `split` (the first `limit` questions of each subject) → the result dict (per-subject and overall
    accuracy, one sample per question)."""
    if limit is not None and limit < 1:
        raise ValueError(f"--limit: {limit} must be ≥ 1")
    if max_tokens < 1:
        raise ValueError(f"--max-tokens: {max_tokens} must be ≥ 1")
    by_subject = load_rows(data_dir, split, subjects)
    docs = [(subject, row) for subject, rows in by_subject.items() for row in (rows[:limit] if limit else rows)]

    def answer(doc: tuple[str, dict[str, Any]]) -> dict[str, Any]:
        _, row = doc
        body = {
            "model": model,
            "messages": [{"role": "user", "content": message_content(row)}],
            "max_tokens": max_tokens,
            "temperature": 0.0,
        }
        start = time.perf_counter()
        response = client.post_json("/v1/chat/completions", body)
        choice = response["choices"][0]
        return {
            "response": choice["message"]["content"],
            "finish_reason": choice.get("finish_reason"),
            "completion_tokens": response["usage"]["completion_tokens"],
            "prompt_tokens": response["usage"]["prompt_tokens"],
            "seconds": time.perf_counter() - start,
        }

    before = client.metrics()
    start = time.perf_counter()
    outputs = run_parallel(answer, docs, parallel, "mmmu")
    wall_s = time.perf_counter() - start
    after = client.metrics()

    rng = random.Random(SEED)
    samples = []
    for (subject, row), out in zip(docs, outputs, strict=True):
        samples.append({"id": row["id"], "subject": subject, "question_type": row["question_type"],
                        "reference": row["answer"]} | score(row, out["response"], rng) | out)  # fmt: skip
    n = len(samples)
    per_subject = {
        subject: accuracy(sum(s["is_correct"] for s in samples if s["subject"] == subject),
                          sum(s["subject"] == subject for s in samples))
        for subject in by_subject
    }  # fmt: skip
    per_type = {
        kind: accuracy(sum(s["is_correct"] for s in samples if s["question_type"] == kind),
                       sum(s["question_type"] == kind for s in samples))
        for kind in sorted({s["question_type"] for s in samples})
    }  # fmt: skip
    output_tokens = sum(s["completion_tokens"] for s in samples)
    speculation = speculation_stats(before, after, num_requests=n)
    metrics = {
        "overall": accuracy(sum(s["is_correct"] for s in samples), n),
        "per_subject": per_subject,
        "per_question_type": per_type,
        "num_questions": n,
        "output_tokens": output_tokens,
        "prompt_tokens": sum(s["prompt_tokens"] for s in samples),
        "wall_seconds": wall_s,
        "output_tokens_per_s": output_tokens / wall_s if wall_s > 0 else None,
        "num_truncated": sum(s["finish_reason"] == "length" for s in samples),
        "speculation": speculation,
    }
    config = {"data_dir": str(data_dir), "split": split, "subjects": list(by_subject), "limit": limit,
              "parallel": parallel, "max_tokens": max_tokens,
              "format": "MMMU reference prompt (llava1.5 config), greedy, reference answer parsing"}  # fmt: skip
    header = result_header("mmmu", client.base_url, model, label or default_label(speculation), config)
    return header | {"metrics": metrics, "samples": samples}


def summary_table(result: dict[str, Any]) -> str:
    m = result["metrics"]
    rows = [[subject, format_accuracy(s), f"{s['num_correct']}/{s['num_total']}"]
            for subject, s in m["per_subject"].items()]  # fmt: skip
    rows += [[f"({kind})", format_accuracy(s), f"{s['num_correct']}/{s['num_total']}"]
             for kind, s in m["per_question_type"].items()]  # fmt: skip
    rows.append(["OVERALL (micro)", format_accuracy(m["overall"]),
                 f"{m['overall']['num_correct']}/{m['overall']['num_total']}"])  # fmt: skip
    table = format_table(["subject", "accuracy % [95% CI]", "correct"], rows)
    tau = m["speculation"].get("tau")
    tau_text = "n/a" if tau is None else f"{tau:.2f}"
    footer = f"truncated at --max-tokens: {m['num_truncated']}; τ: {tau_text}"
    return f"{result['model']} ({result['label']})\n{table}\n{footer}"
