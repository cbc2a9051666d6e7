"""Wilson intervals, accuracy summaries, result files and the plain-text table."""

import json

import pytest

from jetserve.evals.results import accuracy, format_table, wilson_interval, write_result


@pytest.mark.parametrize(
    ("k", "n", "lo", "hi"),
    [(50, 100, 0.4038, 0.5962), (0, 10, 0.0, 0.2775), (10, 10, 0.7225, 1.0), (81, 263, 0.2553, 0.3662)],
)
def test_wilson_interval_known_values(k, n, lo, hi):
    got = wilson_interval(k, n)
    assert got == pytest.approx((lo, hi), abs=1e-4)


def test_accuracy_summary():
    assert accuracy(3, 4)["accuracy"] == 0.75 and accuracy(3, 4)["num_total"] == 4
    assert accuracy(0, 0)["accuracy"] is None and accuracy(0, 0)["ci95"] == [0.0, 1.0]


def test_write_result(tmp_path, monkeypatch):
    path = write_result({"eval": "gsm8k", "x": 1}, str(tmp_path / "a" / "r.json"))
    assert json.loads(path.read_text()) == {"eval": "gsm8k", "x": 1}
    monkeypatch.chdir(tmp_path)
    default = write_result({"eval": "mmlu"}, None)
    assert default.name.startswith("jetserve-eval-mmlu-") and default.is_file()


def test_format_table():
    text = format_table(["name", "acc"], [["gsm8k", "71.5"], ["mmlu-long-name", None]])
    assert text.splitlines() == [
        "name             acc",
        "--------------  ----",
        "gsm8k           71.5",
        "mmlu-long-name     -",
    ]
