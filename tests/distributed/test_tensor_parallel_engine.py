"""The tensor-parallel engine (rank 0 here, rank 1 spawned, gloo) == the single-process engine: greedy and seeded
sampled tokens, log-probs to 1e-5, with and without EAGLE-3 speculation; per-rank caches hold the local heads."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from jetserve.engine.config import EngineConfig
from jetserve.engine.engine import LLMEngine
from jetserve.engine.tensor_parallel import TensorParallelEngine, build_engine
from jetserve.sampling_params import SamplingParams
from jetserve.spec.eagle3 import make_draft_checkpoint

BASE = dict(dtype="float32", device="cpu", page_size=4, num_pages=256, num_slots=9, max_model_len=128)
PROMPT_LENGTHS = (1, 5, 17, 33, 9)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(0, 320, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def draft_dir(tiny_checkpoint, tmp_path_factory):
    return str(make_draft_checkpoint(tiny_checkpoint, tmp_path_factory.mktemp("draft"), seed=2, draft_vocab_size=200))


def requests(prompts) -> list[tuple[list[int], SamplingParams]]:
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    sampled = SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=12, ignore_eos=True)
    with_logprobs = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)
    return [(p, [greedy, sampled, greedy, with_logprobs, sampled][i]) for i, p in enumerate(prompts)]


def run(engine: LLMEngine, reqs) -> dict[str, tuple[list[int], list]]:
    for i, (prompt, params) in enumerate(reqs):
        engine.add_request(str(i), prompt, params)
    engine.add_request("gone", reqs[0][0], reqs[0][1])
    assert engine.abort_request("gone")
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = (list(out.output_token_ids), out.logprobs)
    assert engine.is_idle_and_clean()
    return final


def check_same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for request_id, (tokens, logprobs) in want.items():
        assert got[request_id][0] == tokens, f"request {request_id}"
        if logprobs:
            for a, b in zip(got[request_id][1], logprobs, strict=True):
                assert a.token_id == b.token_id and a.top_ids == b.top_ids
                assert abs(a.logprob - b.logprob) < 1e-5
                assert max(abs(x - y) for x, y in zip(a.top_logprobs, b.top_logprobs, strict=True)) < 1e-5


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "eagle3"])
def test_tp2_engine_equals_one_process(tiny_checkpoint, prompts, draft_dir, speculative):
    spec = dict(draft=draft_dir, spec_topk=2, spec_steps=2, spec_num_draft_tokens=5) if speculative else {}
    config = EngineConfig(model=str(tiny_checkpoint), **BASE, **spec)
    reqs = requests(prompts)
    want = run(LLMEngine(config, tokenizer=None), reqs)
    engine = build_engine(EngineConfig(model=str(tiny_checkpoint), tensor_parallel_size=2, **BASE, **spec))
    try:
        assert isinstance(engine, TensorParallelEngine) and engine.group.world_size == 2
        got = run(engine, reqs)
        if speculative:
            assert engine.num_verify_steps > 0
        # The per-rank pools hold the local heads only: 1 of 2 jet heads, 1 of 2 K/V heads.
        assert engine.state_pool.recurrent_states.shape[2] == 1
        assert engine.state_pool.conv_states.shape[-1] == engine.model.config.jet.value_dim == 32
        assert next(iter(engine.runner.kv_caches.values()))[0].shape[2] == 1
        # A second round on the same engine (state slots and pages reused, seeds drawn in the same order).
        again = run(engine, reqs)
    finally:
        engine.shutdown()
    check_same(got, want)
    check_same(again, want)
    # Shut down, the engine is garbage (nothing, such as an exit hook, keeps its caches alive).
    ref = weakref.ref(engine)
    del engine
    gc.collect()
    assert ref() is None


def test_build_engine_refusals(tiny_checkpoint):
    with pytest.raises(ValueError, match="data_parallel_size"):
        build_engine(EngineConfig(model=str(tiny_checkpoint), data_parallel_size=2, **BASE))
    with pytest.raises(ValueError, match="tensor_parallel_size: 3 does not divide num_attention_heads"):
        build_engine(EngineConfig(model=str(tiny_checkpoint), tensor_parallel_size=3, **BASE))
    with pytest.raises(ValueError, match="tensor_parallel_size: must be ≥ 1"):
        EngineConfig(tensor_parallel_size=0)


def test_llm_refuses_a_built_model_with_parallelism(tiny_checkpoint):
    from jetserve.llm import LLM
    from jetserve.model.loader import load_model

    model = load_model(tiny_checkpoint, dtype="float32")
    with pytest.raises(ValueError, match="model_instance"):
        LLM(str(tiny_checkpoint), model_instance=model, tensor_parallel_size=2, **BASE)


def test_plain_engine_refuses_parallel_configs(tiny_checkpoint):
    for field in ("tensor_parallel_size", "data_parallel_size"):
        with pytest.raises(ValueError, match="an LLMEngine is one process"):
            LLMEngine(EngineConfig(model=str(tiny_checkpoint), **{field: 2}, **BASE))


# A script without the `if __name__ == "__main__":` guard: the spawned rank 1 re-runs it, multiprocessing refuses to
# start a process from there, and rank 1 ends before it joins the process group, where rank 0 waits (for a year).
UNGUARDED = """
import sys
from jetserve.engine.config import EngineConfig
from jetserve.engine.tensor_parallel import build_engine

config = EngineConfig(model=sys.argv[1], tensor_parallel_size=2, dtype="float32", device="cpu", page_size=4,
                      num_pages=64, num_slots=3, max_model_len=64)
build_engine(config)
print("built")
"""


def test_a_rank_that_dies_stops_rank_0_with_a_message(tiny_checkpoint, tmp_path):
    """A rank's process ending while the engine runs ends rank 0 too (status 1, naming the rank) instead of leaving
    it blocked in a collective; an orderly shutdown does not trip it (every other test here)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "unguarded.py"
    script.write_text(UNGUARDED)
    root = str(Path(__file__).resolve().parents[2])  # the checkout, importable whether or not jetserve is installed
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, str(script), str(tiny_checkpoint)], capture_output=True, text=True,
                          timeout=240, env=env)  # fmt: skip
    assert proc.returncode == 1 and "built" not in proc.stdout, proc.stderr[-2000:]
    assert "tensor-parallel rank 1" in proc.stderr and "exited with status 1" in proc.stderr, proc.stderr[-2000:]


def test_tp_all_reduce_setting(monkeypatch):
    """JETSERVE_TP_ALL_REDUCE: nccl by default, one-shot on request, anything else a one-line error."""
    from jetserve import envs

    monkeypatch.delenv("JETSERVE_TP_ALL_REDUCE", raising=False)
    assert envs.tp_all_reduce() == "nccl"
    monkeypatch.setenv("JETSERVE_TP_ALL_REDUCE", "one-shot")
    assert envs.tp_all_reduce() == "one-shot"
    monkeypatch.setenv("JETSERVE_TP_ALL_REDUCE", "ring")
    with pytest.raises(ValueError, match="JETSERVE_TP_ALL_REDUCE: 'ring' is not one of nccl, one-shot"):
        envs.tp_all_reduce()
