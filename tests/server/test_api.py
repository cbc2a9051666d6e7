"""The server through the official `openai` client and raw HTTP: results equal offline generation, usage counts,
streaming, echo log-probs, every bad input's 400/401, and no resources left behind by a dropped client."""

from __future__ import annotations

import asyncio
import json
import math
import time

import httpx
import openai
import pytest

from jetserve.llm import LLM
from jetserve.sampling_params import SamplingParams

# As the `running_server` fixture (tests/server/conftest.py) sets them; checked in the first test.
API_KEY, MODEL_NAME, MAX_MODEL_LEN = "test-key", "tiny", 512

PROMPTS = ["Hello there", "The quick brown fox", "a", "Once upon a time, in a land", "0123456789", "xyz xyz"]


@pytest.fixture(scope="module")
def offline(running_server) -> LLM:
    config = running_server.engine_config
    kwargs = {k: getattr(config, k) for k in ("dtype", "device", "max_num_seqs", "max_model_len", "cpu_cache_bytes")}
    return LLM(running_server.checkpoint, **kwargs)


def test_models_health_and_metrics_endpoints(running_server):
    assert (running_server.api_key, running_server.engine_config.max_model_len) == (API_KEY, MAX_MODEL_LEN)
    models = running_server.client().models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    assert httpx.get(running_server.base_url + "/health").status_code == 200
    text = httpx.get(running_server.base_url + "/metrics").text
    for name in ("num_requests_running", "num_requests_waiting", "prompt_tokens_total", "generation_tokens_total",
                 "time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket", "kv_page_usage_perc",
                 "state_slot_usage_perc", "spec_decode_acceptance_rate"):  # fmt: skip
        assert f"jetserve:{name}" in text, name
    assert running_server.metric("jetserve:spec_decode_acceptance_rate") == 0.0
    assert running_server.metric("jetserve:spec_decode_enabled") == 0.0  # no --draft


def test_concurrent_completions_equal_offline_greedy(running_server, offline):
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    expected = offline.generate(PROMPTS, params)

    async def ask_all():
        client = running_server.async_client()
        requests = [client.completions.create(model=MODEL_NAME, prompt=p, max_tokens=10, temperature=0.0,
                                              extra_body={"ignore_eos": True}) for p in PROMPTS]  # fmt: skip
        return await asyncio.gather(*requests)

    responses = asyncio.run(ask_all())
    for prompt, want, got in zip(PROMPTS, expected, responses, strict=True):
        assert got.choices[0].text == want.text
        assert got.choices[0].finish_reason == "length"
        assert got.usage.prompt_tokens == len(offline.tokenizer.encode(prompt))
        assert got.usage.completion_tokens == 10 == len(want.output_token_ids)
        assert got.usage.total_tokens == got.usage.prompt_tokens + 10


def test_chat_equals_offline_and_stream_equals_whole(running_server, offline):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    prompt = offline.tokenizer.apply_chat_template(messages)
    want = offline.generate(prompt, SamplingParams(max_tokens=12, temperature=0.0))[0]
    client = running_server.client()
    whole = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=12, temperature=0)
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == want.text
    assert whole.choices[0].finish_reason == want.finish_reason
    assert whole.usage.prompt_tokens == len(offline.tokenizer.encode(prompt))
    assert whole.usage.completion_tokens == len(want.output_token_ids)
    # Content as a list of text parts is the same conversation.
    parts = [{"role": "system", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]},
             messages[1]]  # fmt: skip
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=parts, max_completion_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        want.finish_reason
    ]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_completion_stream_n_and_seeded_sampling(running_server):
    client = running_server.client()
    kwargs = {"model": MODEL_NAME, "prompt": "seeded", "max_tokens": 6, "temperature": 1.0, "top_p": 0.9,
              "seed": 1234, "n": 3, "extra_body": {"top_k": 50, "min_p": 0.01, "ignore_eos": True}}  # fmt: skip
    first = client.completions.create(**kwargs)
    again = client.completions.create(**kwargs)
    assert [c.text for c in first.choices] == [c.text for c in again.choices]  # the seed reproduces each choice
    assert sorted(c.index for c in first.choices) == [0, 1, 2]
    assert first.usage.completion_tokens == 18
    texts = [""] * 3
    usage = None
    for chunk in client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
        usage = chunk.usage or usage
    assert texts == [c.text for c in sorted(first.choices, key=lambda c: c.index)]
    assert usage.completion_tokens == 18 and usage.prompt_tokens == len("seeded")


