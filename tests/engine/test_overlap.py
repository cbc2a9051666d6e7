"""Overlap scheduling (decode steps launched one ahead) on the CPU: every request gets the same tokens, text, finish
reason and per-step outputs as with `overlap_scheduling=False`, through stops, aborts, late arrivals, preemption and
log-probs; decode steps really are launched ahead; no page or slot leaks."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch

from jetserve.engine.config import EngineConfig
from jetserve.engine.engine import LLMEngine
from jetserve.engine.output import RequestOutput
from jetserve.sampling_params import SamplingParams

# Lengths cross the page size (4) and the SWA window (16); 25 + 7 tokens reach the context (32) exactly.
PROMPT_LENGTHS = (1, 5, 17, 25)
Requests = dict[str, tuple[list[int], SamplingParams]]
Trace = list[list[tuple[str, list[int]]]]  # per step: (request id, new token ids) of each output


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def make_engine(tiny_checkpoint, tiny_model, tiny_tokenizer, overlap: bool, **engine_args) -> LLMEngine:
    args = dict(device="cpu", page_size=4, num_pages=256, num_slots=9, max_model_len=32) | engine_args
    config = EngineConfig(model=str(tiny_checkpoint), overlap_scheduling=overlap, **args)
    return LLMEngine(config, model=tiny_model, tokenizer=tiny_tokenizer)


def count_launches(engine: LLMEngine) -> list[int]:
    """Wrap the runner's `launch_next`; the returned list holds, per call, how many requests were waiting."""
    calls: list[int] = []
    launch_next = engine.runner.launch_next

    def counted(*args, **kwargs):
        calls.append(len(engine.scheduler.waiting))
        return launch_next(*args, **kwargs)

    engine.runner.launch_next = counted
    return calls


def drive(
    engine: LLMEngine, requests: Requests, before_step: dict[int, Callable[[LLMEngine], None]] | None = None
) -> tuple[dict[str, RequestOutput], Trace]:
    """Add `requests`, then step until nothing is left; `before_step[i]` runs before step i (0-based). Returns the
    final output of every request that finished and the trace of every step's outputs. Checks that a step gives
    each request at most one output of one new token, and that the engine ends idle and clean."""
    before_step = dict(before_step or {})
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    final: dict[str, RequestOutput] = {}
    trace: Trace = []
    while engine.has_unfinished_requests() or before_step:
        if len(trace) in before_step:
            before_step.pop(len(trace))(engine)
        outs = engine.step()
        trace.append([(o.request_id, o.new_token_ids) for o in outs])
        assert len({o.request_id for o in outs}) == len(outs) and all(len(o.new_token_ids) == 1 for o in outs)
        final |= {o.request_id: o for o in outs if o.finished}
    assert engine.is_idle_and_clean()
    return final, trace


def summary(final: dict[str, RequestOutput]) -> dict[str, tuple]:
    return {r: (o.output_token_ids, o.finish_reason, o.stop_reason, o.text) for r, o in sorted(final.items())}


def both_ways(tiny_checkpoint, tiny_model, tiny_tokenizer, requests: Requests, before_step=None, **engine_args):
    """`drive` with overlap off and on: (summary, trace) of each, and the on-engine's `launch_next` calls."""
    results, calls = [], []
    for overlap in (False, True):
        engine = make_engine(tiny_checkpoint, tiny_model, tiny_tokenizer, overlap, **engine_args)
        calls = count_launches(engine)
        final, trace = drive(engine, requests, before_step)
        results.append((summary(final), trace))
        if not overlap:
            assert not calls, "overlap_scheduling=False launched a decode step ahead"
    return results[0], results[1], calls


