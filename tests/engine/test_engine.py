"""The engine end to end on the CPU (reference ops, tiny fp32 checkpoint): batching, chunking and preemption never
change a request's tokens; stops, log-probs, streaming and aborts behave; no page or slot leaks."""

from __future__ import annotations

import pickle

import pytest
import torch

from jetserve.generate import generate_tokens
from jetserve.llm import LLM
from jetserve.model.static_cache import StaticCache
from jetserve.sampling_params import SamplingParams

MAX_TOKENS = 10
# Lengths cross the page size (4), the SWA window (16) and one prompt is a single token.
PROMPT_LENGTHS = (1, 5, 17, 33)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def greedy_alone(tiny_model, prompts) -> list[list[int]]:
    """Each prompt on its own through the unbatched StaticCache path (independent of the engine's code)."""
    return [generate_tokens(tiny_model, p, MAX_TOKENS).token_ids for p in prompts]


def make_llm(tiny_checkpoint, tiny_model, tiny_tokenizer, **engine_args) -> LLM:
    args = dict(device="cpu", page_size=4, num_pages=256, num_slots=9, max_model_len=128) | engine_args
    return LLM(str(tiny_checkpoint), model_instance=tiny_model, tokenizer=tiny_tokenizer, **args)


def greedy(max_tokens: int = MAX_TOKENS, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def test_batched_greedy_equals_each_prompt_alone(tiny_checkpoint, tiny_model, tiny_tokenizer, prompts, greedy_alone):
    llm = make_llm(tiny_checkpoint, tiny_model, tiny_tokenizer)
    outs = llm.generate(prompts, greedy())
    assert [o.output_token_ids for o in outs] == greedy_alone
    assert all(o.finished and o.finish_reason == "length" for o in outs)
    assert llm.engine.is_idle_and_clean()


def test_max_model_len_below_the_swa_window(tiny_checkpoint, tiny_model, tiny_tokenizer, prompts):
    """max_model_len 12 < the window (16): the ring holds whole sequences, so the window never cuts and the engine
    must still run (the ring shorter than the window, which the attention op refuses for a ring that wraps)."""
    short = [p[:6] for p in prompts]
    want = [generate_tokens(tiny_model, p, 6).token_ids for p in short]
    llm = make_llm(tiny_checkpoint, tiny_model, tiny_tokenizer, max_model_len=12)
    assert llm.engine.plan.ring_tokens < tiny_model.config.swa_window_size
    outs = llm.generate(short, greedy(6))
    assert [o.output_token_ids for o in outs] == want


@pytest.mark.parametrize("budget", [1, 7, 64])
def test_chunked_prefill_equals_whole_prefill(
    tiny_checkpoint, tiny_model, tiny_tokenizer, prompts, greedy_alone, budget
):
    llm = make_llm(tiny_checkpoint, tiny_model, tiny_tokenizer, max_num_batched_tokens=budget)
    outs = llm.generate(prompts, greedy())
    assert [o.output_token_ids for o in outs] == greedy_alone
    assert llm.engine.is_idle_and_clean()


def test_preemption_under_a_tiny_budget(tiny_checkpoint, tiny_model, tiny_tokenizer, prompts, greedy_alone):
    # 12 usable pages of 4 tokens hold one 48-token sequence; two usable slots.
    llm = make_llm(tiny_checkpoint, tiny_model, tiny_tokenizer, num_pages=13, num_slots=3, max_model_len=48)
    many = prompts + prompts[::-1]
    outs = llm.generate(many, greedy())
    assert [o.output_token_ids for o in outs] == greedy_alone + greedy_alone[::-1]
    assert llm.engine.scheduler.num_preemptions > 0
    assert any(o.num_preemptions > 0 for o in outs)
    assert llm.engine.is_idle_and_clean()


def test_seeded_sampling_is_reproducible_and_batch_independent(tiny_checkpoint, tiny_model, tiny_tokenizer, prompts):
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=1234, max_tokens=MAX_TOKENS, ignore_eos=True)
    expected = generate_tokens(tiny_model, prompts[2], MAX_TOKENS, 0.8, 0.9, 50, seed=1234).token_ids
    llm = make_llm(tiny_checkpoint, tiny_model, tiny_tokenizer, max_num_batched_tokens=7)
    alone = llm.generate([prompts[2]], params)[0].output_token_ids
    others = [SamplingParams(temperature=1.0, seed=s, max_tokens=MAX_TOKENS, ignore_eos=True) for s in (1, 2)]
    mixed = llm.generate([prompts[0], prompts[2], prompts[3], prompts[1]], [others[0], params, greedy(), others[1]])
    assert alone == expected and mixed[1].output_token_ids == expected
    assert mixed[0].output_token_ids != mixed[3].output_token_ids or prompts[0] != prompts[1]
    other_seed = llm.generate([prompts[2]], SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=99,
                                                           max_tokens=MAX_TOKENS, ignore_eos=True))  # fmt: skip
    assert other_seed[0].output_token_ids != expected
    assert llm.engine.is_idle_and_clean()


