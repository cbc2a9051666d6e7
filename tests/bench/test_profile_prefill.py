"""bench/profile_prefill.py on the CPU (the embedded default model, reference ops): a row per prompt length beside
its roofline, the profiled step's parts (every layer's mixer and MLP), one JSON line per result; bad lengths are a
one-line error."""

import json


def test_rows_parts_and_json(tmp_path, run_bench):
    out = tmp_path / "prefill.jsonl"
    run = run_bench("bench/profile_prefill.py", "--lengths", "5,3", "--repeats", "1", "--profile-len", "4",
                    "--top", "2", "--json", str(out))  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    lengths = [r for r in rows if r["kind"] == "length"]
    assert [r["tokens"] for r in lengths] == [5, 3]
    for r in lengths:
        assert r["first_ms"] > 0 and r["warm_median_ms"] >= r["warm_min_ms"] > 0 and r["roofline_ms"] > 0
    (profiled,) = [r for r in rows if r["kind"] == "profile"]
    parts = profiled["parts_ms"]
    assert profiled["tokens"] == 4 and profiled["step_ms"] > 0
    for i in range(8):  # the default model's eight layers: a mixer and an MLP each
        assert any(name.startswith(f"layer {i} ") and name.endswith("mixer") for name in parts), parts
        assert f"layer {i} mlp" in parts
    assert "roofline ms" in run.stdout


def test_bad_lengths_are_a_one_line_error(run_bench):
    run = run_bench("bench/profile_prefill.py", "--lengths", "4,0")
    assert run.returncode == 2 and "--lengths" in run.stderr.strip().splitlines()[-1]
    run = run_bench("bench/profile_prefill.py", "--prefill-graph-max-tokens", "-1")
    assert run.returncode == 2 and "--prefill-graph-max-tokens" in run.stderr.strip().splitlines()[-1]