def greedy(max_tokens: int | None = 10, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def test_greedy_with_different_lengths_and_the_context_end(tiny_checkpoint, tiny_model, tiny_tokenizer, prompts):
    """max_tokens 3, 10 and none (to the context end, 15 and 7 tokens): a sequence that ends by length never runs a
    step past it (the last one would index past its block table), and every step returns the same outputs."""
    limits = (3, 10, None, None)
    requests = {f"r{i}": (p, greedy(n)) for i, (p, n) in enumerate(zip(prompts, limits, strict=True))}
    (want, want_trace), (got, got_trace), calls = both_ways(tiny_checkpoint, tiny_model, tiny_tokenizer, requests)
    assert got == want and got_trace == want_trace
    assert [len(want[f"r{i}"][0]) for i in range(4)] == [3, 10, 15, 7]
    assert all(reason == "length" for _, reason, _, _ in want.values())
    # One prefill step, then 14 decode steps: each but the first resolves a step launched ahead.
    assert len(got_trace) == 15 and len(calls) == 13


def test_seeded_sampling(tiny_checkpoint, tiny_model, tiny_tokenizer, prompts):
    params = [SamplingParams(temperature=t, top_p=0.9, top_k=50, seed=s, max_tokens=n, ignore_eos=True)
              for t, s, n in ((0.8, 1, 9), (1.0, 2, 12), (0.7, 3, 5), (1.2, 4, 7))]  # fmt: skip
    requests = {f"r{i}": (p, params[i]) for i, p in enumerate(prompts)}
    (want, want_trace), (got, got_trace), calls = both_ways(tiny_checkpoint, tiny_model, tiny_tokenizer, requests)
    assert got == want and got_trace == want_trace and calls


def test_stop_token_and_eos_mid_way(tiny_checkpoint, tiny_model, tiny_tokenizer, prompts):
    """A sequence that stops on a token while its next step is already launched drops that step's token; the others
    go on unchanged."""
    probe = make_engine(tiny_checkpoint, tiny_model, tiny_tokenizer, overlap=False)
    free_run, _ = drive(probe, {f"r{i}": (p, greedy(12)) for i, p in enumerate(prompts[:3])})
    stop_id = free_run["r1"].output_token_ids[4]
    eos_id = free_run["r2"].output_token_ids[6]
    requests = {
        "r0": (prompts[0], greedy(12)),
        "r1": (prompts[1], greedy(12, stop_token_ids=[stop_id])),
        "r2": (prompts[2], SamplingParams(temperature=0, max_tokens=12)),  # ends on EOS (below)
    }
    results = []
    for overlap in (False, True):
        engine = make_engine(tiny_checkpoint, tiny_model, tiny_tokenizer, overlap)
        engine.scheduler.eos_token_ids = frozenset({eos_id})  # the tiny model's own EOS may never come
        calls = count_launches(engine)
        final, trace = drive(engine, requests)
        results.append((summary(final), trace))
    assert results[1] == results[0] and calls
    want = results[0][0]
    assert want["r1"][1:3] == ("stop", stop_id) and len(want["r1"][0]) <= 5
    assert want["r2"][1:3] == ("stop", None) and want["r2"][0][-1] == eos_id and len(want["r2"][0]) <= 7
    assert len(want["r0"][0]) == 12


def test_stop_strings(tiny_checkpoint, tiny_model, tiny_tokenizer, prompts):
    probe = make_engine(tiny_checkpoint, tiny_model, tiny_tokenizer, overlap=False)
    full = drive(probe, {"r": (prompts[0], greedy(12))})[0]["r"].text
    # A two-character stop string from the middle of the text, cleanly decodable.
    index = next(i for i in range(2, len(full) - 1) if "\ufffd" not in full[i : i + 2])
    stop = full[index : index + 2]
    requests = {
        "r0": (prompts[1], greedy(12)),
        "r1": (prompts[0], greedy(12, stop=[stop, "never appears"])),
        "r2": (prompts[0], greedy(12, stop=stop, include_stop_str_in_output=True)),
    }
    (want, want_trace), (got, got_trace), calls = both_ways(tiny_checkpoint, tiny_model, tiny_tokenizer, requests)
    assert got == want and got_trace == want_trace and calls
    cut = full.index(stop)
    assert want["r1"][1:] == ("stop", stop, full[:cut]) and want["r2"][3] == full[: cut + 2]
    assert len(want["r1"][0]) < 12 and len(want["r0"][0]) == 12


def test_abort_while_a_step_is_in_flight(tiny_checkpoint, tiny_model, tiny_tokenizer, prompts):
    """Aborts between steps: one request while its next step is launched, then the rest at once, which leaves the
    engine clean with nothing to step."""

    def abort_one(engine: LLMEngine) -> None:
        assert engine._in_flight is not None or not engine.config.overlap_scheduling
        assert engine.abort_request("r1")

    def abort_rest(engine: LLMEngine) -> None:
        for request_id in ("r0", "r2"):
            assert engine.abort_request(request_id)
        assert engine.is_idle_and_clean() and engine.step() == []

    requests = {f"r{i}": (p, greedy(12)) for i, p in enumerate(prompts[:3])}
    before_step = {4: abort_one, 8: abort_rest}
    (want, want_trace), (got, got_trace), calls = both_ways(
        tiny_checkpoint, tiny_model, tiny_tokenizer, requests, before_step
    )
    assert got == want == {} and got_trace == want_trace and calls
    assert sum(r == "r1" for step in want_trace for r, _ in step) == 4  # its prefill and three decode steps


def test_requests_added_while_decoding_are_admitted(tiny_checkpoint, tiny_model, tiny_tokenizer, prompts):
    """A request added mid-decode drains the pipeline and joins within two steps, not when the others end."""

    def add_late(engine: LLMEngine, request_id: str, prompt: list[int]) -> None:
        engine.add_request(request_id, prompt, greedy(6))

    requests = {"r0": (prompts[0], greedy(20)), "r1": (prompts[1], greedy(20))}
    before_step = {3: lambda e: add_late(e, "late0", prompts[2]), 9: lambda e: add_late(e, "late1", prompts[3])}
    (want, want_trace), (got, got_trace), calls = both_ways(
        tiny_checkpoint, tiny_model, tiny_tokenizer, requests, before_step
    )
    assert got == want and calls
    first_output = {r: next(i for i, step in enumerate(got_trace) if r in dict(step)) for r in ("late0", "late1")}
    assert first_output == {"late0": 4, "late1": 10}  # the step after the add resolves the one in flight


def test_a_full_engine_keeps_launching_ahead_while_requests_wait(tiny_checkpoint, tiny_model, tiny_tokenizer, prompts):
    """Two slots for four requests: while the queue cannot be admitted, decode steps still run ahead."""
    requests = {f"r{i}": (p, greedy(n)) for i, (p, n) in enumerate(zip(prompts, (6, 7, 5, 4), strict=True))}
    (want, _), (got, _), calls = both_ways(tiny_checkpoint, tiny_model, tiny_tokenizer, requests, num_slots=3)
    assert got == want and len(want) == 4
    assert any(num_waiting > 0 for num_waiting in calls)


def test_preemption_under_a_tiny_page_budget(tiny_checkpoint, tiny_model, tiny_tokenizer, prompts):
    """12 usable pages of 4 tokens hold one 48-token sequence: steps launched ahead must fit their pages, and drain
    for the scheduler to preempt when they do not; every request ends as without pressure."""
    many = prompts + prompts[::-1]
    requests = {f"r{i}": (p, greedy(12)) for i, p in enumerate(many)}
    roomy = make_engine(tiny_checkpoint, tiny_model, tiny_tokenizer, overlap=False, max_model_len=48)
    unpressured = summary(drive(roomy, requests)[0])
    engine = make_engine(tiny_checkpoint, tiny_model, tiny_tokenizer, overlap=True, num_pages=13, num_slots=3,
                         max_model_len=48)  # fmt: skip
    calls = count_launches(engine)
    final, _ = drive(engine, requests)
    assert {r: (tokens, reason) for r, (tokens, reason, _, _) in summary(final).items()} == {
        r: (tokens, reason) for r, (tokens, reason, _, _) in unpressured.items()
    }
    assert engine.scheduler.num_preemptions > 0 and calls


def test_a_request_with_logprobs_runs_synchronously(tiny_checkpoint, tiny_model, tiny_tokenizer, prompts):
    """Log-probs come from a step's logits, which the next launch would overwrite: a batch holding such a request
    decodes synchronously (here every decode step), with the same tokens and log-probs."""
    requests = {f"r{i}": (p, greedy(6)) for i, p in enumerate(prompts[:3])}
    requests["lp"] = (prompts[3], greedy(7, logprobs=2))  # the longest: in every decode batch
    finals = []
    for overlap in (False, True):
        engine = make_engine(tiny_checkpoint, tiny_model, tiny_tokenizer, overlap)
        calls = count_launches(engine)
        final, trace = drive(engine, requests)
        finals.append((summary(final), trace, [(e.token_id, e.logprob, e.top_ids) for e in final["lp"].logprobs]))
    assert finals[1] == finals[0] and not calls
    assert len(finals[0][2]) == 7


class _EagerReplay:
    """A captured decode graph's stand-in on the CPU: `replay` runs its bucket's body on the static buffers."""

    def __init__(self, body: Callable[[], None]) -> None:
        self.replay = body


def graphed_engine(tiny_checkpoint, tiny_model, tiny_tokenizer, overlap: bool) -> tuple[LLMEngine, dict[str, int]]:
    """An engine whose decode steps take the graph path with the graphs run eagerly (buckets 1, 2, 4, 8), and the
    counts of its graph replays, of those that only advanced the last one's inputs (`run_next`), and of its
    sampler's draws after a decode step, kept up to date."""
    from jetserve.engine.cuda_graph import GraphRunner

    engine = make_engine(tiny_checkpoint, tiny_model, tiny_tokenizer, overlap)
    graphs = GraphRunner(engine.runner, [1, 2, 4, 8])
    graphs.graphs = {B: _EagerReplay(lambda B=B: graphs._step(B)) for B in graphs.batch_sizes}
    engine.runner.graph_runner = graphs
    counts = {"replays": 0, "next": 0, "draws": 0}

    def counted(key: str, fn: Callable) -> Callable:
        def call(*args, **kwargs):
            counts[key] += 1
            return fn(*args, **kwargs)

        return call

    graphs.run = counted("replays", graphs.run)
    graphs.run_host = counted("replays", graphs.run_host)
    graphs.run_next = counted("replays", counted("next", graphs.run_next))
    engine.runner.sampler.after = counted("draws", engine.runner.sampler.after)
    return engine, counts


@pytest.mark.parametrize("overlap", [False, True], ids=["no_overlap", "overlap"])
def test_decode_graph_argmax_serves_all_greedy_steps(tiny_checkpoint, tiny_model, tiny_tokenizer, prompts, overlap):
    """The decode graph path run eagerly (static buffers; buckets 1, 2, 4, 8, so padded rows): a step whose rows are
    all greedy takes its tokens from the argmax the graph computed and calls no sampler; a step with a sampled row
    draws through the sampler. Launched ahead for the same rows, a step only advances the graph's inputs
    (`GraphRunner.run_next`; padded rows stay padding). Either way every request gets what the graph-free engine
    gives it."""
    sampled = SamplingParams(temperature=0.9, top_k=20, seed=3, max_tokens=4, ignore_eos=True)
    mixed = {f"r{i}": (p, greedy(9)) for i, p in enumerate(prompts[:3])} | {"s": (prompts[3], sampled)}
    only_greedy = {f"r{i}": (p, greedy(6)) for i, p in enumerate(prompts)}
    for requests, is_mixed in ((mixed, True), (only_greedy, False)):
        want, _ = drive(make_engine(tiny_checkpoint, tiny_model, tiny_tokenizer, overlap), requests)
        engine, counts = graphed_engine(tiny_checkpoint, tiny_model, tiny_tokenizer, overlap)
        got, _ = drive(engine, requests)
        assert summary(got) == summary(want)
        assert counts["replays"] >= 5
        assert (counts["next"] > 0) == overlap  # only a step launched ahead reuses the inputs
        if is_mixed:  # the sampled request's 3 decode steps draw; the greedy steps after it do not
            assert counts["draws"] == 3 and counts["replays"] > counts["draws"]
        else:
            assert counts["draws"] == 0


def test_decode_graph_leaves_the_next_steps_inputs(tiny_checkpoint, tiny_model, tiny_tokenizer) -> None:
    """Every bucket's static rows are 16-byte aligned. A decode graph (run eagerly) loaded from the host for 3 rows of
    bucket 4 leaves the next step's inputs in its block: its argmax as the tokens, positions one on, the slots; the
    padding row stays zero. `rewind` puts the positions back; the step after replays with no copy and moves them on
    again. A row that was real in the last step and is padding in the next is zeroed, from the host or the device."""
    engine, counts = graphed_engine(tiny_checkpoint, tiny_model, tiny_tokenizer, overlap=False)
    graphs = engine.runner.graph_runner
    # every bucket's rows 16-byte aligned, bucket 1's too (Triton specializes on it)
    assert all(t.data_ptr() % 16 == 0 for B in graphs.batch_sizes for t in graphs.inputs(B))
    host = np.array([[7, 9, 11], [3, 0, 5], [1, 2, 4]], dtype=np.int64)  # token ids, positions, slots
    logits, used, slots = graphs.run_host(host)
    ids, positions, block_slots = graphs.inputs(4)
    assert used.tolist() == [3, 0, 5] and slots.tolist() == [1, 2, 4] and graphs.holds(slots)
    assert torch.equal(ids[:3], logits.argmax(dim=-1)) and torch.equal(ids[:3], graphs.greedy[:3])
    assert positions.tolist() == [4, 1, 6, 0] and block_slots.tolist() == [1, 2, 4, 0] and ids[3] == 0
    assert slots.dtype == block_slots.dtype == torch.int32  # what the model's ops take: no cast in the graph
    graphs.rewind(4)
    assert positions.tolist() == [3, 0, 5, 0]
    positions[:3] += 1
    _, used_next = graphs.run_next(graphs.greedy[:3])
    assert used_next.tolist() == [4, 1, 6] and positions.tolist() == [5, 2, 7, 0]
    assert counts == {"replays": 2, "next": 1, "draws": 0}
    with pytest.raises(ValueError, match="held rows"):
        graphs.run_next(graphs.greedy[:2])
    # four rows from the host, then three from the device in the same bucket: the fourth becomes padding again
    graphs.run_host(np.array([[1, 2, 3, 4], [6, 7, 8, 9], [1, 2, 4, 5]], dtype=np.int64))
    graphs.run(torch.tensor([5, 6, 7]), torch.tensor([10, 11, 12]), torch.tensor([1, 2, 4], dtype=torch.int32))
    assert positions.tolist() == [11, 12, 13, 0] and block_slots.tolist() == [1, 2, 4, 0] and ids[3] == 0