def test_max_tokens_stop_tokens_and_stop_strings(tiny_checkpoint, tiny_model, tiny_tokenizer, prompts, greedy_alone):
    llm = make_llm(tiny_checkpoint, tiny_model, tiny_tokenizer)
    short = llm.generate(prompts[3], greedy(max_tokens=3))[0]
    assert short.output_token_ids == greedy_alone[3][:3] and short.finish_reason == "length"

    stop_id = greedy_alone[3][4]
    first = greedy_alone[3].index(stop_id)
    out = llm.generate(prompts[3], greedy(stop_token_ids=[stop_id]))[0]
    assert out.output_token_ids == greedy_alone[3][: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id

    full = llm.generate(prompts[3], greedy())[0].text
    assert full == tiny_tokenizer.decode(greedy_alone[3])
    # A two-character stop string from the middle of the text, cleanly decodable.
    index = next(i for i in range(2, len(full) - 1) if "\ufffd" not in full[i : i + 2])
    stop = full[index : index + 2]
    cut = full.index(stop)
    out = llm.generate(prompts[3], greedy(stop=[stop, "never appears"]))[0]
    assert out.text == full[:cut] and out.finish_reason == "stop" and out.stop_reason == stop
    assert len(out.output_token_ids) < MAX_TOKENS or cut + 2 > len(full) - 2
    kept = llm.generate(prompts[3], greedy(stop=stop, include_stop_str_in_output=True))[0]
    assert kept.text == full[: cut + 2]
    assert llm.engine.is_idle_and_clean()


def test_streamed_increments_add_up(tiny_checkpoint, tiny_model, tiny_tokenizer, prompts, greedy_alone):
    engine = make_llm(tiny_checkpoint, tiny_model, tiny_tokenizer, max_num_batched_tokens=9).engine
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, greedy(stop=["zz"] if i % 2 else ()))
    ids = {f"r{i}": [] for i in range(len(prompts))}
    text = {f"r{i}": "" for i in range(len(prompts))}
    final = {}
    seen = []  # (an output, its tokens when it was made)
    while engine.has_unfinished_requests():
        for out in engine.step():
            ids[out.request_id] += out.new_token_ids
            text[out.request_id] += out.new_text
            assert out.text == text[out.request_id] and out.output_token_ids == ids[out.request_id]
            seen.append((out, list(ids[out.request_id])))
            if out.finished:
                final[out.request_id] = out
    # An output keeps what it said after its sequence grew (it slices the shared token list when read), and pickles
    # (data-parallel replicas send outputs) with its own tokens only.
    for out, tokens in seen:
        assert out.output_token_ids == tokens
        copy = pickle.loads(pickle.dumps(out))
        assert copy.output_token_ids == tokens and copy.sequence_token_ids == tokens and copy.text == out.text
    for i, expected in enumerate(greedy_alone):
        out = final[f"r{i}"]
        if "zz" not in tiny_tokenizer.decode(expected):
            assert ids[f"r{i}"] == expected and text[f"r{i}"] == tiny_tokenizer.decode(expected)
    assert engine.is_idle_and_clean()


