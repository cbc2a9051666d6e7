"""bench/spec_graphs.py on the CPU (eager calls of the bodies its graphs capture; a smoke test): one JSON line per
shape's draft, verify and draft + verify, each with a time and a roofline whose bytes add up (the draft's levels and
the verify's target, draft layer and fc make the pair's), one per catch-up (one position a row, a whole row), and a
one-line error for bad batch sizes."""

import json


def test_spec_graphs_writes_a_line_per_graph(tmp_path, run_bench):
    out = tmp_path / "graphs.jsonl"
    run = run_bench(
        "bench/spec_graphs.py", "--batch-sizes", "1", "--reps", "1", "--rounds", "1", "--steps", "3", "--json", str(out)
    )
    assert run.returncode == 0, run.stderr[-2000:]
    rows = {r["graph"]: r for r in map(json.loads, out.read_text().splitlines())}
    catch_ups = {"catch-up 1 of 128", "catch-up 128 of 128"}  # no graphs on the CPU: the ring's width only
    shapes = {f"chain {n} {part}" for n in (7, 3) for part in ("draft", "verify", "draft + verify")}
    assert set(rows) == shapes | catch_ups
    assert all(rows[c]["us"] > 0 and rows[c]["bytes"] == rows["catch-up 1 of 128"]["bytes"] > 0 for c in catch_ups)
    for n in (7, 3):
        draft, verify, both = (rows[f"chain {n} {part}"] for part in ("draft", "verify", "draft + verify"))
        # (no order of the times: one eager rep each on a shared CPU, session 48 saw the draft timed above the pair)
        assert min(draft["us"], verify["us"], both["us"]) > 0 and draft["roofline_us"] > 0
        assert both["bytes"] == draft["bytes"] + verify["bytes"]
    assert rows["chain 7 draft"]["bytes"] > rows["chain 3 draft"]["bytes"]  # more levels, more lm_head reads
    assert rows["chain 7 verify"]["bytes"] == rows["chain 3 verify"]["bytes"]  # the same target and catch-up
    assert "chain 7 draft" in run.stdout and "roofline" in run.stdout


def test_spec_graphs_refuses_bad_batch_sizes(run_bench):
    run = run_bench("bench/spec_graphs.py", "--batch-sizes", "1,x")
    assert run.returncode == 2 and "--batch-sizes '1,x'" in run.stderr.strip().splitlines()[-1]
