"""What every eval reports: accuracy with a Wilson 95% interval, the result JSON (header, metrics, samples), tables."""

from __future__ import annotations

import datetime
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

Z95 = 1.959963984540054  # two-sided 95% normal quantile


def wilson_interval(num_correct: int, num_total: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval for a binomial proportion (sensible at 0/n and n/n, unlike the normal one)."""
    assert 0 <= num_correct <= num_total, (num_correct, num_total)
    if num_total == 0:
        return (0.0, 1.0)
    p = num_correct / num_total
    denom = 1 + z * z / num_total
    centre = (p + z * z / (2 * num_total)) / denom
    half = z * math.sqrt(p * (1 - p) / num_total + z * z / (4 * num_total * num_total)) / denom
    return (max(0.0, centre - half), min(1.0, centre + half))


def accuracy(num_correct: int, num_total: int) -> dict[str, Any]:
    """`{"accuracy", "ci95": [lo, hi], "num_correct", "num_total"}` (accuracy None when there is nothing to score)."""
    lo, hi = wilson_interval(num_correct, num_total)
    return {
        "accuracy": num_correct / num_total if num_total else None,
        "ci95": [lo, hi],
        "num_correct": num_correct,
        "num_total": num_total,
    }


def result_header(eval_name: str, base_url: str, model: str, label: str, config: dict[str, Any]) -> dict[str, Any]:
    """The fields every result JSON starts with; `label` is the inference type compare shows beside the model."""
    return {
        "eval": eval_name,
        "model": model,
        "label": label,
        "base_url": base_url,
        "config": config,
        "started_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def default_label(speculation: dict[str, Any]) -> str:
    """The inference type when the user gives no --label: speculative when the server runs a draft model (its
    `jetserve:spec_decode_enabled` gauge), else — for servers without that gauge — when it proposed drafts."""
    enabled = speculation.get("enabled")
    if enabled is None:
        enabled = speculation.get("draft_tokens", 0) > 0
    return "speculative" if enabled else "standard"


def write_result(result: dict[str, Any], out: str | None) -> Path:
    """Write `result` as indented JSON to `out`, or to ./jetserve-eval-<eval>-<UTC time>.json; returns the path."""
    if out is None:
        stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d-%H%M%S")
        out = f"jetserve-eval-{result['eval']}-{stamp}.json"
    path = Path(out)
    if path.parent != Path("."):
        path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n")
    return path


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain-text table: columns padded to their widest cell, numbers right-aligned, a rule under the header."""
    cells = [[str(h) for h in headers]] + [["-" if c is None else str(c) for c in row] for row in rows]
    assert all(len(r) == len(headers) for r in cells), "every row needs one cell per header"
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    numeric = [all(_is_number(r[i]) for r in cells[1:]) and len(cells) > 1 for i in range(len(headers))]

    def line(row: list[str]) -> str:
        return "  ".join(c.rjust(w) if num else c.ljust(w) for c, w, num in zip(row, widths, numeric, strict=True))

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]).rstrip(), rule] + [line(r).rstrip() for r in cells[1:]])


def _is_number(text: str) -> bool:
    try:
        float(text.rstrip("%*"))
    except ValueError:
        return text == "-"
    return True


def percent(x: float | None, digits: int = 1) -> str | None:
    return None if x is None else f"{100 * x:.{digits}f}"


def format_accuracy(summary: dict[str, Any]) -> str | None:
    """`71.3 [68.8, 73.7]` (percent with the 95% interval), or None when nothing was scored."""
    if summary.get("accuracy") is None:
        return None
    lo, hi = summary["ci95"]
    return f"{percent(summary['accuracy'])} [{percent(lo)}, {percent(hi)}]"
