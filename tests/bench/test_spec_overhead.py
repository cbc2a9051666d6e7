"""bench/spec_overhead.py on the CPU (the embedded default pair, reference ops): a row with the speed-up, its median
wave and interval, and one JSON line; with every draft wrong the speculating engine's tokens are plain decoding's;
bad counts are a one-line error."""

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def load_bench(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_row_and_a_json_line(tmp_path, run_bench):
    out = tmp_path / "overhead.jsonl"
    run = run_bench("bench/spec_overhead.py", "--waves", "2", "--output-len", "3", "--json", str(out))
    assert run.returncode == 0, run.stderr[-2000:]
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["waves"] == 2 and row["requests"] == 2 and row["forced_acceptance"] == "wrong"
    assert row["plain_s"] > 0 and row["spec_s"] > 0
    assert row["speedup"] == row["plain_s"] / row["spec_s"]
    low, high = row["speedup_ci95"]
    assert low <= high and row["speedup_median_wave"] > 0
    assert row["requests_equal_to_plain"] == 2  # fp32 on the CPU: exact whatever the drafts
    assert "95% interval" in run.stdout and "shadow drafts" in run.stdout and row["shadow_drafts"] >= 0
    assert "first guesses right / scored" in run.stdout and len(row["first_guesses_right_scored"]) == 2
    first, later = row["first_step_median_s"], row["later_step_median_s"]
    assert set(first) == set(later) == {"plain", "spec"} and all(v > 0 for v in [*first.values(), *later.values()])
    assert max(first.values()) < row["plain_s"] + row["spec_s"] and "a wave's first step" in run.stdout
    kinds = row["steps_by_kind"]
    assert set(kinds) == {"plain", "spec"} and "engine calls by kind" in run.stdout
    assert kinds["plain"]["prefill"][0] == 2 and kinds["plain"]["verify"][0] == kinds["plain"]["shadow"][0] == 0
    assert sum(n for n, _ in kinds["spec"].values()) >= 2 * 3  # a prefill and two decode calls a wave at least
    assert kinds["spec"]["verify"][0] <= row["verify_steps"]
    assert abs(sum(t for n, t in kinds["plain"].values()) - row["plain_s"]) < 1e-6


def test_a_step_kind_is_what_its_counters_moved():
    overhead = load_bench("spec_overhead")
    stats = overhead.SpecStats(num_verify_steps=3, num_shadow_steps=1, num_catch_ups=5, num_shadow_drafts=7,
                               num_first_guesses=9)  # fmt: skip
    assert overhead.spec_counters(stats) == (3, 1, 5, 7, 9)
    assert overhead.step_kind(stats, (3, 1, 5, 7, 9), first_token=False) == "plain"
    assert overhead.step_kind(stats, (2, 1, 4, 7, 9), first_token=False) == "verify"  # a verify step catches up too
    assert overhead.step_kind(stats, (3, 0, 4, 7, 9), first_token=False) == "shadow"
    assert overhead.step_kind(stats, (3, 1, 4, 7, 9), first_token=False) == "catch-up"
    assert overhead.step_kind(stats, (2, 1, 5, 7, 9), first_token=True) == "prefill"
    assert overhead.step_kind(stats, (3, 1, 5, 6, 9), first_token=False) == "plain scoring"
    assert overhead.step_kind(stats, (3, 1, 5, 7, 8), first_token=False) == "plain scoring"
    assert overhead.step_kind(stats, (3, 1, 5, 7, 8), first_token=False, after_other=True) == "plain after"
    assert overhead.step_kind(stats, (3, 0, 5, 7, 8), first_token=False, after_other=True) == "shadow"


def test_call_quantiles_split_the_typical_call_from_the_tail():
    overhead = load_bench("spec_overhead")
    q = overhead.call_quantiles([1.0] * 98 + [50.0, 100.0])
    assert (q["p50"], q["p90"]) == (1.0, 1.0) and q["p99"] == 100.0 and q["mean"] == 2.48
    assert overhead.call_quantiles([]) == {"p50": 0.0, "p90": 0.0, "p99": 0.0, "mean": 0.0}


def test_bad_counts_are_a_one_line_error(run_bench):
    run = run_bench("bench/spec_overhead.py", "--waves", "0")
    assert run.returncode == 2 and "--waves" in run.stderr.strip().splitlines()[-1]


def test_bootstrap_interval_brackets_the_ratio():
    overhead = load_bench("spec_overhead")
    plain, spec = [1.0, 1.1, 0.9, 1.2], [1.1, 1.0, 1.0, 1.3]
    low, high = overhead.bootstrap_interval(plain, spec)
    assert low <= sum(plain) / sum(spec) <= high
    assert overhead.bootstrap_interval([1.0] * 5, [2.0] * 5) == (0.5, 0.5)


def test_the_draft_kept_run_never_verifies(tmp_path, run_bench):
    out = tmp_path / "overhead.jsonl"
    run = run_bench("bench/spec_overhead.py", "--waves", "2", "--output-len", "3", "--draft-kept", "--json", str(out))
    assert run.returncode == 0, run.stderr[-2000:]
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["kept_s"] > 0 and row["kept_speedup"] == row["plain_s"] / row["kept_s"]
    low, high = row["kept_speedup_ci95"]
    assert low <= row["kept_speedup"] <= high
    assert row["kept_verify_steps"] == 0
    assert [len(row["wave_seconds"][mode]) for mode in ("plain", "spec", "kept")] == [2, 2, 2]
    assert sum(row["wave_verify_steps"]) == row["verify_steps"]
    assert "draft kept" in run.stdout and "speculating" in run.stdout


def test_a_candidate_policy_runs_in_the_same_waves(tmp_path, run_bench):
    out = tmp_path / "overhead.jsonl"
    run = run_bench("bench/spec_overhead.py", "--waves", "2", "--output-len", "3", "--candidate",
                    "FreshExplorationPolicy", "--json", str(out))  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["candidate"] == "FreshExplorationPolicy" and "kept_s" not in row
    assert row["cand_speedup"] == row["plain_s"] / row["cand_s"] and row["cand_verify_steps"] > 0
    assert len(row["wave_seconds"]["cand"]) == 2 and "candidate" in run.stdout
    assert row["cand_requests_equal_to_plain"] == 2  # fp32 on the CPU: exact whatever the drafts
