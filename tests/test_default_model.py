"""The embedded default model and its EAGLE-3 draft (jetserve/assets): they load, generate English on the CPU, the
draft changes no greedy token, and `--model default` / `--draft default` name them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from jetserve.assets import DEFAULT_DRAFT, DEFAULT_MODEL, resolve_checkpoint
from jetserve.config import ModelConfig
from jetserve.llm import LLM
from jetserve.model.loader import load_model
from jetserve.sampling_params import SamplingParams
from jetserve.spec.eagle3 import load_draft_model

PROMPTS = ["Give one tip about birds.", "Write a sentence about the sea.", "Describe a rainy day."]
ARGS = dict(dtype="float32", device="cpu", max_model_len=512, num_pages=96, num_slots=4)


@pytest.fixture(scope="module")
def chats() -> list[list[int]]:
    llm = LLM(str(DEFAULT_MODEL), **ARGS)
    tok = llm.tokenizer
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}])) for p in PROMPTS]


def test_the_shipped_files_are_small_and_complete():
    sizes = sum(f.stat().st_size for d in (DEFAULT_MODEL, DEFAULT_DRAFT) for f in d.iterdir())
    assert sizes <= 40 * 10**6
    config = ModelConfig.from_hf(DEFAULT_MODEL)
    assert set(config.layer_types) == {"jet", "attn", "swa"}
    assert (DEFAULT_MODEL / "tokenizer.json").is_file() and (DEFAULT_MODEL / "README.md").is_file()
    assert resolve_checkpoint("default", "model") == str(DEFAULT_MODEL)
    assert resolve_checkpoint("default", "draft") == str(DEFAULT_DRAFT)
    assert resolve_checkpoint("some/dir", "model") == "some/dir"


def test_default_model_answers_in_english(chats):
    llm = LLM(str(DEFAULT_MODEL), **ARGS)
    outs = llm.generate(chats, SamplingParams(temperature=0, max_tokens=40))
    for out in outs:
        words = out.text.split()
        assert len(words) >= 3, out.text
        # Fluent English is mostly dictionary-shaped words: letters with light punctuation.
        wordlike = [w for w in words if w.strip(".,;:!?\"'()").isalpha()]
        assert len(wordlike) >= 0.7 * len(words), out.text


@pytest.mark.parametrize("shape", [{}, {"spec_topk": 2, "spec_steps": 3, "spec_num_draft_tokens": 6}],
                         ids=["chain", "tree"])  # fmt: skip
def test_greedy_with_the_draft_equals_greedy_without(chats, shape):
    params = SamplingParams(temperature=0, max_tokens=48)
    plain = LLM(str(DEFAULT_MODEL), **ARGS).generate(chats, params)
    spec_llm = LLM(str(DEFAULT_MODEL), draft=str(DEFAULT_DRAFT), spec_adaptive=False, **shape, **ARGS)
    spec = spec_llm.generate(chats, params)
    assert [o.output_token_ids for o in spec] == [o.output_token_ids for o in plain]
    stats = spec_llm.engine.spec_stats
    assert stats.num_accepted_tokens > 0  # a trained draft is right some of the time


def test_the_draft_loads_through_the_eagle3_loader():
    target = load_model(DEFAULT_MODEL, dtype="float32")
    draft = load_draft_model(DEFAULT_DRAFT, target)
    assert draft.config.draft_vocab_size < target.config.vocab_size


def test_cli_generate_uses_the_default_model():
    cmd = [sys.executable, "-m", "jetserve.cli", "generate", "--prompt", "Name a colour.", "--chat",
           "--max-tokens", "8", "--json", "--dtype", "float32"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=os.environ | {"OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["num_generated_tokens"] >= 1 and result["text"]
