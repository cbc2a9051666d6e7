"""AsyncEngine alone (no HTTP): outputs reach their request, an abandoned request is aborted and freed, the engine's
refusals and failures reach the awaiting coroutines instead of hanging them."""

from __future__ import annotations

import asyncio
import time

import pytest

from jetserve.engine.engine import LLMEngine
from jetserve.sampling_params import SamplingParams
from jetserve.server.async_engine import AsyncEngine, EngineDeadError, RequestRejectedError
from jetserve.server.metrics import ServerMetrics


@pytest.fixture
def async_engine(tiny_engine_config):
    engine = AsyncEngine(LLMEngine(tiny_engine_config), ServerMetrics("tiny"))
    engine.start()
    yield engine
    engine.shutdown()


def _wait_clean(engine: LLMEngine, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not engine.is_idle_and_clean():
        assert time.monotonic() < deadline, "pages or slots still held"
        time.sleep(0.02)


def test_outputs_arrive_in_order_and_equal_a_direct_run(async_engine, tiny_engine_config):
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)

    async def collect(request_id: str, prompt: list[int]) -> list[int]:
        ids: list[int] = []
        async for out in async_engine.generate(request_id, prompt, params):
            assert out.output_token_ids[: len(ids)] == ids  # each output extends the last
            ids = out.output_token_ids
        return ids

    async def both():
        return await asyncio.gather(collect("a", [5, 6, 7]), collect("b", [9, 8, 7, 6, 5]))

    got = asyncio.run(both())
    direct = LLMEngine(tiny_engine_config)
    for request_id, prompt in (("a", [5, 6, 7]), ("b", [9, 8, 7, 6, 5])):
        direct.add_request(request_id, prompt, params)
    final = {}
    while direct.has_unfinished_requests():
        final |= {o.request_id: o.output_token_ids for o in direct.step() if o.finished}
    assert got == [final["a"], final["b"]]
    _wait_clean(async_engine.engine)


def test_abandoned_request_is_aborted_and_freed(async_engine):
    async def take_two():
        stream = async_engine.generate("long", [1, 2, 3], SamplingParams(max_tokens=300, ignore_eos=True))
        outputs = [await anext(stream), await anext(stream)]
        await stream.aclose()  # the consumer leaves, as a disconnected client's handler does
        return outputs

    outputs = asyncio.run(take_two())
    assert not outputs[-1].finished
    _wait_clean(async_engine.engine)
    assert async_engine.engine.num_unfinished_requests() == 0


def test_refusal_reaches_the_caller_and_others_run_on(async_engine):
    too_long = list(range(1, async_engine.max_model_len + 1))

    async def scenario():
        async def good():
            return [o async for o in async_engine.generate("ok", [4, 5], SamplingParams(max_tokens=3))][-1]

        async def bad():
            async for _ in async_engine.generate("bad", too_long, SamplingParams(max_tokens=3)):
                pass

        return await asyncio.gather(good(), bad(), return_exceptions=True)

    good, bad = asyncio.run(scenario())
    assert isinstance(bad, RequestRejectedError) and str(bad).startswith("prompt:")
    assert good.finished and len(good.output_token_ids) >= 1


def test_engine_failure_fails_requests_instead_of_hanging(async_engine, monkeypatch):
    def broken_step():
        raise RuntimeError("device lost")

    monkeypatch.setattr(async_engine.engine, "step", broken_step)

    async def ask(request_id: str):
        async for _ in async_engine.generate(request_id, [1, 2], SamplingParams(max_tokens=4)):
            pass

    with pytest.raises(EngineDeadError, match="device lost"):
        asyncio.run(asyncio.wait_for(ask("first"), 10))
    assert not async_engine.is_alive
    with pytest.raises(EngineDeadError):
        asyncio.run(ask("second"))
