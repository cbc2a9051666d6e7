"""Each eval through `jetserve eval ...`: against a scripted server (known answers, so the numbers are checked exactly)
and against a real `jetserve serve` on a random tiny checkpoint (the JSON has every field; the protocol matches).
"""

import json
import math
import re

import pytest
from scripted_server import FAKE_DRAFTS, FAKE_MODEL, FAKE_TOKENS

from jetserve.cli import main


def _run(capsys, *args):
    assert main(["eval", *args]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "wrote " in out
    return out


def test_gsm8k_scripted(fake_server, tmp_path, capsys):
    url, state = fake_server
    out_file = tmp_path / "g.json"
    table = _run(capsys, "gsm8k", "--base-url", f"{url}/v1", "--limit", "2", "--num-shots", "2", "--parallel", "2",
                 "--out", str(out_file))  # fmt: skip
    result = json.loads(out_file.read_text())
    assert result["eval"] == "gsm8k" and result["model"] == FAKE_MODEL and result["label"] == "speculative"
    m = result["metrics"]
    # The scripted answer is right for test row 0 (18 dollars) only.
    for name in ("flexible", "strict"):
        assert (m[name]["accuracy"], m[name]["num_correct"], m[name]["num_total"]) == (0.5, 1, 2)
        assert m[name]["invalid_rate"] == 0.0 and len(m[name]["ci95"]) == 2
    assert m["output_tokens"] == 2 * FAKE_TOKENS and m["output_tokens_per_s"] > 0 and m["num_truncated"] == 0
    assert m["speculation"]["tau"] == pytest.approx(2.0)
    assert m["speculation"]["acceptance_rate"] == pytest.approx(1 / FAKE_DRAFTS)
    assert [s["reference"] for s in result["samples"]] == ["18", "3"]
    path, body = state.requests[0]
    assert path == "/v1/completions" and body["temperature"] == 0.0 and body["max_tokens"] == 256
    assert body["stop"] == ["Question:", "</s>", "<|im_end|>"] and body["prompt"].count("Question: ") == 3
    assert "gsm8k flexible" in table and "τ: 2.00" in table


@pytest.mark.parametrize("mode", ["logprob", "generate"])
def test_mmlu_scripted(fake_server, tmp_path, capsys, mode):
    url, state = fake_server
    out_file = tmp_path / "m.json"
    table = _run(capsys, "mmlu", "--base-url", url, "--subjects", "abstract_algebra", "anatomy", "--limit", "2",
                 "--mode", mode, "--out", str(out_file))  # fmt: skip
    result = json.loads(out_file.read_text())
    m = result["metrics"]
    # The scripted server always prefers B; abstract_algebra's first two answers are B, C; anatomy's A, D... so 1 of 4.
    assert [s["reference"] for s in result["samples"]][:2] == ["B", "C"]
    assert all(s["predicted"] == "B" for s in result["samples"])
    expected = sum(s["reference"] == "B" for s in result["samples"])
    assert m["overall"]["num_correct"] == expected and m["overall"]["num_total"] == 4
    assert set(m["per_subject"]) == {"abstract_algebra", "anatomy"} and m["invalid_rate"] == 0.0
    assert "OVERALL (micro)" in table
    path, body = state.requests[0]
    if mode == "logprob":
        assert body["echo"] is True and body["max_tokens"] == 0 and len(body["prompt"]) == 4
        assert [p[-2:] for p in body["prompt"]] == [" A", " B", " C", " D"]
        assert result["samples"][0]["scores"] == [-2.0, -0.5, -1.0, -3.0]
        assert result["label"] == "standard" and m["speculation"]["tau"] is None
    else:
        assert body["stop"] == ["\n"] and body["prompt"].endswith("\nAnswer:") and body["max_tokens"] == 8


def test_mtbench_scripted(fake_server, tmp_path, capsys):
    url, state = fake_server
    out_file = tmp_path / "t.json"
    table = _run(capsys, "mtbench", "--base-url", url, "--limit", "2", "--label", "EAGLE-3", "--out", str(out_file))
    result = json.loads(out_file.read_text())
    m = result["metrics"]
    assert result["label"] == "EAGLE-3" and m["num_questions"] == 2 and m["num_requests"] == 4
    assert m["output_tokens"] == 4 * FAKE_TOKENS and m["num_truncated"] == 4
    assert m["speculation"]["tau"] == pytest.approx(2.0)
    assert m["mean_tpot_ms"] > 0 and m["median_tpot_ms"] > 0 and m["mean_ttft_ms"] > 0 and m["output_tokens_per_s"] > 0
    turn1, turn2 = result["samples"][0]["turns"]
    assert turn1["text"] == "".join(f"t1w{i} " for i in range(FAKE_TOKENS))
    # Turn two carries the question, the model's own first answer, then the follow-up.
    second = [body for path, body in state.requests if path == "/v1/chat/completions"][1]
    assert [m["role"] for m in second["messages"]] == ["user", "assistant", "user"]
    assert second["messages"][1]["content"] == turn1["text"] and second["temperature"] == 0.0
    assert re.search(r"τ \(mean acceptance length\) +2\.00\n", table)


def test_bad_model_is_one_line(fake_server, capsys):
    url, _ = fake_server
    assert main(["eval", "gsm8k", "--base-url", url, "--model", "nope", "--limit", "1"]) == 2
    err = capsys.readouterr().err
    assert "HTTP 400" in err and "unknown model" in err and len(err.strip().splitlines()) == 1


def test_unreachable_server_is_one_line(capsys):
    assert main(["eval", "mtbench", "--base-url", "http://127.0.0.1:9", "--limit", "1"]) == 2
    assert "ConnectError" in capsys.readouterr().err


# The real server on a random tiny checkpoint: answers are noise, so these check the fields and the protocol.


def test_gsm8k_real_server(tiny_server, tmp_path, capsys):
    out_file = tmp_path / "g.json"
    _run(capsys, "gsm8k", "--base-url", tiny_server, "--limit", "3", "--num-shots", "1", "--max-tokens", "12",
         "--parallel", "3", "--out", str(out_file))  # fmt: skip
    result = json.loads(out_file.read_text())
    assert result["model"] == "tiny" and result["label"] == "standard"
    m = result["metrics"]
    assert m["flexible"]["num_total"] == m["strict"]["num_total"] == m["num_questions"] == 3
    assert 0 <= m["flexible"]["invalid_rate"] <= 1 and m["strict"]["invalid_rate"] <= 1
    assert 3 <= m["output_tokens"] <= 36 and m["output_tokens_per_s"] > 0 and m["prompt_tokens"] > 3 * 300
    assert m["speculation"]["tau"] is None and m["speculation"]["reason"]
    assert all(s["finish_reason"] in ("stop", "length") for s in result["samples"])


@pytest.mark.parametrize("mode", ["logprob", "generate"])
def test_mmlu_real_server(tiny_server, tiny_checkpoint, tmp_path, capsys, mode):
    out_file = tmp_path / "m.json"
    _run(capsys, "mmlu", "--base-url", tiny_server, "--subjects", "abstract_algebra", "--limit", "2", "--num-shots",
         "1", "--mode", mode, "--max-tokens", "4", "--out", str(out_file))  # fmt: skip
    result = json.loads(out_file.read_text())
    m = result["metrics"]
    assert m["overall"]["num_total"] == 2 and set(m["per_subject"]) == {"abstract_algebra"}
    if mode == "logprob":
        for sample in result["samples"]:
            # Byte-level tokenizer: each choice differs in its last token only, one log-prob each, all distinct.
            assert len(sample["scores"]) == 4 and all(math.isfinite(x) and x < 0 for x in sample["scores"])
            assert sample["predicted"] in "ABCD" and math.fsum(math.exp(x) for x in sample["scores"]) < 1 + 1e-4
        # The scores are the model's own next-token log-probs of A..D after "Answer: " (one unbatched forward here).
        for sample, expected in zip(result["samples"], _letter_logprobs(tiny_checkpoint, 1, 2), strict=True):
            assert sample["scores"] == pytest.approx(expected, abs=1e-4)


def _letter_logprobs(checkpoint, num_shots, limit):
    """log P(letter | prompt + " ") for A..D of abstract_algebra's first `limit` test rows, without the server."""
    import torch

    from jetserve.evals import mmlu
    from jetserve.model.loader import load_model
    from jetserve.model.static_cache import StaticCache
    from jetserve.tokenizer import Tokenizer

    model, tokenizer = load_model(checkpoint), Tokenizer(checkpoint)
    letters = [tokenizer.encode(x) for x in mmlu.LETTERS]
    assert all(len(ids) == 1 for ids in letters)
    shots = mmlu.load_split("abstract_algebra", "dev")[:num_shots]
    out = []
    for row in mmlu.load_split("abstract_algebra", "test")[:limit]:
        ids = tokenizer.encode(mmlu.build_prompt("abstract_algebra", row, shots) + " ")
        with torch.no_grad():
            hidden = model(StaticCache(model, num_seqs=1, max_tokens=len(ids)).batch([0], [ids]))  # [T, hidden]
            logprobs = torch.log_softmax(model.compute_logits(hidden[-1:]).float(), dim=-1)[0]  # [vocab]
        out.append([float(logprobs[ids[0]]) for ids in letters])
    return out


def test_mtbench_real_server_and_compare(tiny_server, tmp_path, capsys):
    out_file = tmp_path / "t.json"
    _run(capsys, "mtbench", "--base-url", tiny_server, "--limit", "1", "--max-tokens", "6", "--out", str(out_file))
    result = json.loads(out_file.read_text())
    m = result["metrics"]
    assert m["num_requests"] == 2 and 2 <= m["output_tokens"] <= 12 and m["mean_ttft_ms"] > 0
    assert m["speculation"]["tau"] is None
    assert len(result["samples"][0]["turns"]) == 2
    assert main(["eval", "compare", str(out_file)]) == 0
    assert "tiny" in capsys.readouterr().out