def test_stop_string_ends_the_text(running_server):
    client = running_server.client()
    free = client.completions.create(model=MODEL_NAME, prompt=[72, 105], max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text  # fmt: skip
    stop = next(ch for ch in free[3:] if ch.isascii() and ch.isprintable())
    cut = client.completions.create(model=MODEL_NAME, prompt=[72, 105], max_tokens=24, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True}).choices[0]  # fmt: skip
    assert cut.finish_reason == "stop"
    assert cut.text == free[: free.index(stop)]


def test_echo_logprobs_score_the_prompt(running_server, offline):
    """lm-eval's local-completions log-likelihood request: token-id prompts, echo, logprobs, max_tokens 0 or 1."""
    prompts = [[72, 101, 108, 108, 111, 32, 119], [65, 66, 67]]
    want = offline.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1))
    client = running_server.client()
    for max_tokens in (0, 1):
        response = client.completions.create(model=MODEL_NAME, prompt=prompts, max_tokens=max_tokens, echo=True,
                                             logprobs=1, temperature=0)  # fmt: skip
        assert response.usage.completion_tokens == max_tokens * len(prompts)
        for choice, ids, expected in zip(sorted(response.choices, key=lambda c: c.index), prompts, want, strict=True):
            lp = choice.logprobs
            assert len(lp.tokens) == len(ids) + max_tokens
            assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
            scored, tops = lp.token_logprobs[1 : len(ids)], lp.top_logprobs[1 : len(ids)]
            for got, entry, top in zip(scored, expected.prompt_logprobs[1:], tops, strict=True):
                assert math.isclose(got, entry.logprob, rel_tol=1e-5, abs_tol=1e-5)
                # is_greedy as lm-eval computes it: the chosen log-prob is the largest of the top ones
                assert (got == max(top.values())) == (entry.token_id == entry.top_ids[0])
            assert choice.text.startswith(offline.tokenizer.decode(ids))
            if max_tokens == 1:
                assert math.isfinite(lp.token_logprobs[-1])


def test_chat_logprobs(running_server):
    response = running_server.client().chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0, logprobs=True,
        top_logprobs=3,
    )  # fmt: skip
    content = response.choices[0].logprobs.content
    assert len(content) == response.usage.completion_tokens == 4
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)  # greedy picks the most likely
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob >= entry.top_logprobs[2].logprob


BAD_COMPLETIONS = [
    ({"model": "gpt-4", "prompt": "x"}, "model"),
    ({"model": MODEL_NAME, "prompt": ""}, "prompt"),
    ({"model": MODEL_NAME, "prompt": []}, "prompt"),
    ({"model": MODEL_NAME, "prompt": [[]]}, "prompt"),
    ({"model": MODEL_NAME, "prompt": "x" * MAX_MODEL_LEN}, "prompt"),
    ({"model": MODEL_NAME, "prompt": "x" * 100, "max_tokens": MAX_MODEL_LEN - 99}, "max_tokens"),
    ({"model": MODEL_NAME, "prompt": "x", "temperature": -0.5}, "temperature"),
    ({"model": MODEL_NAME, "prompt": "x", "top_p": 0}, "top_p"),
    ({"model": MODEL_NAME, "prompt": "x", "top_p": 1.5}, "top_p"),
    ({"model": MODEL_NAME, "prompt": "x", "top_k": -2}, "top_k"),
    ({"model": MODEL_NAME, "prompt": "x", "top_k": 2**40}, "top_k"),  # beyond the sampler's int32: once killed the loop
    ({"model": MODEL_NAME, "prompt": "x", "min_p": 2}, "min_p"),
    ({"model": MODEL_NAME, "prompt": "x", "max_tokens": -1}, "max_tokens"),
    ({"model": MODEL_NAME, "prompt": "x", "max_tokens": 0}, "max_tokens"),  # 0 only with echo
    ({"model": MODEL_NAME, "prompt": "x", "n": 0}, "n"),
    ({"model": MODEL_NAME, "prompt": "x", "logprobs": 21}, "logprobs"),
    ({"model": MODEL_NAME, "prompt": [1, 2, 10**6]}, "prompt"),
    ({"model": MODEL_NAME, "prompt": [[5], [-1]]}, "prompt"),
    ({"model": MODEL_NAME, "prompt": [1.5]}, "prompt"),
    ({"model": MODEL_NAME, "prompt": "x", "stop": [""]}, "stop"),
    ({"model": MODEL_NAME, "prompt": "x", "presence_penalty": 0.5}, "presence_penalty"),
    ({"model": MODEL_NAME}, "prompt"),
]


