"""bench/tile_sweep.py in its smoke form (tiny shapes, the Triton interpreter): every case's every tiling runs, matches
the reference and writes its JSON line — so a kernel's changed signature cannot leave the sweep broken until its next
GPU call (session 25's first GPU run of the attention cases skipped every tiling on a stale plan hook)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("only", ["conv", "verify", "gemm", "attn", "delta"])
def test_tile_sweep_smoke_runs_every_tiling(only, tmp_path):
    out = tmp_path / "sweep.jsonl"
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "bench/tile_sweep.py", "--smoke", "--only", only, "--models", "2b", "--json", str(out)]
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "skipped" not in run.stdout, run.stdout[-2000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows and all(row["tiling"] for row in rows)
    # Every tiling of every case, the heuristic's pick among them, checked against the reference.
    assert all(row["max_err"] < 1e-3 for row in rows), [r for r in rows if not r["max_err"] < 1e-3][:3]
    cases = {row["case"] for row in rows}
    assert all(any(r["case"] == c and r["tiling"] == "heuristic" for r in rows) for c in cases)
