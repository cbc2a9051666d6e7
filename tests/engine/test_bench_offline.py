"""`jetserve bench offline` on the CPU: a tiny run prints one JSON line per batch size with every figure."""

from __future__ import annotations

import argparse
import json

import pytest

from jetserve.engine.bench_offline import add_offline_bench_arguments, run_offline_bench


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_offline_bench_arguments(parser)
    return parser.parse_args(argv)


def test_bench_offline_json_lines(capsys, tmp_path):
    args = parse(["--config", "tiny", "--batch-sizes", "1,3", "--input-len", "6", "--output-len", "3", "--dtype",
                  "float32", "--device", "cpu", "--json", "--plot", str(tmp_path / "plot.png")])  # fmt: skip
    assert run_offline_bench(args) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["batch_size"] for r in lines] == [1, 3]
    for r in lines:
        assert r["decode_tok_s"] > 0 and r["prefill_tok_s"] > 0 and r["copy_bandwidth_gb_s"] > 0
        assert 0 < r["decode_efficiency"] == pytest.approx(r["tpot_roofline_ms"] / r["tpot_ms"], rel=5e-2)
        assert r["decode_step_bytes"] > 0 and r["peak_memory_gib"] is None
        assert r["new_specializations"] == 0  # the interpreter compiles nothing; on a GPU, 0 once warm
    assert (tmp_path / "plot.png").stat().st_size > 0


def test_bench_offline_rejects_bad_arguments():
    with pytest.raises(ValueError, match="--batch-sizes"):
        run_offline_bench(parse(["--config", "tiny", "--batch-sizes", "1,x", "--device", "cpu"]))
    with pytest.raises(ValueError, match="--output-len"):
        run_offline_bench(parse(["--config", "tiny", "--output-len", "1", "--device", "cpu"]))
    with pytest.raises(ValueError, match="prefill_graph_max_tokens"):
        run_offline_bench(parse(["--config", "tiny", "--prefill-graph-max-tokens", "-1", "--device", "cpu"]))


