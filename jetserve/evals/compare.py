"""`jetserve eval compare`: eval result JSONs → the seed-style table (model + inference type → GSM8K, MMLU, τ), with
accuracy differences from the first row that exceed the 95% interval of the difference flagged.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from jetserve.evals.results import Z95, format_table, percent

EVALS = ("gsm8k", "mmlu", "mmmu", "mtbench")
# Config keys that change the measurement (not just how fast it was taken).
_NEUTRAL_CONFIG_KEYS = ("parallel",)


def load_results(paths: list[str]) -> list[dict[str, Any]]:
    results = []
    for path in paths:
        file = Path(path)
        if not file.is_file():
            raise FileNotFoundError(f"{path}: no such file")
        try:
            data = json.loads(file.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not JSON ({e})") from None
        if not isinstance(data, dict) or data.get("eval") not in EVALS or "metrics" not in data:
            raise ValueError(f"{path}: not a jetserve eval result (no 'eval' in {', '.join(EVALS)} with 'metrics')")
        results.append(data | {"path": str(path)})
    return results


def group_rows(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (model, label) in order of first appearance, holding at most one result per eval."""
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for r in results:
        key = (r["model"], r["label"])
        row = rows.setdefault(key, {"model": r["model"], "label": r["label"], "results": {}})
        if r["eval"] in row["results"]:
            other = row["results"][r["eval"]]["path"]
            raise ValueError(f"{r['path']} and {other}: two {r['eval']} results for model {r['model']!r}, "
                             f"label {r['label']!r}; rerun one with a distinct --label")  # fmt: skip
        row["results"][r["eval"]] = r
    return list(rows.values())


def _score(result: dict[str, Any], metric: str) -> tuple[float, int] | None:
    """(accuracy, number of questions) of `metric`: gsm8k flexible/strict, mmlu and mmmu overall."""
    m = result["metrics"]
    summary = m["overall"] if metric in ("mmlu", "mmmu") else m[metric.split(":")[1]]
    if summary.get("accuracy") is None:
        return None
    return summary["accuracy"], summary["num_total"]


def difference(a: tuple[float, int], b: tuple[float, int]) -> tuple[float, float]:
    """(b − a, half-width of its 95% interval) for two independent proportions (unpooled normal approximation)."""
    (pa, na), (pb, nb) = a, b
    half = Z95 * math.sqrt(pa * (1 - pa) / na + pb * (1 - pb) / nb)
    return pb - pa, half


def _changed_answers(base: dict[str, Any], other: dict[str, Any]) -> tuple[int, int] | None:
    """(answers that differ, questions in common) when both files carry per-question samples."""
    if base["eval"] == "gsm8k":
        key, value = (lambda s: s["index"]), (lambda s: s["text"])
    elif base["eval"] == "mmlu":
        key, value = (lambda s: (s["subject"], s["index"])), (lambda s: s["predicted"])
    elif base["eval"] == "mmmu":
        key, value = (lambda s: s["id"]), (lambda s: str(s["predicted"]))
    else:
        return None
    a = {key(s): value(s) for s in base.get("samples", [])}
    b = {key(s): value(s) for s in other.get("samples", [])}
    common = a.keys() & b.keys()
    if not common:
        return None
    return sum(a[k] != b[k] for k in common), len(common)


def _config_diff(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    keys = sorted((a["config"].keys() | b["config"].keys()) - set(_NEUTRAL_CONFIG_KEYS))
    return [f"{k} {a['config'].get(k)!r} vs {b['config'].get(k)!r}" for k in keys
            if a["config"].get(k) != b["config"].get(k)]  # fmt: skip


COLUMNS = (("gsm8k:flexible", "GSM8K %"), ("gsm8k:strict", "GSM8K strict %"), ("mmlu", "MMLU %"), ("mmmu", "MMMU %"))


def compare(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Rows (first = baseline), each accuracy with its flag, τ, MT-bench tok/s; and notes explaining every flag."""
    rows = group_rows(results)
    base = rows[0]
    table_rows, notes, flagged = [], [], False
    for row in rows:
        cells: dict[str, Any] = {"model": row["model"], "label": row["label"]}
        for metric, _ in COLUMNS:
            result = row["results"].get(metric.split(":")[0])
            score = _score(result, metric) if result else None
            cells[metric] = {"accuracy": None, "num": None, "flag": False}
            if score is not None:
                cells[metric] |= {"accuracy": score[0], "num": score[1]}
            base_result = base["results"].get(metric.split(":")[0])
            base_score = _score(base_result, metric) if base_result else None
            if row is base or score is None or base_score is None:
                continue
            delta, half = difference(base_score, score)
            cells[metric] |= {"delta": delta, "ci95_half_width": half}
            if abs(delta) > half:
                cells[metric]["flag"] = True
                flagged = True
                notes.append(f"{metric} {row['label']} vs {base['label']}: {100 * delta:+.1f} points, beyond "
                             f"the 95% interval of the difference (±{100 * half:.1f})")  # fmt: skip
        mt = row["results"].get("mtbench")
        spec = mt["metrics"]["speculation"] if mt else {}
        cells["tau"] = spec.get("tau")
        cells["mtbench_tokens_per_s"] = mt["metrics"]["output_tokens_per_s"] if mt else None
        table_rows.append(cells)
        if row is base:
            continue
        for name in EVALS:
            a, b = base["results"].get(name), row["results"].get(name)
            if not a or not b:
                continue
            diff = _config_diff(a, b)
            if diff:
                notes.append(f"{name} {row['label']} vs {base['label']}: configs differ: {'; '.join(diff)}")
            changed = _changed_answers(a, b)
            if changed is not None:
                notes.append(f"{name} {row['label']} vs {base['label']}: {changed[0]} of {changed[1]} answers differ")
    return {"rows": table_rows, "notes": notes, "flagged": flagged}


def format_comparison(comparison: dict[str, Any]) -> str:
    headers = ["model", "inference", *(title for _, title in COLUMNS), "τ", "MT-bench tok/s"]
    lines = []
    for cells in comparison["rows"]:
        accs = []
        for metric, _ in COLUMNS:
            c = cells[metric]
            accs.append(None if c["accuracy"] is None else percent(c["accuracy"]) + ("*" if c["flag"] else ""))
        tau, speed = cells["tau"], cells["mtbench_tokens_per_s"]
        lines.append([cells["model"], cells["label"], *accs, None if tau is None else f"{tau:.2f}",
                      None if speed is None else f"{speed:.1f}"])  # fmt: skip
    text = format_table(headers, lines)
    if comparison["flagged"]:
        text += "\n* differs from the first row by more than the 95% interval of the difference"
    return "\n".join([text, *comparison["notes"]])
