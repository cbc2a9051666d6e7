"""bench/policy_trace.py on the CPU: a short run of the default pair with drafts forced wrong, two policies A/B'd in
one process over two rounds, records every choice of each and the step times it judged from: the shortest chain and
plain decoding measured (the longer chain only where its bound lets it run), the shares of the choices summing to 1,
a longest run no longer than the choices, and a speed-up over the plain runs, overall and per round."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_policy_trace_reports_every_option_of_each_policy(tmp_path):
    out = tmp_path / "trace.jsonl"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "bench/policy_trace.py", "--batch-sizes", "1", "--num-prompts", "2", "--output-len", "20",
           "--forced-acceptance", "wrong", "--policies", "AdaptivePolicy,ConfirmedSwitchPolicy", "--rounds", "2",
           "--json", str(out)]  # fmt: skip
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["batch_size"], r["policy"], r["forced"]) for r in rows] == [
        (1, "AdaptivePolicy", "wrong"),
        (1, "ConfirmedSwitchPolicy", "wrong"),
    ]
    for row in rows:
        options = row["options"]
        assert {"1x3x4", "plain"} <= set(options) <= {"1x7x8", "1x3x4", "plain"}
        assert sum(o["share"] for o in options.values()) == pytest.approx(1.0, abs=1e-3)
        assert all(o["timed"] > 0 and 1 <= o["longest_run"] <= row["choices"] for o in options.values())
        assert row["speedup"] > 0 and len(row["round_speedups"]) == 2 and row["plain_ms_per_token"] > 0
    assert "the best option changed" in run.stdout