@pytest.mark.parametrize("forced", ["right", "all", "wrong"])
def test_bench_offline_speculative_speedup_in_the_same_run(capsys, forced):
    args = parse(["--config", "tiny", "--batch-sizes", "2", "--input-len", "5", "--output-len", "9", "--dtype",
                  "float32", "--device", "cpu", "--json", "--draft", "random", "--forced-acceptance", forced,
                  "--no-spec-adaptive", "--spec-steps", "2"])  # fmt: skip
    assert run_offline_bench(args) == 0
    (r,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert r["plain_decode_tok_s"] > 0 and r["spec_decode_tok_s"] > 0
    assert r["spec_speedup"] == pytest.approx(r["spec_decode_tok_s"] / r["plain_decode_tok_s"], rel=1e-2)
    # end to end: every output token over the whole runs (prefill steps and part-full batches included)
    assert r["spec_e2e_tok_s"] > 0 and r["plain_e2e_tok_s"] > 0
    assert r["spec_e2e_speedup"] == pytest.approx(r["spec_e2e_tok_s"] / r["plain_e2e_tok_s"], rel=1e-2)
    assert r["spec_draft_ms"] > 0 and r["spec_verify_ms"] > 0
    # always verifying: every timed step of the speculating run verified, none decoded plainly
    assert r["spec_verify_share"] == 1.0 and r["spec_plain_step_ms"] is None
    # overlap scheduling (the default) launches verify steps ahead while no row can end by length within the next
    assert 0 < r["spec_verify_ahead_share"] < 1
    for median, longest in (r["plain_step_ms"], r["spec_verify_step_ms"]):
        assert 0 < median <= longest
    if forced in ("right", "all"):  # every draft accepted: 2 drafts + the bonus per step
        assert r["spec_tau"] == 3.0 and r["spec_acceptance_per_depth"] == [1.0, 1.0]
    else:
        assert r["spec_tau"] == 1.0 and r["spec_acceptance_per_depth"] == [0.0, 0.0]


def test_bench_offline_spec_rounds_alternate_plain_and_speculative_runs(capsys, monkeypatch):
    """Two rounds: plain, speculative, plain, speculative (after the warm-ups and the prefill run); the speed-up is
    over both rounds' tokens and seconds, each side's."""
    from jetserve.engine import bench_offline

    runs = []
    real_run = bench_offline._run

    def recording_run(engine, prompts, params, label, full_batch=0):
        result = real_run(engine, prompts, params, label, full_batch)
        runs.append((label, engine.runner.spec is not None, result))
        return result

    monkeypatch.setattr(bench_offline, "_run", recording_run)
    args = parse(["--config", "tiny", "--batch-sizes", "2", "--input-len", "5", "--output-len", "9", "--dtype",
                  "float32", "--device", "cpu", "--json", "--draft", "random", "--forced-acceptance", "right",
                  "--no-spec-adaptive", "--spec-steps", "2", "--spec-rounds", "2"])  # fmt: skip
    assert run_offline_bench(args) == 0
    (r,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    timed = [(label, speculating, result) for label, speculating, result in runs if result.decode_step_seconds]
    assert [speculating for _, speculating, _ in timed] == [False, True, False, True]
    sides = [[result for _, speculating, result in timed if speculating is side] for side in (False, True)]
    plain, spec = (sum(x.decode_tokens for x in side) / sum(sum(x.decode_step_seconds) for x in side) for side in sides)
    assert r["plain_decode_tok_s"] == pytest.approx(plain, rel=1e-3)
    assert r["spec_decode_tok_s"] == pytest.approx(spec, rel=1e-3)
    assert r["spec_tau"] == 3.0 and r["spec_verify_share"] == 1.0  # both speculative rounds, every draft accepted


def test_bench_offline_spec_rounds_need_a_draft_and_a_count():
    with pytest.raises(ValueError, match="--spec-rounds"):
        run_offline_bench(parse(["--config", "tiny", "--device", "cpu", "--spec-rounds", "2"]))
    with pytest.raises(ValueError, match="--spec-rounds"):
        run_offline_bench(parse(["--config", "tiny", "--device", "cpu", "--draft", "random", "--spec-rounds", "0"]))


@pytest.mark.parametrize("depth", [0, 1])
def test_bench_offline_forced_depth_sets_tau(capsys, depth):
    args = parse(["--config", "tiny", "--batch-sizes", "2", "--input-len", "5", "--output-len", "9", "--dtype",
                  "float32", "--device", "cpu", "--json", "--draft", "random", "--forced-acceptance", "all",
                  "--forced-depth", str(depth), "--no-spec-adaptive", "--spec-steps", "2"])  # fmt: skip
    assert run_offline_bench(args) == 0
    (r,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert r["spec_tau"] == depth + 1.0
    assert r["spec_acceptance_per_depth"] == [1.0] * depth + [0.0] * (2 - depth)


@pytest.mark.parametrize("forced", [None, "right"])
def test_bench_offline_forced_depth_needs_forced_all(forced):
    argv = ["--config", "tiny", "--device", "cpu", "--draft", "random", "--forced-depth", "1"]
    with pytest.raises(ValueError, match="--forced-depth: needs --forced-acceptance all"):
        run_offline_bench(parse(argv + (["--forced-acceptance", forced] if forced else [])))


def test_bench_offline_forced_acceptance_needs_a_draft():
    with pytest.raises(ValueError, match="--forced-acceptance"):
        run_offline_bench(parse(["--config", "tiny", "--device", "cpu", "--forced-acceptance", "right"]))


def test_bench_offline_mtbench_prompts_with_the_default_draft(capsys):
    """`--dataset mtbench`: the embedded model answers MT-bench first turns (chat template, its tokenizer) and its
    trained draft is accepted beyond chance; the prompt lengths are the questions', not --input-len."""
    from jetserve.evals.mtbench import load_questions

    args = parse(["--model", "default", "--draft", "default", "--dataset", "mtbench", "--batch-sizes", "2",
                  "--num-prompts", "3", "--output-len", "12", "--dtype", "float32", "--device", "cpu", "--json",
                  "--no-spec-adaptive"])  # fmt: skip
    assert run_offline_bench(args) == 0
    (r,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert r["spec_tau"] > 1.5 and r["spec_speedup"] > 0
    assert r["num_prompts"] == 3 and r["stops_at_eos"]
    first = load_questions()[0]["turns"][0]
    assert r["input_len"] != 1024 and r["input_len"] > len(first.split())
    # the table says what the run's requests were
    from jetserve.engine.bench_offline import BenchResult, print_table

    print_table([BenchResult(**r)])
    table = capsys.readouterr().out
    assert "requests: 3 at batch 2, at most the batch size at a time, each to its end of turn" in table
    # each row gives TPOT beyond its roofline (the step's fixed part: docs/performance.md, session 53)
    row = next(line.split() for line in table.splitlines() if line.split()[:1] == ["2"])
    assert float(row[8]) == pytest.approx(r["tpot_ms"] - r["tpot_roofline_ms"], abs=1e-3) and "(over)" in table
    for bad in (["--num-prompts", "0"], ["--dataset", "random", "--num-prompts", "4"]):
        with pytest.raises(ValueError, match="--num-prompts: needs --dataset mtbench"):
            run_offline_bench(parse(["--model", "default", "--dataset", "mtbench", "--device", "cpu", *bad]))
    with pytest.raises(ValueError, match="--input-len 8: an MT-bench prompt has"):
        run_offline_bench(parse(["--model", "default", "--dataset", "mtbench", "--input-len", "8", "--batch-sizes",
                                 "1", "--device", "cpu"]))  # fmt: skip
    with pytest.raises(ValueError, match="--dataset mtbench: needs --model"):
        run_offline_bench(parse(["--config", "tiny", "--dataset", "mtbench", "--device", "cpu"]))


def test_progress_never_counts_past_its_total(capsys):
    from jetserve.engine.bench_offline import _progress

    _progress("decode b=2", 3, 10, width=10)
    assert capsys.readouterr().err == "\rdecode b=2 [###.......] 3/10 steps"
    _progress("decode b=2", 12, 10, width=10)  # more steps than the estimate: the bar is full, the total follows
    assert capsys.readouterr().err == "\rdecode b=2 [##########] 12/12 steps"


def test_bench_runs_at_most_batch_size_requests_at_a_time_to_their_end_of_turn():
    """Prompts past the batch size wait for a finished request's place; with `stop_at_eos` each request ends at its
    end of turn (within output_len), as the model answers: the outputs equal `LLM.generate`'s, and the engine never
    held more than the batch size."""
    from jetserve.assets import DEFAULT_MODEL
    from jetserve.engine.bench_offline import _run
    from jetserve.llm import LLM
    from jetserve.sampling_params import SamplingParams

    llm = LLM(str(DEFAULT_MODEL), dtype="float32", device="cpu", max_num_seqs=8)
    engine, tok = llm.engine, llm.tokenizer
    texts = ["Hi!", "Name a colour.", "What is 2 + 2?", "Say yes.", "Count to three."]
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}])) for t in texts]
    params = SamplingParams(temperature=0, max_tokens=48)
    most = 0
    step = engine.step

    def counting_step():
        nonlocal most
        most = max(most, len(engine.scheduler.running) + len(engine.scheduler.waiting))
        return step()

    engine.step = counting_step
    run = _run(engine, prompts, params, "capped", full_batch=2)
    engine.step = step
    want = [o.output_token_ids for o in llm.generate(prompts, params)]
    assert run.outputs == want and most == 2
    assert any(len(o) < 48 for o in want), "no answer ended before max_tokens: the test does not test stopping"
    assert run.decode_step_seconds and len(run.decode_step_seconds) == len(run.step_verified)
