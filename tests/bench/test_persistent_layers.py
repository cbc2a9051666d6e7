"""bench/persistent_layers.py in its smoke form (the smoke shapes, fp32, the Triton interpreter): the chain's phases
launched one by one over three programs and the persistent kernel over one program both equal the PyTorch reference
(the script exits non-zero on a mismatch), and each writes its JSON line."""

import json


def test_persistent_layers_smoke_matches_the_reference(run_bench, tmp_path):
    out = tmp_path / "persistent.jsonl"
    run = run_bench("bench/persistent_layers.py", "--smoke", "--json", str(out), env={"TRITON_INTERPRET": "1"})
    assert run.returncode == 0, run.stderr[-2000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["variant"], r["programs"]) for r in rows] == [("launched, 3 programs", 3), ("persistent, 1 program", 1)]
    assert all(r["max_rel_diff"] < 1e-4 for r in rows), rows