@pytest.mark.parametrize(("body", "param"), BAD_COMPLETIONS, ids=[f"{p}-{i}" for i, (_, p) in
                                                                 enumerate(BAD_COMPLETIONS)])  # fmt: skip
def test_bad_completion_is_400_naming_the_field(running_server, body, param):
    response = running_server.post("/v1/completions", body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert error["message"].startswith(param)


BAD_CHATS = [
    ({"model": MODEL_NAME, "messages": []}, "messages"),
    ({"model": MODEL_NAME, "messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ({"model": MODEL_NAME, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages.0.content"),
    ({"model": MODEL_NAME, "messages": [{"role": "user", "content": "x" * MAX_MODEL_LEN}]}, "messages"),
    ({"model": MODEL_NAME, "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": MAX_MODEL_LEN},
     "max_completion_tokens"),
    ({"model": MODEL_NAME, "messages": [{"role": "user", "content": "x"}], "temperature": -1}, "temperature"),
    ({"model": MODEL_NAME, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}, "top_logprobs"),
    ({"model": "nope", "messages": [{"role": "user", "content": "x"}]}, "model"),
]  # fmt: skip


@pytest.mark.parametrize(("body", "param"), BAD_CHATS, ids=[f"{p}-{i}" for i, (_, p) in enumerate(BAD_CHATS)])
def test_bad_chat_is_400_naming_the_field(running_server, body, param):
    response = running_server.post("/v1/chat/completions", body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b'"text"', b"\xff\xfe",
                                 b'{"model": "tiny", "prompt": "x", "temperature": Infinity}',
                                 b'{"model": "tiny", "prompt": "x", "top_p": NaN}'])  # fmt: skip
def test_malformed_json_is_400(running_server, raw):
    response = running_server.post("/v1/completions", None, raw=raw)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "malformed_json"


def test_wrong_or_missing_api_key_is_401(running_server):
    for key in (None, "wrong-key"):
        response = running_server.post("/v1/completions", {"model": MODEL_NAME, "prompt": "x"}, key=key)
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=running_server.base_url + "/v1", api_key="wrong", max_retries=0).models.list()
    assert httpx.get(running_server.base_url + "/health").status_code == 200  # health needs no key


def test_bad_requests_do_not_disturb_running_ones(running_server, offline):
    want = offline.generate("steady", SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))[0].text

    async def scenario():
        client = running_server.async_client()
        good = asyncio.create_task(
            client.completions.create(
                model=MODEL_NAME, prompt="steady", max_tokens=40, temperature=0, extra_body={"ignore_eos": True}
            )
        )
        async with httpx.AsyncClient(headers={"Authorization": f"Bearer {API_KEY}"}) as http:
            bad = [http.post(running_server.base_url + "/v1/completions", json=body) for body, _ in BAD_COMPLETIONS]
            statuses = [r.status_code for r in await asyncio.gather(*bad)]
        return await good, statuses

    good, statuses = asyncio.run(scenario())
    assert set(statuses) == {400}
    assert good.choices[0].text == want and good.usage.completion_tokens == 40
    assert running_server.server.engine.is_alive
    running_server.wait_idle_and_clean()


