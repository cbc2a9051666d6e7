"""`jetserve eval compare`: grouping into the seed-style table, flags beyond the interval, notes, the CLI."""

import json

import pytest

from jetserve.cli import main
from jetserve.evals.compare import compare, difference, format_comparison, load_results
from jetserve.evals.results import accuracy


def _gsm8k(label, correct, n, texts=None):
    samples = [{"index": i, "text": t} for i, t in enumerate(texts or [])]
    return {"eval": "gsm8k", "model": "jet-2b", "label": label, "config": {"num_shots": 8, "parallel": 64},
            "metrics": {"flexible": accuracy(correct, n), "strict": accuracy(correct - 10, n)},
            "samples": samples}  # fmt: skip


def _mmlu(label, correct, n):
    return {"eval": "mmlu", "model": "jet-2b", "label": label, "config": {"num_shots": 5},
            "metrics": {"overall": accuracy(correct, n)}, "samples": []}  # fmt: skip


def _mmmu(label, correct, n, predicted=()):
    samples = [{"id": f"q{i}", "predicted": p} for i, p in enumerate(predicted)]
    return {"eval": "mmmu", "model": "jet-2b-vlm", "label": label, "config": {"split": "validation"},
            "metrics": {"overall": accuracy(correct, n)}, "samples": samples}  # fmt: skip


def _mtbench(label, tau, tps):
    return {"eval": "mtbench", "model": "jet-2b", "label": label, "config": {},
            "metrics": {"speculation": {"tau": tau}, "output_tokens_per_s": tps}}  # fmt: skip


def test_difference_interval():
    delta, half = difference((0.5, 100), (0.6, 100))
    assert delta == pytest.approx(0.1) and half == pytest.approx(1.959964 * (0.25 / 100 + 0.24 / 100) ** 0.5)


def test_rows_and_flags():
    results = [
        _gsm8k("standard", 760, 1000, ["a", "b", "c"]), _mmlu("standard", 6000, 10000), _mtbench("standard", None, 80),
        _gsm8k("EAGLE-3", 755, 1000, ["a", "x", "c"]), _mmlu("EAGLE-3", 5500, 10000), _mtbench("EAGLE-3", 3.21, 190.5),
    ]  # fmt: skip
    for r in results:
        r["path"] = f"{r['eval']}-{r['label']}.json"
    comparison = compare(results)
    base, spec = comparison["rows"]
    assert (base["label"], spec["label"]) == ("standard", "EAGLE-3")
    # GSM8K: -0.5 points is well inside ±3.7; MMLU: -5 points is far outside ±1.4.
    assert not spec["gsm8k:flexible"]["flag"] and spec["mmlu"]["flag"] and comparison["flagged"]
    assert spec["tau"] == 3.21 and base["tau"] is None
    text = format_comparison(comparison)
    lines = text.splitlines()
    assert lines[0].split() == ["model", "inference", "GSM8K", "%", "GSM8K", "strict", "%", "MMLU", "%", "MMMU", "%",
                                "τ", "MT-bench", "tok/s"]  # fmt: skip
    assert lines[2].split() == ["jet-2b", "standard", "76.0", "75.0", "60.0", "-", "-", "80.0"]
    assert lines[3].split() == ["jet-2b", "EAGLE-3", "75.5", "74.5", "55.0*", "-", "3.21", "190.5"]
    assert "mmlu EAGLE-3 vs standard: -5.0 points, beyond the 95% interval of the difference (±1.4)" in text
    assert "gsm8k EAGLE-3 vs standard: 1 of 3 answers differ" in text


def test_mmmu_column_and_changed_answers():
    base = _mmmu("standard", 371, 900, ["A", "B", ["1", "2"]]) | {"path": "a"}
    spec = _mmmu("EAGLE-3", 371, 900, ["A", "C", ["1", "2"]]) | {"path": "b"}
    comparison = compare([base, spec])
    assert comparison["rows"][1]["mmmu"] == {"accuracy": 371 / 900, "num": 900, "flag": False, "delta": 0.0,
                                             "ci95_half_width": pytest.approx(0.04548, abs=1e-4)}  # fmt: skip
    text = format_comparison(comparison)
    assert text.splitlines()[2].split()[5] == "41.2"
    assert "mmmu EAGLE-3 vs standard: 1 of 3 answers differ" in text


def test_no_flag_without_a_difference():
    comparison = compare([_gsm8k("a", 700, 1000) | {"path": "a"}, _gsm8k("b", 700, 1000) | {"path": "b"}])
    assert not comparison["flagged"] and "*" not in format_comparison(comparison)


def test_config_difference_and_duplicates():
    a, b = _gsm8k("a", 70, 100) | {"path": "a"}, _gsm8k("b", 70, 100) | {"path": "b"}
    b["config"] = {"num_shots": 5, "parallel": 1}
    assert "configs differ: num_shots 8 vs 5" in format_comparison(compare([a, b]))
    with pytest.raises(ValueError, match="two gsm8k results"):
        compare([a, a | {"path": "c"}])


def test_cli(tmp_path, capsys):
    paths = []
    for r in (_gsm8k("standard", 700, 1000), _gsm8k("EAGLE-3", 600, 1000)):
        paths.append(tmp_path / f"{r['label']}.json")
        paths[-1].write_text(json.dumps(r))
    assert main(["eval", "compare", *map(str, paths), "--out", str(tmp_path / "c.json")]) == 0
    assert "60.0*" in capsys.readouterr().out
    assert json.loads((tmp_path / "c.json").read_text())["flagged"] is True
    assert main(["eval", "compare", *map(str, paths), "--fail-on-flag"]) == 1
    (tmp_path / "bad.json").write_text("{}")
    assert main(["eval", "compare", str(tmp_path / "bad.json")]) == 2
    assert "not a jetserve eval result" in capsys.readouterr().err
    with pytest.raises(FileNotFoundError):
        load_results([str(tmp_path / "missing.json")])
