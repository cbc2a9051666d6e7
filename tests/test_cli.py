"""The `jetserve` command as a user runs it: make-checkpoint, generate --json, one-line errors."""

import json
import subprocess
import sys

import pytest

from jetserve.cli import main


def _run(*args):
    return subprocess.run([sys.executable, "-m", "jetserve.cli", *args], capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "tiny"
    result = _run("make-checkpoint", "--config", "tiny", "--seed", "3", "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert {p.name for p in out.iterdir()} >= {"config.json", "model.safetensors", "tokenizer.json",
                                              "tokenizer_config.json", "generation_config.json"}  # fmt: skip
    return out


def test_generate_json_greedy_is_deterministic(checkpoint):
    args = ("generate", "--model", str(checkpoint), "--prompt", "Once upon a time", "--max-tokens", "12", "--json")
    first, second = _run(*args), _run(*args)
    assert first.returncode == 0, first.stderr
    a, b = json.loads(first.stdout), json.loads(second.stdout)
    assert a["token_ids"] == b["token_ids"] and a["text"] == b["text"]
    assert set(a) >= {"text", "token_ids", "num_prompt_tokens", "num_generated_tokens", "seconds", "tokens_per_second"}
    assert a["num_prompt_tokens"] == len("Once upon a time")  # byte-level tokenizer: a token a byte
    assert 1 <= a["num_generated_tokens"] == len(a["token_ids"]) <= 12


def test_generate_seeded_sampling_and_chat(checkpoint, capsys):
    args = ["generate", "--model", str(checkpoint), "--prompt", "hi", "--max-tokens", "8", "--temperature", "1.0",
            "--seed", "7", "--chat", "--json"]  # fmt: skip
    assert main(args) == 0
    first = json.loads(capsys.readouterr().out)
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == first["token_ids"]
    # "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n": three special tokens plus a token per byte.
    assert first["num_prompt_tokens"] == 3 + len("user\nhi") + len("\n") + len("assistant\n")


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--temperature", "-1"], "temperature"),
        (["--top-p", "0"], "top_p"),
        (["--top-p", "1.5"], "top_p"),
        (["--top-k", "-2"], "top_k"),
        (["--max-model-len", "1"], "max_model_len"),
        (["--cuda-graph-batch-sizes", "0,4"], "cuda_graph_batch_sizes"),
        (["--cuda-graph-batch-sizes", "1,x"], "cuda_graph_batch_sizes"),
        (["--cuda-graph-batch-sizes", "1,300"], "max_num_seqs"),
        (["--cuda-graph-batch-sizes", "1,8", "--cuda-graph-max-batch-size", "8"], "give one of them"),
    ],
)
def test_bad_arguments_give_one_line(checkpoint, capsys, extra, message):
    assert main(["generate", "--model", str(checkpoint), "--prompt", "x", *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_missing_model_and_empty_prompt(tmp_path, checkpoint, capsys):
    assert main(["generate", "--model", str(tmp_path), "--prompt", "x"]) == 2
    assert "no config.json" in capsys.readouterr().err
    assert main(["generate", "--model", str(checkpoint), "--prompt", ""]) == 2
    assert "prompt" in capsys.readouterr().err


def test_make_checkpoint_bad_config(capsys, tmp_path):
    assert main(["make-checkpoint", "--config", "huge", "--out", str(tmp_path)]) == 2
    assert "--config" in capsys.readouterr().err
    bad_json = tmp_path / "config.json"
    bad_json.write_text("{not json")
    assert main(["make-checkpoint", "--config", str(bad_json), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "--config" in err and "not valid JSON" in err and err.count("\n") == 1


def test_make_checkpoint_out_is_a_file(capsys, tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    assert main(["make-checkpoint", "--config", "tiny", "--out", str(a_file)]) == 2
    err = capsys.readouterr().err
    assert "--out" in err and err.count("\n") == 1


def test_make_checkpoint_draft_for(checkpoint, tmp_path):
    from jetserve.model.loader import load_model
    from jetserve.spec.eagle3 import load_draft_model

    out = tmp_path / "draft"
    assert main(["make-checkpoint", "--draft-for", str(checkpoint), "--out", str(out), "--draft-vocab-size", "64"]) == 0
    draft = load_draft_model(out, load_model(checkpoint, dtype="float32"))
    assert draft.config.draft_vocab_size == 64