def test_dropped_stream_frees_pages_and_slots(running_server):
    aborted_before = _aborted(running_server)
    body = {"model": MODEL_NAME, "prompt": "drop me", "max_tokens": 400, "temperature": 0, "ignore_eos": True,
            "stream": True}  # fmt: skip
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", running_server.base_url + "/v1/completions", json=body, headers=headers) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            received = [line for line in (next(lines) for _ in range(6)) if line.startswith("data: ")]
            assert received and json.loads(received[0][6:])["choices"]
            engine = running_server.server.engine.engine
            assert engine.num_unfinished_requests() == 1 and not engine.is_idle_and_clean()
        # leaving the block closes the connection mid-stream
    running_server.wait_idle_and_clean(timeout_s=20)
    assert _aborted(running_server) == aborted_before + 1


def test_dropped_non_streaming_request_is_aborted(running_server):
    aborted_before = _aborted(running_server)
    body = {"model": MODEL_NAME, "prompt": "drop me too", "max_tokens": 480, "n": 4, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        httpx.post(running_server.base_url + "/v1/completions", json=body, timeout=0.5,
                   headers={"Authorization": f"Bearer {API_KEY}"})  # fmt: skip
    running_server.wait_idle_and_clean(timeout_s=20)
    assert _aborted(running_server) == aborted_before + 4  # every choice was aborted, none ran to its end


def test_metrics_count_tokens_and_latencies(running_server):
    before = running_server.metric("jetserve:generation_tokens_total")
    ttft_before = running_server.metric("jetserve:time_to_first_token_seconds_count")
    running_server.client().completions.create(model=MODEL_NAME, prompt="count", max_tokens=5, temperature=0,
                                               extra_body={"ignore_eos": True})  # fmt: skip
    deadline = time.monotonic() + 5
    while running_server.metric("jetserve:generation_tokens_total") < before + 5 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert running_server.metric("jetserve:generation_tokens_total") == before + 5
    assert running_server.metric("jetserve:time_to_first_token_seconds_count") == ttft_before + 1
    assert running_server.metric("jetserve:num_usable_slots") > 0
    running_server.wait_idle_and_clean()
    assert running_server.metric("jetserve:kv_page_usage_perc") == 0.0
    assert running_server.metric("jetserve:num_requests_running") == 0.0


def _aborted(running_server) -> float:
    text = httpx.get(running_server.base_url + "/metrics").text
    for line in text.splitlines():
        if line.startswith("jetserve:request_success_total{") and 'finished_reason="abort"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_tokenizer_endpoints_as_lm_eval_uses_them(running_server, offline):
    tokenize = running_server.post("/tokenize", {"prompt": "Hello", "add_special_tokens": False}).json()
    assert tokenize["tokens"] == offline.tokenizer.encode("Hello") and tokenize["count"] == 5
    chat = running_server.post("/tokenize", {"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["tokens"] == offline.tokenizer.encode(offline.tokenizer.apply_chat_template([
        {"role": "user", "content": "hi"}]))  # fmt: skip
    assert running_server.post("/detokenize", {"tokens": tokenize["tokens"]}).json() == {"prompt": "Hello"}
    info = httpx.get(running_server.base_url + "/tokenizer_info").json()
    assert info["eos_token"] == "<|im_end|>" and info["chat_template"] and info["model_max_length"] == MAX_MODEL_LEN
    assert running_server.post("/detokenize", {"tokens": [10**7]}).json()["error"]["param"] == "tokens"
    assert running_server.post("/tokenize", {}).status_code == 400


def test_continuous_usage_stats_as_guidellm_asks(running_server):
    """guidellm streams chat with `continuous_usage_stats` (vLLM's) and text parts: every chunk carries usage."""
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "max_completion_tokens": 5, "stop": None, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}  # fmt: skip
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.stream("POST", running_server.base_url + "/v1/chat/completions", json=body, headers=headers) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all("usage" in c for c in chunks)
    assert [c["usage"]["completion_tokens"] for c in chunks if c["choices"]][-1] == 5
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5