def test_logprobs_and_prompt_logprobs(tiny_checkpoint, tiny_model, tiny_tokenizer, prompts, greedy_alone):
    prompt = prompts[3]
    cache = StaticCache(tiny_model, num_seqs=1, max_tokens=len(prompt))
    with torch.no_grad():
        logprobs = torch.log_softmax(tiny_model.compute_logits(tiny_model(cache.batch([0], [prompt]))), dim=-1)
    expected_prompt = logprobs[:-1].gather(1, torch.tensor(prompt[1:])[:, None]).squeeze(1)  # [T-1]
    params = greedy(logprobs=3, prompt_logprobs=2)
    for budget in (7, 256):
        llm = make_llm(tiny_checkpoint, tiny_model, tiny_tokenizer, max_num_batched_tokens=budget)
        out = llm.generate(prompt, params)[0]
        assert out.output_token_ids == greedy_alone[3]
        assert len(out.logprobs) == MAX_TOKENS
        for token, entry in zip(out.output_token_ids, out.logprobs, strict=True):
            assert entry.token_id == token and entry.top_ids[0] == token and len(entry.top_ids) == 3
            assert entry.logprob == pytest.approx(entry.top_logprobs[0], abs=1e-6)
            assert entry.top_logprobs == sorted(entry.top_logprobs, reverse=True)
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        got = torch.tensor([e.logprob for e in out.prompt_logprobs[1:]])
        torch.testing.assert_close(got, expected_prompt, atol=1e-4, rtol=1e-4)
        assert [e.token_id for e in out.prompt_logprobs[1:]] == prompt[1:]
        assert all(len(e.top_ids) == 2 for e in out.prompt_logprobs[1:])
        assert llm.engine.is_idle_and_clean()


def test_abort_frees_pages_and_slots(tiny_checkpoint, tiny_model, tiny_tokenizer, prompts):
    engine = make_llm(tiny_checkpoint, tiny_model, tiny_tokenizer, num_slots=3).engine
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, greedy())
    engine.step()
    engine.step()
    assert engine.num_free_slots() == 0
    free_pages = engine.num_free_pages()
    assert engine.abort_request("r1") and not engine.abort_request("r1")
    assert engine.num_free_slots() == 1 and engine.num_free_pages() > free_pages
    assert engine.abort_request("r3")  # still waiting: never held anything
    outs = []
    while engine.has_unfinished_requests():
        step_outs = engine.step()
        outs += step_outs
        if any(o.request_id == "r2" for o in step_outs):  # r2 got its first token: abort it mid-decode
            assert engine.abort_request("r2")
    finished = {o.request_id for o in outs if o.finished}
    assert finished == {"r0"}
    assert engine.is_idle_and_clean()


def test_add_request_rejects_bad_input(tiny_checkpoint, tiny_model, tiny_tokenizer):
    engine = make_llm(tiny_checkpoint, tiny_model, tiny_tokenizer, max_model_len=32).engine
    engine.add_request("a", [1, 2, 3])
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request("a", [1, 2, 3])
    with pytest.raises(ValueError, match="prompt"):
        engine.add_request("b", [])
    with pytest.raises(ValueError, match="vocabulary"):
        engine.add_request("b", [1, 10_000])
    with pytest.raises(ValueError, match="max_tokens"):
        engine.add_request("b", [1] * 20, SamplingParams(max_tokens=13))
    with pytest.raises(ValueError, match="prompt"):
        engine.add_request("b", [1] * 32)
    no_tokenizer = make_llm(tiny_checkpoint, tiny_model, None).engine
    if no_tokenizer.tokenizer is None:
        with pytest.raises(ValueError, match="stop"):
            no_tokenizer.add_request("c", [1], SamplingParams(stop="x"))
