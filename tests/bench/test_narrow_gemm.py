"""bench/narrow_gemm.py in its smoke form (the smoke shapes, the Triton interpreter): both paths of every case run,
agree within fp32 rounding, and write their JSON line with the roofline."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_narrow_gemm_smoke(tmp_path):
    out = tmp_path / "narrow.jsonl"
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    env.pop("JETSERVE_NARROW_GEMM", None)
    cmd = [sys.executable, "bench/narrow_gemm.py", "--smoke", "--json", str(out)]
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 10 and {r["case"] for r in rows} == {"o_proj", "down", "attn o", "attn q|k|v", "draft fc"}
    assert all(r["max_diff"] < 1e-4 and r["roofline_us"] > 0 and r["triton_us"] > 0 for r in rows), rows
