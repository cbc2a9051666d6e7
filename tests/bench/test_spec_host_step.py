"""bench/spec_host_step.py on the CPU: a few verify steps of the default pair with the device work stubbed, and a few
plain steps, give positive host times; every timed step verified (the script asserts it) and the stubs' own cost is
taken off."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_spec_host_step_reports_verify_and_plain_host_time(tmp_path):
    out = tmp_path / "host.jsonl"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "bench/spec_host_step.py", "--batch-sizes", "1,2", "--steps", "20", "--json", str(out)]
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["batch_size"] for r in rows] == [1, 2]
    for r in rows:
        assert r["verify_host_ms"] > 0 and r["plain_host_ms"] > 0 and r["stubs_ms"] > 0
        assert r["accepted_drafts"] == 2
    assert "verify host ms/step" in run.stdout
