"""Speculative decoding through the engine on the CPU (reference ops, tiny fp32 target, random EAGLE-3 draft):
greedy speculative output equals plain greedy output token for token (chains and trees, batches of 1 to 8, forced
acceptance patterns including rounds with no draft), the JetBlock state after speculative rounds equals a prefill of
the same tokens, stochastic acceptance keeps the target distribution, chunked prefill and preemption still work,
and no page or slot leaks."""

from __future__ import annotations

import dataclasses
import itertools
import json
import random

import numpy as np
import pytest
import torch

from jetserve import envs
from jetserve.engine.config import DEFAULT_FEATURE_RING, EngineConfig
from jetserve.engine.cuda_graph import SHORT_FLUSH_WIDTH
from jetserve.engine.engine import LLMEngine
from jetserve.engine.memory_plan import slot_bytes_for
from jetserve.engine.speculative import (
    ACCEPT_WINDOW_DRAFTS,
    EXPLORE_EVERY,
    EXPLORE_SAMPLES,
    FIRST_GUESS_MAX_AGE,
    MAX_EXPLORE_EVERY,
    MAX_RUN_STEPS,
    MIN_SAMPLES,
    PHASE_TIMING_EVERY,
    SETTLED_STEPS,
    SHADOW_MARGIN,
    TIME_SAMPLES,
    AdaptivePolicy,
    DraftShape,
    FirstGuesses,
    ShadowDraft,
    VerifyLaunch,
    accepted_along,
    draft_shapes,
    flush_block_size,
    flush_block_views,
)
from jetserve.generate import generate_tokens
from jetserve.llm import LLM
from jetserve.model.forward_batch import Phase
from jetserve.model.static_cache import StaticCache
from jetserve.ops.backend import set_backend
from jetserve.sampling_params import SamplingParams
from jetserve.spec.eagle3 import make_draft_checkpoint

MAX_TOKENS = 16
# Lengths cross the page size (4), the SWA window (16) and one prompt is a single token.
PROMPT_LENGTHS = (1, 5, 17, 33, 2, 9, 24, 12)
BASE_ARGS = dict(device="cpu", page_size=4, num_pages=256, num_slots=9, max_model_len=128)
SPEC_ARGS = dict(spec_feature_ring=32)  # the draft's catch-up every 32 plain steps (the default 128 outlasts the runs)
CHAIN = dict(spec_topk=1, spec_steps=3)
TREE = dict(spec_topk=2, spec_steps=3, spec_num_draft_tokens=6)
# TREE's shapes (depths 3 and 1) timed so that, before any acceptance is seen (τ = 4 and 2), plain decoding is best
# (1000 tokens a second against 889) and each shape above SHADOW_MARGIN of its rate: explorations verify
NEAR_PLAIN = {0: 4.5e-3, 1: 2.25e-3, -1: 1e-3}


@pytest.fixture(scope="module")
def draft_dir(tiny_checkpoint, tmp_path_factory):
    return str(make_draft_checkpoint(tiny_checkpoint, tmp_path_factory.mktemp("draft"), seed=2, draft_vocab_size=200))


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def continuations(tiny_model, prompts) -> list[list[int]]:
    """Each prompt's plain greedy continuation through the unbatched StaticCache path, with room past MAX_TOKENS for
    forced trees to look ahead."""
    return [generate_tokens(tiny_model, p, MAX_TOKENS + 8).token_ids for p in prompts]


def make_engine(tiny_checkpoint, tiny_model, draft_dir, forced=None, **engine_args) -> LLMEngine:
    config = EngineConfig(model=str(tiny_checkpoint), draft=draft_dir, **(BASE_ARGS | SPEC_ARGS | engine_args))
    return LLMEngine(config, model=tiny_model, tokenizer=None, forced_acceptance=forced)


def greedy(max_tokens: int = MAX_TOKENS, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def measure(policy: AdaptivePolicy, bucket: int, seconds: dict[int, float]) -> None:
    """Time each option of `bucket` as many steps as the policy needs to judge it."""
    for option, value in seconds.items():
        for _ in range(MIN_SAMPLES):
            policy.record_step(option, bucket, value)


def run(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams, before_step=None) -> list[list[int]]:
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    final = {}
    step = 0
    while engine.has_unfinished_requests():
        if before_step is not None:
            before_step(step)
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out.output_token_ids
        step += 1
    assert engine.is_idle_and_clean()
    return [final[str(i)] for i in range(len(prompts))]


def drain(engine: LLMEngine) -> None:
    """One step that launches no verify step ahead (the policy asked, once, for plain decoding; that choice is then
    dropped), so that the device's state is what the host has read: mid-generation state checks."""
    policy, spec = engine.spec.policy, engine.spec
    before, policy.forced_option = policy.forced_option, -1
    engine.step()
    policy.forced_option = before
    spec._next_option = None  # the drain's choice, kept for the next step: not a choice of the test's
    assert engine._in_flight is None


def forced_pattern(engine: LLMEngine, continuations: dict[str, list[int]], correct_depth):
    """A tree override: node tokens are the request's true continuation at the node's position where its depth is at
    most `correct_depth(round, row)`, a wrong token below that."""
    vocab = engine.model_config.vocab_size
    rounds = [0]

    def override(tree, slots):
        by_slot = {s.slot: s for s in engine.scheduler.running}
        tokens = tree.tokens.clone()
        positions, depths = tree.positions.tolist(), tree.depths.tolist()
        for i, slot in enumerate(slots.tolist()):
            seq = by_slot[slot]
            full = seq.prompt_token_ids + continuations[seq.request_id]
            k = correct_depth(rounds[0], i)
            for j in range(1, tree.num_nodes):
                right = full[positions[i][j]]
                tokens[i, j] = right if depths[i][j] <= k else (right + 1) % vocab
        rounds[0] += 1
        return dataclasses.replace(tree, tokens=tokens)

    return override


@pytest.mark.parametrize("shape", [CHAIN, TREE], ids=["chain", "tree"])
@pytest.mark.parametrize("batch_size", [1, 2, 5, 8])
def test_drafted_greedy_equals_plain_through_llm(
    tiny_checkpoint, tiny_model, draft_dir, prompts, continuations, shape, batch_size
):
    """The random draft's own trees (almost never accepted) through LLM.generate, adaptive speculation off."""
    llm = LLM(str(tiny_checkpoint), model_instance=tiny_model, tokenizer=None, draft=draft_dir, spec_adaptive=False,
              **shape, **BASE_ARGS)  # fmt: skip
    outs = llm.generate(prompts[:batch_size], greedy())
    assert [o.output_token_ids for o in outs] == [c[:MAX_TOKENS] for c in continuations[:batch_size]]
    assert llm.engine.num_verify_steps > 0 and llm.engine.num_drafts >= llm.engine.num_verify_steps
    assert llm.engine.is_idle_and_clean()


@pytest.mark.parametrize("shape", [CHAIN, TREE], ids=["chain", "tree"])
@pytest.mark.parametrize("forced", ["right", "all", "wrong"])
def test_forced_acceptance_all_and_none(tiny_checkpoint, tiny_model, draft_dir, prompts, continuations, shape, forced):
    engine = make_engine(tiny_checkpoint, tiny_model, draft_dir, forced=forced, spec_adaptive=False, **shape)
    for i, (p, c) in enumerate(zip(prompts, continuations, strict=True)):
        engine.spec.forced_continuations[str(i)] = p + c
    outs = run(engine, prompts, greedy())
    assert outs == [c[:MAX_TOKENS] for c in continuations]
    stats = engine.spec_stats
    if forced == "wrong":
        assert stats.num_accepted_tokens == 0 and stats.num_draft_tokens > 0
    else:
        # Every tree's deepest path is right, so each round accepts its tree's depth (a chain's is 3).
        rates = stats.acceptance_rate_per_depth
        assert rates and all(r == 1.0 for r in rates)
        if shape is CHAIN:
            assert len(rates) == 3 and stats.mean_acceptance_length == 4.0
            # Per request: 15 tokens after the prefill's first, 4 per round (the last round's surplus cut).
            assert stats.num_drafts == len(prompts) * -(-(MAX_TOKENS - 1) // 4)


@pytest.mark.parametrize("shape", [CHAIN, TREE], ids=["chain", "tree"])
def test_mixed_acceptance_patterns_and_rounds_without_draft(
    tiny_checkpoint, tiny_model, draft_dir, prompts, continuations, shape
):
    """Per round and per sequence a random accepted depth (k = 1 right after k ≥ 2 included), and every third
    round decodes plainly (no draft): outputs stay equal to plain greedy."""
    engine = make_engine(tiny_checkpoint, tiny_model, draft_dir, spec_adaptive=False, **shape)
    rng = random.Random(5)
    schedule = {(0, 0): 2, (1, 0): 1, (0, 1): 3, (1, 1): 0}  # row 0: k = 2 then 1; row 1: all then none
    engine.spec.tree_override = forced_pattern(
        engine, {str(i): c for i, c in enumerate(continuations)},
        lambda r, i: schedule.get((r, i), rng.randint(0, 3)),
    )  # fmt: skip

    def before_step(step):
        engine.spec.policy.forced_option = -1 if step % 3 == 2 else 0

    outs = run(engine, prompts, greedy(), before_step)
    assert outs == [c[:MAX_TOKENS] for c in continuations]
    stats = engine.spec_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert stats.num_verify_steps > 3
    # Phase times come from every PHASE_TIMING_EVERY-th verify step, the first included, and are per timed step.
    assert stats.timed_verify_steps == -(-stats.num_verify_steps // PHASE_TIMING_EVERY)
    assert stats.draft_ms_per_step == 1e3 * stats.draft_seconds / stats.timed_verify_steps > 0


def _jet_state(engine: LLMEngine, slot: int) -> list[torch.Tensor]:
    pool = engine.state_pool
    return [pool.conv_states[:, slot].clone(), pool.recurrent_states[:, slot].clone()]


@pytest.mark.parametrize("shape", [CHAIN, TREE], ids=["chain", "tree"])
def test_state_after_speculative_rounds_equals_prefill(
    tiny_checkpoint, tiny_model, draft_dir, prompts, continuations, shape
):
    """Mid-generation, each sequence's JetBlock state and the draft's hidden state equal those of a fresh engine
    that prefilled the same cached tokens."""
    engine = make_engine(tiny_checkpoint, tiny_model, draft_dir, spec_adaptive=False, **shape)
    rng = random.Random(11)
    engine.spec.tree_override = forced_pattern(
        engine, {str(i): c for i, c in enumerate(continuations)}, lambda r, i: rng.randint(0, 3)
    )
    chosen = [1, 3, 4]
    for i in chosen:
        engine.add_request(str(i), prompts[i], greedy(max_tokens=64))
    for _ in range(6):
        engine.step()
    drain(engine)
    seqs = list(engine.scheduler.running)
    assert len(seqs) == 3 and all(s.is_decoding and s.num_output_tokens > 7 for s in seqs)
    assert engine.spec_stats.num_verify_steps_ahead > 0  # the state passed through steps launched ahead
    for seq in seqs:
        cached = seq.token_ids[: seq.num_computed_tokens]
        fresh = make_engine(tiny_checkpoint, tiny_model, draft_dir, spec_adaptive=False, **shape)
        fresh.add_request("x", cached, greedy(max_tokens=1))
        fresh.step()
        assert fresh.is_idle_and_clean()  # its slot (1) is free again but still holds the state
        for a, b in zip(_jet_state(engine, seq.slot), _jet_state(fresh, 1), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(engine.spec.last_hidden[seq.slot], fresh.spec.last_hidden[1], rtol=1e-4, atol=1e-4)
    for seq in seqs:
        engine.abort_request(seq.request_id)
    assert engine.is_idle_and_clean()


@pytest.mark.parametrize("depth", [None, 1], ids=["whole", "depth-1"])
@pytest.mark.parametrize("graph_path", [False, True], ids=["eager", "graph_path"])
@pytest.mark.parametrize("shape", [CHAIN, TREE], ids=["chain", "tree"])
def test_forced_all_commits_whole_paths_of_any_tokens_exactly(
    tiny_checkpoint, tiny_model, draft_dir, prompts, continuations, shape, graph_path, depth
):
    """Forced "all" takes each tree's deepest path without the target's check: continuations of random tokens after
    the prefill's own first token, which the target would reject, come out whole (on the graph path too, padded rows
    included), every drafted depth is accepted (up to `forced_depth` where given), and mid-generation the JetBlock
    state equals a fresh prefill of the same cached tokens (whole-path commits). (The draft's last hidden state
    follows the made-up next token, where a fresh prefill samples the target's: not compared.)"""
    config = EngineConfig(model=str(tiny_checkpoint), draft=draft_dir, spec_adaptive=False,
                          **(BASE_ARGS | SPEC_ARGS | shape))  # fmt: skip
    engine = LLMEngine(config, model=tiny_model, tokenizer=None, forced_acceptance="all", forced_depth=depth)
    if graph_path:
        _eager_graphs(engine, [1, 2, 4])
    gen = torch.Generator().manual_seed(5)
    chosen = [1, 3, 4]
    made_up = {str(i): continuations[i][:1] + torch.randint(0, 256, (63,), generator=gen).tolist() for i in chosen}
    for i in chosen:
        engine.spec.forced_continuations[str(i)] = prompts[i] + made_up[str(i)]
        engine.add_request(str(i), prompts[i], greedy(max_tokens=40))
    for _ in range(5):
        engine.step()
    drain(engine)
    seqs = list(engine.scheduler.running)
    assert len(seqs) == 3 and all(s.num_output_tokens > 6 for s in seqs)
    assert engine.spec_stats.num_verify_steps_ahead > 0
    for seq in seqs:
        assert seq.output_token_ids == made_up[seq.request_id][: seq.num_output_tokens]
        cached = seq.token_ids[: seq.num_computed_tokens]
        fresh = make_engine(tiny_checkpoint, tiny_model, draft_dir, spec_adaptive=False, **shape)
        fresh.add_request("x", cached, greedy(max_tokens=1))
        fresh.step()
        for a, b in zip(_jet_state(engine, seq.slot), _jet_state(fresh, 1), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    final = {}
    while engine.has_unfinished_requests():
        final |= {o.request_id: o.output_token_ids for o in engine.step() if o.finished}
    assert engine.is_idle_and_clean()
    assert final == {k: v[:40] for k, v in made_up.items()}
    rates = engine.spec_stats.acceptance_rate_per_depth
    accepted = len(rates) if depth is None else depth
    assert rates and rates == [1.0] * accepted + [0.0] * (len(rates) - accepted)
    if shape is CHAIN:  # every round the chain's first 3 (or `depth`) drafts: 39 tokens after the prefill's first
        assert len(rates) == 3 and engine.spec_stats.num_drafts == 3 * -(-39 // (accepted + 1))


@pytest.mark.parametrize("forced, depth", [(None, 1), ("right", 1), ("all", -1)])
def test_forced_depth_needs_forced_all_and_a_depth(tiny_checkpoint, tiny_model, draft_dir, forced, depth):
    config = EngineConfig(model=str(tiny_checkpoint), draft=draft_dir, **(BASE_ARGS | SPEC_ARGS))
    with pytest.raises(ValueError, match="forced.depth"):
        LLMEngine(config, model=tiny_model, tokenizer=None, forced_acceptance=forced, forced_depth=depth)


@pytest.mark.parametrize(
    "engine_args",
    [
        {"max_num_batched_tokens": 7},
        {"max_num_batched_tokens": 64, "num_pages": 13, "num_slots": 3, "max_model_len": 48},
    ],
    ids=["chunked-7", "preempting"],
)
@pytest.mark.parametrize("graph_path", [False, True], ids=["eager", "graph_path"])
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no_overlap"])
def test_chunked_prefill_and_preemption_with_speculation(
    tiny_checkpoint, tiny_model, draft_dir, prompts, continuations, engine_args, graph_path, overlap
):
    """Greedy output stays exact with chunked prefill and with preemption, with verify steps launched ahead or not;
    on the graph path (run eagerly) the trees drafted ahead are taken only by the verify step of the same rows, past
    prompts joining and sequences preempted."""
    engine = make_engine(tiny_checkpoint, tiny_model, draft_dir, forced="right", spec_adaptive=False, **CHAIN,
                         overlap_scheduling=overlap, **engine_args)  # fmt: skip
    if graph_path:
        _eager_graphs(engine, [1, 2, 4, 8])
    few = prompts[:4]
    many = few + few[::-1]
    expected = continuations[:4] + continuations[:4][::-1]
    for i, (p, c) in enumerate(zip(many, expected, strict=True)):
        engine.spec.forced_continuations[str(i)] = p + c
    max_tokens = 10
    outs = run(engine, many, greedy(max_tokens))
    assert outs == [c[:max_tokens] for c in expected]
    assert engine.num_accepted_tokens > 0
    if "num_slots" in engine_args:
        assert engine.scheduler.num_preemptions > 0
    if "num_slots" in engine_args:
        assert (engine.spec_stats.num_verify_steps_ahead > 0) == overlap
    if graph_path:  # (with a 7-token budget most steps prefill: few verify steps follow one another)
        used, dropped = engine.spec.graphs.num_drafts_ahead
        assert dropped > 0 or "num_slots" not in engine_args
        # Launched ahead, a run of verify steps drafts ahead only at its end, where here the rows change.
        assert used > 0 or (overlap and "num_slots" in engine_args)


def _depth_by_position(engine: LLMEngine, continuations: dict[str, list[int]], salt: int):
    """A tree override like `forced_pattern`'s whose correct depth (0-3) depends only on the request and its root's
    position, not on how many trees were drafted before: the same whichever steps are launched, or discarded."""
    vocab = engine.model_config.vocab_size

    def override(tree, slots):
        by_slot = {s.slot: s for s in engine.scheduler.running}
        tokens = tree.tokens.clone()
        positions, depths = tree.positions.tolist(), tree.depths.tolist()
        for i, slot in enumerate(slots.tolist()):
            seq = by_slot.get(slot)
            if seq is None:  # a sequence that ended while this tree's step was queued: its tree is discarded
                continue
            full = seq.prompt_token_ids + continuations[seq.request_id]
            k = random.Random(f"{salt}/{seq.request_id}/{positions[i][0]}").randint(0, 3)
            for j in range(1, tree.num_nodes):
                right = full[positions[i][j]]
                tokens[i, j] = right if depths[i][j] <= k else (right + 1) % vocab
        return dataclasses.replace(tree, tokens=tokens)

    return override


@pytest.mark.parametrize("shape", [CHAIN, TREE], ids=["chain", "tree"])
def test_verify_steps_launched_ahead(tiny_checkpoint, tiny_model, draft_dir, prompts, continuations, shape):
    """Overlap scheduling launches each verify step before reading the one in flight, from its result on the device.
    With random accepted depths per round, a stop token inside an accepted path and an abort while a verify step is
    in flight, the outputs, the drafts and the accepted tokens equal those of verify steps run one at a time; while
    a verify step is in flight each of its sequences holds the pages of its tree; nothing leaks."""
    chosen = [1, 3, 4, 6]
    stop_id = continuations[3][9]
    by_request = {str(i): continuations[i] for i in chosen}
    results = []
    for overlap in (False, True):
        engine = make_engine(tiny_checkpoint, tiny_model, draft_dir, spec_adaptive=False, overlap_scheduling=overlap,
                             **shape)  # fmt: skip
        engine.spec.tree_override = _depth_by_position(engine, by_request, salt=3)
        for i in chosen:
            engine.add_request(str(i), prompts[i], greedy(stop_token_ids=[stop_id] if i == 3 else []))
        final, step, held = {}, 0, []
        num_nodes = engine.spec.shapes[0].num_draft_tokens
        while engine.has_unfinished_requests():
            if step == 5:
                assert engine.abort_request("6")
                aborted_in_flight = isinstance(engine._in_flight, VerifyLaunch)
            final |= {o.request_id: (o.output_token_ids, o.finish_reason) for o in engine.step() if o.finished}
            in_flight = engine._in_flight
            if in_flight is not None:
                held += [len(seq.pages) * engine.runner.page_size - seq.num_computed_tokens
                         for seq in in_flight.seqs if not seq.is_finished]  # fmt: skip
            step += 1
        assert engine.is_idle_and_clean()
        stats = engine.spec_stats
        results.append((final, stats.num_drafts, stats.num_accepted_tokens, stats.num_verify_steps))
        if overlap:
            assert stats.num_verify_steps_ahead >= stats.num_verify_steps // 2 and min(held) >= num_nodes
            assert aborted_in_flight
        else:
            assert stats.num_verify_steps_ahead == 0 and not held
    assert results[0] == results[1]
    final = results[0][0]
    first = continuations[3].index(stop_id)
    assert final["3"] == (continuations[3][: first + 1], "stop") and "6" not in final
    assert final["1"] == (continuations[1][:MAX_TOKENS], "length") and final["4"][0] == continuations[4][:MAX_TOKENS]


def test_stop_token_inside_an_accepted_path(tiny_checkpoint, tiny_model, draft_dir, prompts, continuations):
    engine = make_engine(tiny_checkpoint, tiny_model, draft_dir, forced="right", spec_adaptive=False, **CHAIN)
    full = continuations[3]
    stop_id = full[6]
    first = full.index(stop_id)
    engine.spec.forced_continuations["0"] = prompts[3] + full
    engine.spec.forced_continuations["1"] = prompts[2] + continuations[2]
    engine.add_request("0", prompts[3], greedy(stop_token_ids=[stop_id]))
    engine.add_request("1", prompts[2], greedy(max_tokens=5))
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    assert final["0"].output_token_ids == full[: first + 1] and final["0"].stop_reason == stop_id
    assert final["1"].output_token_ids == continuations[2][:5] and final["1"].finish_reason == "length"
    assert engine.is_idle_and_clean()


def test_logprob_requests_decode_plainly(tiny_checkpoint, tiny_model, draft_dir, prompts, continuations):
    engine = make_engine(tiny_checkpoint, tiny_model, draft_dir, spec_adaptive=False, **CHAIN)
    engine.add_request("0", prompts[1], greedy(logprobs=2))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs[-1].output_token_ids == continuations[1][:MAX_TOKENS]
    assert [e.token_id for e in outs[-1].logprobs] == continuations[1][:MAX_TOKENS]
    assert engine.num_verify_steps == 0 and engine.is_idle_and_clean()


def _target_joint(model, prompt: list[int], top_k: int) -> dict[tuple[int, int], float]:
    """P(t1, t2) of sampling two tokens at temperature 1 with top-k filtering, computed exactly from the target."""

    def top_probs(tokens):
        cache = StaticCache(model, 1, len(tokens) + 1)
        with torch.no_grad():
            logits = model.compute_logits(model(cache.batch([0], [tokens])))[-1]
        values, ids = logits.topk(top_k)
        return dict(zip(ids.tolist(), torch.softmax(values.double(), 0).tolist(), strict=True))

    joint = {}
    for t1, p1 in top_probs(prompt).items():
        for t2, p2 in top_probs(prompt + [t1]).items():
            joint[(t1, t2)] = p1 * p2
    return joint


def test_stochastic_acceptance_keeps_the_target_distribution(tiny_checkpoint, tiny_model, draft_dir, prompts):
    """1600 seeded requests sample (t1, t2) at temperature 1, top-k 4: t1 by the prefill step, t2 by a verify step
    whose tree offers the two likeliest t2 (and a wrong third) — accepted, rejected or drawn as the bonus. Pearson's
    chi-square over the 16 cells stays under the 0.999 quantile of chi-square(15) = 37.70 (a correct sampler fails
    1 run in 1000; a sampler that always accepts the first child gives a statistic in the thousands)."""
    top_k, num_requests, prompt = 4, 1600, prompts[1]
    joint = _target_joint(tiny_model, prompt, top_k)
    second = {}
    for (t1, t2), p in joint.items():
        second.setdefault(t1, []).append((p, t2))
    likeliest = {t1: [t for _, t in sorted(pairs, reverse=True)] for t1, pairs in second.items()}
    engine = make_engine(tiny_checkpoint, tiny_model, draft_dir, spec_adaptive=False, max_num_seqs=32, num_slots=33,
                         num_pages=512, spec_topk=2, spec_steps=1, spec_num_draft_tokens=3)  # fmt: skip
    vocab = engine.model_config.vocab_size

    def override(tree, slots):
        tokens = tree.tokens.clone()
        for i, root in enumerate(tree.tokens[:, 0].tolist()):
            tokens[i, 1], tokens[i, 2] = likeliest[root][0], (likeliest[root][3] + 1) % vocab
            if i % 2:  # half the trees offer the two likeliest
                tokens[i, 2] = likeliest[root][1]
        return dataclasses.replace(tree, tokens=tokens)

    engine.spec.tree_override = override
    counts: dict[tuple[int, int], int] = {}
    for i in range(num_requests):
        params = SamplingParams(temperature=1.0, top_k=top_k, seed=1000 + i, max_tokens=2, ignore_eos=True)
        engine.add_request(str(i), prompt, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                key = tuple(out.output_token_ids)
                counts[key] = counts.get(key, 0) + 1
    assert engine.is_idle_and_clean()
    assert set(counts) <= set(joint)
    chi2 = sum((counts.get(cell, 0) - num_requests * p) ** 2 / (num_requests * p) for cell, p in joint.items())
    assert chi2 < 37.70, f"chi-square {chi2:.1f} over 16 cells: {counts}"
    stats = engine.spec_stats
    assert stats.num_drafts == num_requests
    assert 0.2 * num_requests < stats.num_accepted_tokens < num_requests  # acceptances and rejections both happen


def test_speculation_config_errors(tiny_checkpoint, tiny_model, draft_dir, tmp_path):
    with pytest.raises(ValueError, match="spec_topk"):
        EngineConfig(spec_topk=2)
    with pytest.raises(ValueError, match="spec_num_draft_tokens"):
        EngineConfig(draft=draft_dir, spec_topk=2, spec_steps=2, spec_num_draft_tokens=8)
    with pytest.raises(ValueError, match="spec_steps"):
        EngineConfig(draft=draft_dir, spec_steps=0)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EngineConfig(draft=draft_dir, spec_topk=2, spec_steps=3, max_num_batched_tokens=4)
    # The defaults: a chain of 7 (8 nodes), a tree of 3 levels.
    assert EngineConfig(draft=draft_dir).draft_tree_size == 8 and EngineConfig().draft_tree_size == 0
    assert EngineConfig(draft=draft_dir, spec_topk=2).speculation == (2, 3)
    with pytest.raises(ValueError, match="spec_feature_ring"):
        EngineConfig(spec_feature_ring=64)  # without a draft
    with pytest.raises(ValueError, match="spec_feature_ring: must be ≥ 2"):
        EngineConfig(draft=draft_dir, spec_feature_ring=1)
    assert EngineConfig(draft=draft_dir).feature_ring == DEFAULT_FEATURE_RING
    # A draft made for another target: its features are narrower than the target's hidden size (64).
    bad = tmp_path / "bad"
    bad.mkdir()
    draft_config = json.loads(open(f"{draft_dir}/config.json").read())
    (bad / "config.json").write_text(json.dumps(draft_config | {"target_hidden_size": 32}))
    (bad / "model.safetensors").write_bytes(open(f"{draft_dir}/model.safetensors", "rb").read())
    with pytest.raises(ValueError, match="target_hidden_size"):
        make_engine(tiny_checkpoint, tiny_model, str(bad))


def test_ring_and_pages_make_room_for_the_tree(tiny_checkpoint, tiny_model, draft_dir):
    engine = make_engine(tiny_checkpoint, tiny_model, draft_dir, **TREE)
    window = engine.model_config.swa_window_size
    assert engine.plan.ring_tokens >= window + 6 - 1 and engine.plan.num_draft_tokens == 6
    plain = LLMEngine(EngineConfig(model=str(tiny_checkpoint), **BASE_ARGS), model=tiny_model, tokenizer=None)
    assert plain.plan.ring_tokens < engine.plan.ring_tokens
    assert engine.plan.page_bytes > plain.plan.page_bytes  # the draft's K/V rides on every page
    # Every slot also holds the draft's feature ring (32 positions x each capture layer x hidden 64, fp32) and hidden
    # state: the plan counts what SpecDecoder allocates per slot.
    spec = engine.spec
    layers = len(spec.capture_layers)
    allocated = sum(t[1].numel() * t.element_size() for t in [spec.missed_features, spec.last_hidden])
    target = slot_bytes_for(engine.model_config, engine.plan.ring_tokens, engine.runner.dtype)
    assert engine.plan.slot_bytes - target == allocated == (32 * layers * 64 + 64) * 4
    wider = make_engine(tiny_checkpoint, tiny_model, draft_dir, spec_feature_ring=64, **TREE)
    assert wider.plan.slot_bytes - engine.plan.slot_bytes == 32 * layers * 64 * 4
    assert wider.spec.missed_features.shape[1:] == (64, layers, 64)


def test_adaptive_policy_cost_model():
    shapes = draft_shapes(1, 6, 7)
    assert shapes == [DraftShape(1, 6, 7), DraftShape(1, 3, 4)]
    assert draft_shapes(2, 3, 6) == [DraftShape(2, 3, 6), DraftShape(2, 1, 3)]
    assert draft_shapes(1, 7, 8) == [DraftShape(1, 7, 8), DraftShape(1, 3, 4)]  # the default chain and its half
    policy = AdaptivePolicy(shapes, adaptive=True)
    # Each option runs until it has MIN_SAMPLES timed steps: the shortest chain, plain decoding, then the longer chain
    # (with no acceptance measured yet, nothing rules it out).
    seconds = {0: 3.0, 1: 2.0, -1: 1.0}
    tried = []
    for _ in range(3 * MIN_SAMPLES):
        option = policy.choose(4)
        tried.append(option)
        policy.record_step(option, 4, seconds[option])
    assert tried == [1] * MIN_SAMPLES + [-1] * MIN_SAMPLES + [0] * MIN_SAMPLES
    # Nothing accepted: plain decoding (1 token / 1 s) beats 1 token / 2 s and 1 token / 3 s.
    policy.record_acceptance(0, [0, 0])
    policy.record_acceptance(1, [0, 0])
    assert policy.choose(4) == -1
    # Plain decoding settled: the next SETTLED_STEPS steps answer plain without weighing.
    assert [policy.choose(4) for _ in range(SETTLED_STEPS)] == [-1] * SETTLED_STEPS
    # High acceptance (the window filled with it) makes the big tree worth its time: 1 + 6 tokens / 3 s > 1 + 3 / 2 s
    # > 1 / 1 s, at once: new acceptance ends the settled stretch. The chain of 3 is the chain of 6's prefix: its
    # acceptance follows from the big chain's verify steps (min(6, 3) = 3).
    for _ in range(ACCEPT_WINDOW_DRAFTS // 2):
        policy.record_acceptance(0, [6, 6])
    assert policy.mean_accepted == [6.0, 3.0]
    assert policy.choose(4) == 0
    # Another bucket is measured on its own. Exploration runs the least recently timed option for EXPLORE_SAMPLES
    # steps, once within the budget's interval: scheduled when the options were first measured (plain decoding best
    # at 1 s; the chain of 6 could not win then — `test_a_chain_that_cannot_win_is_not_run` — so the costliest
    # exploration is the chain of 3's, 2 − 1 s a step for EXPLORE_SAMPLES + 1 steps: 600 steps at EXPLORE_BUDGET).
    assert policy.choose(64) == 1
    assert policy.next_explore[4] == 3 * MIN_SAMPLES + 600
    choices = []
    for _ in range(1100):
        choices.append(policy.choose(4))
        policy.record_step(choices[-1], 4, seconds[choices[-1]])
    first = choices.index(1)
    assert choices[first : first + EXPLORE_SAMPLES + 1] == [1] * EXPLORE_SAMPLES + [0]
    # Each exploration confirms the chain of 6: the interval doubles, and the explorations take turns (the least
    # recently timed option).
    runs = [(option, len(list(run))) for option, run in itertools.groupby(choices)]
    assert [r for r in runs if r[0] != 0] == [(1, EXPLORE_SAMPLES), (-1, EXPLORE_SAMPLES), (1, EXPLORE_SAMPLES)]
    fixed = AdaptivePolicy(shapes, adaptive=False)
    assert fixed.choose(256) == 0


class _FullBookkeepingPolicy(AdaptivePolicy):
    settled_fast_path = False  # every plain step of a settled stretch through `choose` and `record_step` in full


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_settled_stretch_answers_as_the_full_bookkeeping_does(seed):
    """The settled stretch's fast path (`_Settled`) keeps its steps aside and folds them in when it ends: on a long
    trace — plain decoding and the chains trading places as acceptance and step times drift, batch sizes changing
    within and across buckets, steps timed before or after the next choice as the engine's overlap does — every
    choice, and the tables at the end, equal those of the policy that does every step's bookkeeping in full."""
    rng = random.Random(seed)
    fast, full = AdaptivePolicy(draft_shapes(1, 7, 8), True), _FullBookkeepingPolicy(draft_shapes(1, 7, 8), True)
    phases = [(0.0, 1.0), (0.9, 1.0), (0.1, 2.5), (0.6, 1.0)]  # (acceptance per depth, plain step's slowdown)
    num_seqs, pending, settled_steps = 1, [], 0
    for step in range(12_000):
        accept, slow = phases[step // 3000]
        if rng.random() < 0.01:
            num_seqs = rng.choice([1, 1, 2, 3, 4, 8])
        option = fast.choose(num_seqs)
        settled_steps += fast._settled is not None and fast._settled.taken > 0
        assert full.choose(num_seqs) == option, f"step {step}"
        if option >= 0:
            depth = fast.shapes[option].max_depth
            accepted = [next((d for d in range(depth) if rng.random() > accept), depth) for _ in range(num_seqs)]
            for policy in (fast, full):
                policy.record_acceptance(option, accepted)
        seconds = (2.0 + 0.1 * (fast.shapes[option].max_depth if option >= 0 else 0)) if option >= 0 else slow
        pending.append((option, num_seqs, seconds * (1 + 0.2 * rng.random())))
        while pending and (len(pending) > 1 or rng.random() < 0.5):  # timed one step behind, or at once
            record = pending.pop(0)
            for policy in (fast, full):
                policy.record_step(*record)
    assert settled_steps > 3000  # most plain steps took the fast path
    assert fast.step_seconds == full.step_seconds
    for name in ("bucket_steps", "num_timed", "last_used", "next_explore", "explore_every", "plain_until"):
        assert getattr(fast, name) == getattr(full, name), name


def test_a_chain_that_cannot_win_is_not_run():
    """A chain verifies its shorter chains' levels first, so what a shorter chain measured bounds it: with every draft
    of the chain of 3 wrong, the chain of 7 yields at most 1 + 0 + 4 · (0 + 1) / (drafts + 1) tokens a step in at
    least the chain of 3's time, below plain decoding's rate. It is neither measured nor explored (session 47's
    forced-wrong runs spent half their verify steps on it); once the chain of 3 accepts whole drafts, it is."""
    policy = AdaptivePolicy(draft_shapes(1, 7, 8), adaptive=True)  # [chain of 7, chain of 3]
    seconds = {0: 2.6, 1: 2.0, -1: 1.0}
    accepted = {0: 0, 1: 0}  # drafts accepted per verify step
    chosen: list[int] = []

    def run(num_steps):
        for _ in range(num_steps):
            option = policy.choose(1)
            if option >= 0:
                policy.record_acceptance(option, [accepted[option]])
            policy.record_step(option, 1, seconds[option])
            chosen.append(option)

    run(2 * MIN_SAMPLES)
    assert chosen == [1] * MIN_SAMPLES + [-1] * MIN_SAMPLES
    assert policy.cannot_win(0, 1)  # 1 + 4 · 1 / 6 tokens in ≥ 2 s, against plain's 1 token a second
    assert not any(policy.cannot_win(c, 1) for c in (1, -1))  # the shortest chain and plain decoding: no bound
    run(3000)
    assert 0 not in chosen and chosen.count(1) > 2 * MIN_SAMPLES  # the chain of 3 is still explored
    # The chain of 3 accepts every draft: its next exploration shows it, and the chain of 7 (never timed: the least
    # recently) is explored next, and wins (8 tokens / 2.6 s against 4 / 2 s).
    accepted.update({0: 7, 1: 3})
    run(3000)
    first = chosen.index(0)
    assert chosen[first : first + MIN_SAMPLES] == [0] * MIN_SAMPLES
    assert chosen[-100:] == [0] * 100
    # No bound for trees, nor from a chain with no acceptance measured.
    trees = AdaptivePolicy(draft_shapes(2, 3, 6), adaptive=True)
    measure(trees, 1, {0: 2.0, 1: 1.5, -1: 1.0})
    trees.record_acceptance(1, [0])
    assert not trees.cannot_win(0, 1)
    fresh = AdaptivePolicy(draft_shapes(1, 7, 8), adaptive=True)
    measure(fresh, 1, {1: 2.0, -1: 1.0})
    assert not fresh.cannot_win(0, 1)


def test_a_slow_first_plain_step_is_not_the_estimate():
    """Plain decoding is judged from MIN_SAMPLES steps: one slow first sample no longer decides for the tree a run
    too short to reach its first exploration."""
    policy = AdaptivePolicy([DraftShape(topk=1, num_steps=3, num_draft_tokens=4)], adaptive=True)
    policy.mean_accepted[0] = 2.0  # the tree: 3 tokens per 1 s
    script = [(0, 1.0)] * MIN_SAMPLES + [(-1, 1.0)] + [(-1, 0.1)] * (MIN_SAMPLES - 1)  # plain: 1 s once, then 0.1 s
    for option, seconds in script:
        assert policy.choose(1) == option
        policy.record_step(option, 1, seconds)
    assert policy.choose(1) == -1


def test_a_slow_first_verify_step_is_not_the_estimate():
    """A draft shape is judged from MIN_SAMPLES timed steps too: session 41's policy judged the shape from its first
    verify step alone, and an outlier there (the step that also caught the draft up on the plain stretch before it)
    kept a shape that paid 1.5x out of 96% of MT-bench's batch-1 steps."""
    policy = AdaptivePolicy([DraftShape(topk=1, num_steps=3, num_draft_tokens=4)], adaptive=True)
    policy.mean_accepted[0] = 2.0  # 3 tokens per verify step
    script = [(0, 5.0)] + [(0, 1.5)] * (MIN_SAMPLES - 1) + [(-1, 1.0)] * MIN_SAMPLES  # the tree: 5 s once, then 1.5 s
    for option, seconds in script:
        assert policy.choose(1) == option
        policy.record_step(option, 1, seconds)
    assert policy.choose(1) == 0  # 3 tokens / 1.5 s beat 1 token / 1 s


def test_a_lucky_first_verify_step_does_not_keep_a_losing_tree_chosen():
    """Acceptance is the mean over the last ACCEPT_WINDOW_DRAFTS drafts: a first step that accepted every draft
    (answers open with predictable tokens) is diluted by the next one, not kept near the tree's depth for dozens of
    steps."""
    policy = AdaptivePolicy([DraftShape(topk=1, num_steps=3, num_draft_tokens=4)], adaptive=True)
    measure(policy, 1, {0: 3.0, -1: 1.0})  # the tree pays past 3 tokens per step
    policy.record_acceptance(0, [3])  # 4 tokens
    assert policy.choose(1) == 0
    policy.record_acceptance(0, [0])  # 1 token: (3 + 0) / 2 drafts = 1.5 accepted, 2.5 tokens
    assert policy.choose(1) == -1
    for _ in range(ACCEPT_WINDOW_DRAFTS // 2):
        policy.record_acceptance(0, [3, 3])
    assert policy.mean_accepted[0] == 3.0  # the window moved past both
    assert len(policy.recent_accepted[0]) == ACCEPT_WINDOW_DRAFTS // 2


def test_a_chains_acceptance_tells_its_shorter_chains():
    """A chain's verify step also tells what a shorter chain of the same draft would have accepted (its prefix):
    min(accepted, its depth). Not the other way, and not for trees. The window counts drafts, so at batch 32 two
    steps fill it."""
    policy = AdaptivePolicy(draft_shapes(1, 7, 8), adaptive=True)  # the default chain of 7 and its chain of 3
    policy.record_acceptance(0, [0, 2, 5, 7])
    assert policy.mean_accepted == [14 / 4, (0 + 2 + 3 + 3) / 4]
    policy.record_acceptance(1, [3, 3])
    assert policy.mean_accepted == [14 / 4, (8 + 6) / 6]
    for _ in range(2):
        policy.record_acceptance(0, [1] * 32)
    assert policy.mean_accepted == [1.0, 1.0]  # 68 drafts: the oldest steps' 4 and 2 left the window
    trees = AdaptivePolicy(draft_shapes(2, 3, 6), adaptive=True)
    trees.record_acceptance(0, [3])
    assert trees.mean_accepted == [3.0, None]


def test_one_slow_step_does_not_flip_the_choice_but_a_lasting_change_does():
    """Step times are the median of the last few steps: a single outlier of plain decoding (a first-use compile, a
    plain step that flushed the draft's catch-up ring: 30x its usual time on an H200) leaves plain decoding chosen over
    a tree that never pays; plain decoding that stays slow for most of the window loses to it."""
    policy = AdaptivePolicy([DraftShape(topk=1, num_steps=3, num_draft_tokens=4)], adaptive=True)
    for option, seconds in [(0, 3.0)] * MIN_SAMPLES + [(-1, 1.0)] * MIN_SAMPLES:
        assert policy.choose(1) == option
        policy.record_step(option, 1, seconds)
    policy.record_acceptance(0, [1])  # 2 tokens per 3 s against plain's 1 per 1 s
    for _ in range(TIME_SAMPLES - MIN_SAMPLES):
        assert policy.choose(1) == -1
        policy.record_step(-1, 1, 1.0)
    policy.record_step(-1, 1, 30.0)
    assert policy.choose(1) == -1  # a moving average (0.2 weight) would have jumped to 6.8 s and chosen the tree
    for _ in range(TIME_SAMPLES // 2):
        policy.record_step(-1, 1, 30.0)
    # Most of the last TIME_SAMPLES plain steps slow: it is slow now, and the tree is chosen once the settled stretch
    # ends.
    choices = [policy.choose(1) for _ in range(SETTLED_STEPS + 1)]
    assert choices[-1] == 0 and set(choices) == {-1, 0}


@pytest.mark.parametrize(("tree_seconds", "first", "gaps"), [
    (1.1, EXPLORE_EVERY, [2 * EXPLORE_EVERY, 4 * EXPLORE_EVERY, 8 * EXPLORE_EVERY] + [MAX_EXPLORE_EVERY] * 2),
    (2.0, 600, [600, 600, 600] + [MAX_EXPLORE_EVERY] * 2),
], ids=["doubling", "budget"])  # fmt: skip
def test_exploration_backs_off_while_it_changes_nothing_and_resets_when_it_does(tree_seconds, first, gaps):
    """A tree that never pays (1 token in `tree_seconds` against plain decoding's 1 token in 1 s) is explored ever more
    rarely: the interval doubles from EXPLORE_EVERY, and is never shorter than keeps the exploration's cost within
    EXPLORE_BUDGET of plain decoding's time — a 2 s tree costs 1 s a step over EXPLORE_SAMPLES + 1 = 6 steps, so
    explorations are at least 6 · 1 / 0.01 = 600 steps apart. At batch 1 five wrong drafts are too few to end an
    exploration early (`exploration_cannot_win`)."""
    policy = AdaptivePolicy([DraftShape(topk=1, num_steps=3, num_draft_tokens=4)], adaptive=True)
    seconds = {0: tree_seconds, -1: 1.0}
    accepted = [0]  # drafts accepted per verify step
    chosen: list[int] = []

    def run(num_steps):
        for _ in range(num_steps):
            option = policy.choose(1)
            if option == 0:
                policy.record_acceptance(0, accepted)
            policy.record_step(option, 1, seconds[option])
            chosen.append(option)

    def explorations() -> list[int]:  # the steps that begin a run of the tree after the first measurement
        return [i for i in range(2 * MIN_SAMPLES, len(chosen)) if chosen[i] == 0 and chosen[i - 1] != 0]

    run(6000)
    explored = explorations()
    # Steps 0 .. 2 · MIN_SAMPLES - 1 measure both options; the first exploration is `first` steps after that.
    assert explored[0] == 2 * MIN_SAMPLES + first
    assert all(chosen[i : i + EXPLORE_SAMPLES + 1] == [0] * EXPLORE_SAMPLES + [-1] for i in explored)
    assert [b - a for a, b in itertools.pairwise(explored)][:5] == gaps
    assert policy.explore_every[1] == MAX_EXPLORE_EVERY
    # The draft starts to pay: the next exploration measures it, its judgement changes the choice, and the interval
    # snaps back to EXPLORE_EVERY.
    accepted[0] = 100
    before = len(explored)
    while len(explorations()) == before:
        run(1)
    run(EXPLORE_SAMPLES - 1)  # the rest of the exploration
    assert policy.choose(1) == 0  # judged: the tree is now the best option
    assert policy.explore_every[1] == EXPLORE_EVERY


def test_an_exploration_ends_once_its_drafts_cannot_win_and_not_while_they_pay():
    """An exploration of a chain ends early once the drafts its steps accepted bound the chain below the best option
    with 95% confidence (`exploration_cannot_win`): at batch 8, one step of 8 wrong drafts is enough (Hoeffding: at
    most 1 + 3 · sqrt(ln 20 / 16) = 2.3 tokens in 3 s against 1 in 1 s). Drafts that pay keep it running to its
    EXPLORE_SAMPLES timed steps; so does a bucket's first measurement, which no best option judges."""
    for accepted, length in ((0, 1), (3, EXPLORE_SAMPLES)):
        policy = AdaptivePolicy([DraftShape(topk=1, num_steps=3, num_draft_tokens=4)], adaptive=True)
        chosen = []
        for step in range(MAX_EXPLORE_EVERY + 2 * MIN_SAMPLES + EXPLORE_SAMPLES + 2):
            option = policy.choose(8)
            chosen.append(option)
            if option == 0:  # wrong drafts until the first measurement is over, then `accepted` each
                policy.record_acceptance(0, [accepted if step >= 2 * MIN_SAMPLES else 0] * 8)
            policy.record_step(option, 8, {0: 3.0, -1: 1.0}[option])
        assert chosen[: 2 * MIN_SAMPLES + 1] == [0] * MIN_SAMPLES + [-1] * (MIN_SAMPLES + 1)  # the first measurement
        explored = chosen.index(0, 2 * MIN_SAMPLES)
        assert chosen[explored : explored + length + 1] == [0] * length + [-1]


def test_a_shape_timed_faster_than_plain_decoding_is_weighed_at_plain_decodings_time():
    """A verify step does a plain step's work and more: a shape whose median came out below plain decoding's (a faster
    stretch of the host) is weighed at plain decoding's time, so drafts that never pay never make it the best option,
    and a tie goes to plain decoding; drafts that pay still do."""
    policy = AdaptivePolicy([DraftShape(topk=1, num_steps=3, num_draft_tokens=4)], adaptive=True)
    measure(policy, 1, {0: 0.9, -1: 1.0})
    policy.record_acceptance(0, [0])
    assert policy.best(1) == -1
    assert policy.weighed_seconds(0, 1, policy.step_seconds) == 1.0
    policy.record_acceptance(0, [1])  # 1.5 tokens a step in plain decoding's time
    assert policy.best(1) == 0


def test_an_exploration_runs_until_its_option_is_timed_enough():
    """An exploration keeps its option until it has EXPLORE_SAMPLES more timed steps: of plain decoding, the first
    step after a verify step (unoverlapped) is not timed and a step's time arrives after the next step is chosen
    (that one is launched ahead), so it runs EXPLORE_SAMPLES + 1 steps. An option whose steps are never timed (a
    verify step that always catches the draft up, a tree that never fits) is given up after MAX_RUN_STEPS choices,
    and judged only once timed."""
    policy = AdaptivePolicy([DraftShape(topk=1, num_steps=3, num_draft_tokens=4)], adaptive=True)
    measure(policy, 1, {0: 1.0, -1: 1.0})
    policy.mean_accepted[0] = 2.0  # the shape yields 3 tokens per step: the best option
    policy.last_used |= {(0, 1): 5, (-1, 1): 0}  # plain decoding is the least recently timed
    policy.next_explore[1] = 0  # an exploration is due
    chosen = [policy.choose(1)]  # the first plain step after a verify step: not timed
    for _ in range(EXPLORE_SAMPLES):
        chosen.append(policy.choose(1))  # launched ahead of the step in flight, which is timed after
        policy.record_step(-1, 1, 1.0)
    chosen.append(policy.choose(1))
    assert chosen == [-1] * (EXPLORE_SAMPLES + 1) + [0]

    never_timed = AdaptivePolicy([DraftShape(topk=1, num_steps=3, num_draft_tokens=4)], adaptive=True)
    assert [never_timed.choose(1) for _ in range(MAX_RUN_STEPS + 1)] == [0] * MAX_RUN_STEPS + [-1]
    for _ in range(MIN_SAMPLES):
        never_timed.record_step(-1, 1, 1.0)
    assert never_timed.best(1) == -1  # the untimed shape is not compared
    assert never_timed.choose(1) == -1


def test_server_flags_and_metrics(tiny_checkpoint, tiny_model, draft_dir, prompts, continuations):
    """`jetserve serve` gets the speculation flags from EngineConfig; /metrics counts drafts, draft tokens and
    accepted tokens (τ = 1 + accepted / drafts)."""
    import argparse

    from jetserve.server.launch import add_serve_arguments, engine_config_from_args
    from jetserve.server.metrics import ServerMetrics

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    args = parser.parse_args(["--model", "m", "--draft", draft_dir, "--spec-topk", "2", "--spec-steps", "3",
                              "--spec-num-draft-tokens", "6", "--no-spec-adaptive"])  # fmt: skip
    config = engine_config_from_args(args)
    assert (config.draft, config.spec_topk, config.spec_steps, config.spec_num_draft_tokens) == (draft_dir, 2, 3, 6)
    assert config.spec_adaptive is False
    engine = make_engine(tiny_checkpoint, tiny_model, draft_dir, forced="right", spec_adaptive=False, **CHAIN)
    engine.spec.forced_continuations["0"] = prompts[2] + continuations[2]
    assert run(engine, [prompts[2]], greedy()) == [continuations[2][:MAX_TOKENS]]
    metrics = ServerMetrics("tiny")
    metrics.sample_engine(engine, 0.0)
    text = metrics.render().decode()

    def value(name):
        line = next(x for x in text.splitlines() if x.startswith(name + "{"))
        return float(line.rsplit(" ", 1)[1])

    assert value("jetserve:spec_decode_num_drafts_total") == engine.num_drafts == engine.num_verify_steps
    assert value("jetserve:spec_decode_num_draft_tokens_total") == engine.num_draft_tokens == 3 * engine.num_drafts
    assert value("jetserve:spec_decode_num_accepted_tokens_total") == engine.num_accepted_tokens
    assert value("jetserve:spec_decode_acceptance_rate") == 1.0


class _EagerGraph:
    """Stands in for a captured CUDA graph on the CPU: `replay` runs the captured body on the static buffers."""

    def __init__(self, body) -> None:
        self.body = body

    def replay(self) -> None:
        self.body()


def _eager_graphs(engine: LLMEngine, sizes: list[int]) -> None:
    """The engine's graph runners with every graph replaced by its body run eagerly: the static buffers, buckets and
    padded rows of the graph path, checkable without CUDA."""
    from jetserve.engine.cuda_graph import GraphRunner, SpecGraphRunner

    runner, spec = engine.runner, engine.spec
    decode = GraphRunner(runner, sizes)
    decode.graphs = {B: _EagerGraph(lambda B=B: decode._step(B)) for B in decode.batch_sizes}
    runner.graph_runner = decode
    graphs = SpecGraphRunner(spec, sizes)
    for B in graphs.batch_sizes:
        for w in graphs.flush_widths:
            if graphs.captures_flush(B, w):
                graphs.graphs[("flush", B, w)] = _EagerGraph(lambda B=B, w=w: graphs._flush(B, w))
        for s in range(len(spec.shapes)):
            graphs.graphs[("draft", B, s)] = _EagerGraph(lambda B=B, s=s: graphs._draft(B, s))
            for g in (True, False):
                graphs.graphs[("verify", B, s, g)] = _EagerGraph(lambda B=B, s=s, g=g: graphs._verify(B, s, g))
    spec.graphs = graphs


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no_overlap"])
@pytest.mark.parametrize("shape", [CHAIN, TREE], ids=["chain", "tree"])
def test_graph_path_with_padded_buckets(tiny_checkpoint, tiny_model, draft_dir, prompts, continuations, shape,
                                        overlap):  # fmt: skip
    """The graph path (static buffers, padded rows in slot 0) run eagerly: greedy output equals plain greedy with
    forced acceptance and rounds of plain decoding, and sampled output equals the non-graph path's, and the
    non-graph path's with verify steps launched ahead or not (`overlap`: each sampled row's draws are seeded by its
    position, whichever step computes them)."""
    engine = make_engine(tiny_checkpoint, tiny_model, draft_dir, forced="right", spec_adaptive=False,
                         overlap_scheduling=overlap, **shape)  # fmt: skip
    _eager_graphs(engine, [1, 2, 4, 8])
    chosen = [0, 2, 3, 5, 6]  # 5 rows: bucket 8 with 3 padded rows, then fewer as requests finish
    for i, k in enumerate(chosen):
        engine.spec.forced_continuations[str(i)] = prompts[k] + continuations[k]

    def before_step(step):
        engine.spec.policy.forced_option = -1 if step % 4 == 3 else 0

    outs = run(engine, [prompts[i] for i in chosen], greedy(), before_step)
    assert outs == [continuations[i][:MAX_TOKENS] for i in chosen]
    assert engine.spec_stats.mean_acceptance_length > 2.0
    # Trees drafted ahead were taken by the verify step after (same rows) and dropped before a plain step, or when
    # a request finished and the rows changed. Launched ahead, verify steps draft ahead only where a run of them
    # ends: here mostly before a plain step or at the requests' ends.
    used, dropped = engine.spec.graphs.num_drafts_ahead
    assert dropped > 0 and (used > 0 or overlap)
    assert (engine.spec_stats.num_verify_steps_ahead > 0) == overlap
    sampled = [SamplingParams(temperature=0.9, top_k=30, seed=s, max_tokens=MAX_TOKENS, ignore_eos=True) for s in
               range(3)]  # fmt: skip
    results = []
    for use_graphs, ahead in ((True, overlap), (False, overlap), (False, not overlap)):
        engine = make_engine(tiny_checkpoint, tiny_model, draft_dir, spec_adaptive=False, overlap_scheduling=ahead,
                             **shape)  # fmt: skip
        if use_graphs:
            _eager_graphs(engine, [1, 2, 4])
        for i, params in enumerate(sampled):
            engine.add_request(str(i), prompts[i + 1], params)
        final = {}
        while engine.has_unfinished_requests():
            final |= {o.request_id: o.output_token_ids for o in engine.step() if o.finished}
        assert engine.is_idle_and_clean()
        results.append([final[str(i)] for i in range(3)])
    assert results[0] == results[1] == results[2]


def test_adaptive_speculation_with_greedy_and_sampled_rows(
    tiny_checkpoint, tiny_model, draft_dir, prompts, continuations
):
    """Adaptive speculation (the default) measures every option and keeps greedy rows exact when sampled rows share
    their batches."""
    max_tokens = 48  # long enough for MIN_SAMPLES timed steps of each option
    longer = [generate_tokens(tiny_model, p, max_tokens + 8).token_ids for p in prompts[:4]]  # before the engine binds
    engine = make_engine(tiny_checkpoint, tiny_model, draft_dir, forced="right", **TREE)
    assert engine.config.spec_adaptive
    sampled = SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=max_tokens, ignore_eos=True)
    for i in range(4):
        engine.spec.forced_continuations[str(i)] = prompts[i] + longer[i]
        engine.add_request(str(i), prompts[i], greedy(max_tokens) if i % 2 == 0 else sampled)
    final = {}
    while engine.has_unfinished_requests():
        final |= {o.request_id: o.output_token_ids for o in engine.step() if o.finished}
    assert engine.is_idle_and_clean()
    assert final["0"] == longer[0][:max_tokens] and final["2"] == longer[2][:max_tokens]
    assert all(len(final[str(i)]) == max_tokens for i in (1, 3))
    measured = {option for option, _ in engine.spec.policy.step_seconds}
    assert measured == {0, 1, -1}
    assert engine.num_verify_steps > 0


def _draft_kv(engine: LLMEngine, slot: int, num_positions: int) -> torch.Tensor:
    """The draft's K and V at positions [0, num_positions) of the sequence in `slot`: [2, n, HK, Dh]."""
    spec, page_size = engine.spec, engine.runner.page_size
    positions = torch.arange(num_positions)
    pages = engine.runner.block_table[slot, positions // page_size].long()
    flat = pages * page_size + positions % page_size
    size = spec.k_cache.shape[0] * page_size
    return torch.stack([c.view(size, *c.shape[2:])[flat] for c in (spec.k_cache, spec.v_cache)])


def _plain_outputs(tiny_checkpoint, tiny_model, draft_dir, prompts, params) -> list[list[int]]:
    engine = make_engine(tiny_checkpoint, tiny_model, draft_dir, **CHAIN)
    engine.set_speculation(False)
    return run(engine, prompts, params)


@pytest.mark.parametrize(("graphs", "overlap", "budget"), [(False, True, 8192), (True, True, 8192),
                         (False, False, 8192), (True, True, 16)],
                         ids=["eager", "graph_path", "eager-no_overlap", "graph_path-2_rows"])  # fmt: skip
def test_plain_stretch_then_speculation_is_exact(tiny_checkpoint, tiny_model, draft_dir, prompts, graphs, overlap,
                                                 budget):  # fmt: skip
    """The policy forced to plain decoding for longer than the feature ring (8 positions here), then to a draft shape:
    the draft lags at most a ring's length meanwhile, and after the first verify step its K/V and hidden state, and
    the JetBlock state, equal a fresh prefill of the cached tokens; outputs equal never- and always-speculating runs.
    On the graph path (run eagerly) the catch-up runs as fixed rows of a ring's length in a padded bucket.
    With overlap scheduling every plain step is launched one ahead — a ring-wrap catch-up is queued behind the step in
    flight instead of draining the pipeline — and the verify step comes one step after the policy picked it (the
    choice was made for the step launched ahead). With a step budget of 16 tokens a catch-up forward holds two rows
    of the ring's 8 positions (the third row gets a forward of its own; the 4-row bucket has no flush graph). A fourth
    request ends during the plain stretch, so one step is launched ahead for a subset of the rows in flight (their
    slots and positions taken from that step's) before the catch-ups that follow."""
    chosen = [prompts[i] for i in (1, 3, 4)]
    params = greedy(max_tokens=40)
    expected = _plain_outputs(tiny_checkpoint, tiny_model, draft_dir, chosen, params)
    always = make_engine(tiny_checkpoint, tiny_model, draft_dir, spec_adaptive=False, **CHAIN)
    assert run(always, chosen, params) == expected
    ring = 8
    engine = make_engine(tiny_checkpoint, tiny_model, draft_dir, spec_adaptive=False, overlap_scheduling=overlap,
                         spec_feature_ring=ring, max_num_batched_tokens=budget, **CHAIN)  # fmt: skip
    if graphs:
        _eager_graphs(engine, [1, 2, 4])  # 3 sequences: bucket 4, one padded row
    spec = engine.spec
    forward_rows = []
    flush_rows = spec.flush_rows

    def counting_rows(ids, *args):
        forward_rows.append(ids.shape[0])
        return flush_rows(ids, *args)

    spec.flush_rows = counting_rows
    launched_ahead = [0]
    launch_next = engine.runner.launch_next

    def counted(*args):
        launched_ahead[0] += 1
        return launch_next(*args)

    engine.runner.launch_next = counted
    for i, prompt in enumerate(chosen):
        engine.add_request(str(i), prompt, params)
    engine.add_request("short", prompts[0], greedy(max_tokens=12))  # ends inside the plain stretch
    while engine.scheduler.waiting or not all(s.is_decoding for s in engine.scheduler.running):
        engine.step()  # prefill (the draft catches up on the prompts)
    spec.policy.forced_option = -1
    max_lag = 0
    for _ in range(2 * ring + 8):  # two catch-ups
        engine.step()
        lags = [s.num_computed_tokens - spec.draft_len[s.slot] for s in engine.scheduler.running]
        max_lag = max(max_lag, *lags)
    assert 0 < max_lag <= ring and spec.stats.num_verify_steps == 0
    assert all(s.request_id != "short" for s in engine.scheduler.running)
    assert forward_rows and max(forward_rows) <= min(4, budget // ring)
    assert launched_ahead[0] == (2 * ring + 8 if overlap else 0)  # no step drained for the ring
    spec.policy.forced_option = 0
    engine.step()
    if overlap:  # that call chose the shape for the step after the one in flight, and drained
        assert spec.stats.num_verify_steps == 0
        spec.policy.forced_option = -1  # so that the verify step launches no verify step ahead (the state is read)
        engine.step()
        assert engine._in_flight is None
    assert spec.stats.num_verify_steps == 1
    seqs = list(engine.scheduler.running)
    assert len(seqs) == 3 and all(spec.draft_len[s.slot] == s.num_computed_tokens for s in seqs)
    snapshots = []  # (cached tokens, JetBlock state, draft hidden, draft K/V) before a fresh engine rebinds the model
    for seq in seqs:
        n = seq.num_computed_tokens
        state = (_jet_state(engine, seq.slot), spec.last_hidden[seq.slot].clone(), _draft_kv(engine, seq.slot, n))
        snapshots.append((seq.token_ids[:n], *state))
    final = {}
    while engine.has_unfinished_requests():
        final |= {o.request_id: o.output_token_ids for o in engine.step() if o.finished}
    assert engine.is_idle_and_clean()
    for cached, jet, hidden, draft_kv in snapshots:
        fresh = make_engine(tiny_checkpoint, tiny_model, draft_dir, spec_adaptive=False, **CHAIN)
        fresh.add_request("x", cached, greedy(max_tokens=1))
        fresh.step()
        for a, b in zip(jet, _jet_state(fresh, 1), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(hidden, fresh.spec.last_hidden[1], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(draft_kv, _draft_kv(fresh, 1, len(cached)), rtol=1e-4, atol=1e-4)
    assert [final[str(i)] for i in range(3)] == expected


def test_plain_steps_of_the_adaptive_policy_skip_the_draft(tiny_checkpoint, tiny_model, draft_dir, prompts):
    """With measured times that make plain decoding the best option, DECODE steps run no draft forward (PREFILL
    chunks still do); the periodic exploration of a shape catches the draft up and stays exact."""
    engine = make_engine(tiny_checkpoint, tiny_model, draft_dir, max_num_batched_tokens=16, **TREE)
    policy = engine.spec.policy
    for bucket in (1, 2, 4, 8):  # plain decoding best; the shapes' estimates near enough to it to be verified
        measure(policy, bucket, NEAR_PLAIN)
        policy.next_explore[bucket] = 12  # an exploration due within the run
    calls = [0]
    forward = engine.spec.draft.forward

    def counting_forward(*args, **kwargs):
        calls[0] += 1
        return forward(*args, **kwargs)

    engine.spec.draft.forward = counting_forward
    phases = []
    step_batch = engine.runner.run

    def counting_run(batch):
        before = calls[0]
        out = step_batch(batch)
        phases.append((batch.phase, calls[0] - before))
        return out

    engine.runner.run = counting_run

    def counting_launch(launch, phase=Phase.DECODE):  # the steps launched ahead (overlap scheduling)
        def counted(*args):
            before = calls[0]
            out = launch(*args)
            phases.append((phase, calls[0] - before))
            return out

        return counted

    engine.runner.launch_decode = counting_launch(engine.runner.launch_decode)
    engine.runner.launch_next = counting_launch(engine.runner.launch_next)
    engine.runner.launch_verify = counting_launch(engine.runner.launch_verify, Phase.VERIFY)
    engine.runner.launch_verify_next = counting_launch(engine.runner.launch_verify_next, Phase.VERIFY)
    chosen = [prompts[i] for i in (0, 2, 5)]
    params = greedy(max_tokens=20)
    outs = run(engine, chosen, params)
    assert outs == _plain_outputs(tiny_checkpoint, tiny_model, draft_dir, chosen, params)
    decode = [n for phase, n in phases if phase is Phase.DECODE]
    assert len(decode) > 10 and all(n == 0 for n in decode)
    assert all(n > 0 for phase, n in phases if phase is Phase.PREFILL)
    assert engine.num_verify_steps >= 1 and any(phase is Phase.VERIFY for phase, _ in phases)


@pytest.mark.skipif(not envs.triton_interpret(), reason="the Triton draft kernels run here in the interpreter")
def test_one_sequence_tree_draft_is_the_same_with_the_triton_kernels(tiny_checkpoint, tiny_model, draft_dir, prompts):
    """A single sequence drafting a tree (topk 2): levels past the first run k branches of one row, whose positions
    the drafter once built as an expanded view (stride 0) that the RoPE kernel read past — on the GPU an illegal
    address during the spec graphs' capture. The Triton tree equals the reference ops' tree."""
    engine = make_engine(tiny_checkpoint, tiny_model, draft_dir, **TREE)
    engine.add_request("0", prompts[3], greedy())
    engine.step()  # the prompt's prefill, the draft caught up on it
    seq = engine.scheduler.running[0]
    roots = torch.tensor([seq.token_ids[-1]])
    prefix = torch.tensor([seq.num_computed_tokens])
    slots = torch.tensor([seq.slot])
    trees = {}
    try:
        for backend in ("reference", "triton"):
            set_backend(backend)
            trees[backend] = engine.spec.draft_tree(0, roots, prefix, slots)
    finally:
        set_backend("reference")
    for field in ("tokens", "parents", "positions"):
        assert torch.equal(getattr(trees["triton"], field), getattr(trees["reference"], field)), field
    torch.testing.assert_close(trees["triton"].scores, trees["reference"].scores, rtol=1e-4, atol=1e-4)


def test_overlapped_plain_steps_ask_the_policy_once_per_step(tiny_checkpoint, tiny_model, draft_dir, prompts):
    """Adaptive speculation with overlap scheduling: plain and verify steps are launched ahead, and the policy is
    asked once per decode or verify step — a choice of another option made for a step launched ahead is the next
    step's — while the outputs equal plain decoding."""
    engine = make_engine(tiny_checkpoint, tiny_model, draft_dir, **TREE)
    policy = engine.spec.policy
    for bucket in (1, 2, 4, 8):  # plain decoding measured fastest, with (verified) explorations of the shapes
        measure(policy, bucket, NEAR_PLAIN)
        policy.next_explore[bucket] = 12
    counts = {"choose": 0, "ahead": 0, "resolved": 0, "sync_decode": 0}

    def counting(name, fn, phase=None):
        def wrapped(*args):
            if phase is None or args[0].phase is phase:
                counts[name] += 1
            return fn(*args)

        return wrapped

    policy.choose = counting("choose", policy.choose)
    engine.runner.launch_next = counting("ahead", engine.runner.launch_next)
    engine._resolve = counting("resolved", engine._resolve)
    engine.runner.run = counting("sync_decode", engine.runner.run, Phase.DECODE)
    chosen = [prompts[i] for i in (0, 2, 5)]
    params = greedy(max_tokens=24)
    assert run(engine, chosen, params) == _plain_outputs(tiny_checkpoint, tiny_model, draft_dir, chosen, params)
    assert counts["ahead"] > 10 and engine.spec_stats.num_verify_steps_ahead >= 1
    # Verify steps (with overlap scheduling, all launched; some ahead) are resolved like decode steps launched.
    assert counts["choose"] == counts["resolved"] + counts["sync_decode"]


def test_only_explorations_well_below_plain_decoding_run_in_shadow():
    """`AdaptivePolicy.shadows`: an exploration begun while plain decoding is best, of a shape whose estimate is below
    SHADOW_MARGIN of plain decoding's rate, may run in shadow; a bucket's first measurement, an exploration begun
    while a shape was best, and one of a shape near plain decoding's rate are verified. A shadow step counts as one
    of the run's timed steps with no time (the median is kept), so the run ends after EXPLORE_SAMPLES of them."""
    shapes = [DraftShape(topk=1, num_steps=3, num_draft_tokens=4)]
    first = AdaptivePolicy(shapes, adaptive=True)
    assert first.choose(1) == 0 and not first.shadows(0, 1)  # the first measurement: nothing timed yet

    def explored(verify_seconds: float, accepted: int) -> AdaptivePolicy:
        policy = AdaptivePolicy(shapes, adaptive=True)
        measure(policy, 1, {0: verify_seconds, -1: 1.0})
        policy.record_acceptance(0, [accepted])
        policy.measured.add(1)
        policy.next_explore[1] = 0  # an exploration is due
        assert policy.choose(1) == 0
        return policy

    well_below = explored(3.0, 0)  # 1 token in 3 s against 1 in 1 s
    assert well_below.shadows(0, 1)
    for _ in range(EXPLORE_SAMPLES - 1):
        well_below.record_shadow_step(0, 1)
        assert well_below.choose(1) == 0
    well_below.record_shadow_step(0, 1)
    assert well_below.step_seconds[(0, 1)] == 3.0  # the median is kept
    assert well_below.choose(1) == -1  # the run is over: judged, plain decoding still best
    # 3 tokens in 3.6 s: 0.83 tokens a second, above SHADOW_MARGIN (0.8) of plain decoding's 1
    assert not explored(3.6, 2).shadows(0, 1) and 2 < 3.6 * SHADOW_MARGIN < 3
    a_shape_best = explored(1.5, 3)  # 4 tokens in 1.5 s: the shape is best and the exploration is of plain decoding
    assert a_shape_best.best(1) == 0 and not a_shape_best.shadows(-1, 1) and not a_shape_best.shadows(0, 1)


def test_a_shape_that_lost_in_a_slow_stretch_or_on_old_drafts_is_verified_not_shadowed():
    """`AdaptivePolicy.shadows` weighs a shape at its best: its fastest recent step, and its newest verify steps'
    acceptance where that beats the window's. A shadow step never re-times a shape and adds one draft a sequence to
    its window, so a shape that lost on a median taken in a slow stretch of the host, or on a window of old wrong
    drafts, would otherwise be shadowed at every exploration while its drafts pay (`bench/policy_sim.py`: 1.09x where
    1.32x was to be had, drafts turning from 0 to 0.9 a depth with a stalling host and requests of 96 tokens)."""
    shapes = [DraftShape(topk=1, num_steps=3, num_draft_tokens=4)]

    def explored(verify_seconds: list[float], accepted: list[int]) -> AdaptivePolicy:
        policy = AdaptivePolicy(shapes, adaptive=True)
        measure(policy, 1, {-1: 1.0})
        for seconds in verify_seconds:
            policy.record_step(0, 1, seconds)
        for a in accepted:
            policy.record_acceptance(0, [a])
        policy.measured.add(1)
        policy.next_explore[1] = 0  # an exploration is due
        assert policy.best(1) == -1 and policy.choose(1) == 0
        return policy

    assert explored([3.0] * TIME_SAMPLES, [0]).shadows(0, 1)  # 1 token in 3 s at best
    slow_stretch = explored([1.2] * 4 + [3.0] * 5, [0])  # median 3 s, yet 1 token in 1.2 s: 0.83 a second
    assert slow_stretch.step_seconds[(0, 1)] == 3.0 and not slow_stretch.shadows(0, 1)
    assert explored([2.0] * 4 + [3.0] * 5, [0]).shadows(0, 1)  # 0.5 a second at best: below SHADOW_MARGIN
    old_drafts = explored([3.0] * TIME_SAMPLES, [0] * (ACCEPT_WINDOW_DRAFTS - 8) + [3] * 8)  # the newest 8 accept all
    assert old_drafts.mean_accepted[0] < 0.5 and not old_drafts.shadows(0, 1)  # 4 tokens in 3 s at best


def test_first_guesses_older_than_their_age_rule_nothing_out():
    """The first-guess window counts catch-ups of the last FIRST_GUESS_MAX_AGE steps (every bucket's, a settled
    stretch's included): with requests shorter than the feature ring, guesses come only from explorations' catch-ups,
    which the guesses stop once they rule every chain out, so an old window would rule chains out for good."""
    policy = AdaptivePolicy([DraftShape(topk=1, num_steps=3, num_draft_tokens=4)], adaptive=True)
    measure(policy, 1, {0: 3.0, -1: 1.0})
    policy.record_acceptance(0, [0])
    policy.measured.add(1)
    policy.next_explore[1], policy.bucket_steps[1], policy.bucket_steps[8] = 10**6, 100, 50
    policy.record_first_guesses(0, 256)
    policy.bucket_steps[1] += 500
    policy.record_first_guesses(0, 256)  # at clock 650: the window holds both
    assert policy.clock() == 650 and policy.cannot_win(0, 1) and policy.first_guess_totals == [0, 512]
    policy.bucket_steps[8] += FIRST_GUESS_MAX_AGE - 500  # clock 150 + FIRST_GUESS_MAX_AGE: the first is just in
    assert policy.cannot_win(0, 1) and policy.first_guess_totals == [0, 512]
    while policy.choose(1) == -1 and policy._settled is None:
        pass
    assert policy._settled is not None  # a settled stretch: its steps count before they are folded
    policy._settled.taken += 1  # one step more: the first catch-up is too old
    assert policy.first_guess_bound() is not None and policy.first_guess_totals == [0, 256]
    policy._settled.taken += 500  # the second too: nothing rules the chain out
    assert policy.first_guess_bound() is None and not policy.cannot_win(0, 1)


def test_a_policy_variant_sets_how_long_first_guesses_count():
    """`first_guess_max_age` (a class attribute, as `max_explore_every`, for bench/policy_sim.py's candidates): a
    variant's guesses outlive the engine's age."""

    class LongMemory(AdaptivePolicy):
        first_guess_max_age = 2 * FIRST_GUESS_MAX_AGE

    for cls, kept in ((AdaptivePolicy, 0), (LongMemory, 256)):
        policy = cls([DraftShape(topk=1, num_steps=3, num_draft_tokens=4)], adaptive=True)
        policy.record_first_guesses(0, 256)  # at clock 0
        policy.bucket_steps[1] = FIRST_GUESS_MAX_AGE + 1
        policy.first_guess_bound()
        assert policy.first_guess_totals == [0, kept], cls.__name__


def test_accepted_along_follows_the_emitted_tokens_down_the_tree():
    """Greedy acceptance from the tokens plain decoding emitted: the path from the root (node 0) whose node tokens
    match them, one depth a token, stopping at the first token no child holds."""
    tokens, parents = [9, 5, 6, 7, 8, 3], [-1, 0, 0, 1, 2, 4]  # root → 5 → 7; root → 6 → 8 → 3
    assert accepted_along(tokens, parents, [6, 8, 3]) == 3
    assert accepted_along(tokens, parents, [6, 8, 4]) == 2
    assert accepted_along(tokens, parents, [5, 8]) == 1  # 8 is not 5's child
    assert accepted_along(tokens, parents, [7]) == 0  # 7 is not a child of the root
    assert accepted_along(tokens, parents, [5]) == 1 and accepted_along(tokens, parents, []) == 0


def _script(values):
    """A callable that ignores its arguments and returns `values` in a cycle."""
    it = itertools.cycle(values)
    return lambda *args: next(it)


def _shadow_log(monkeypatch) -> dict[tuple[str, int], tuple[int, int]]:
    """(request id, root position) → (the accepted drafts each shadow draft scored, its tree's depth), for the rows
    with emitted tokens."""
    log = {}
    accepted = ShadowDraft.accepted

    def logged(self, depth):
        out = accepted(self, depth)
        _, parents = self.nodes.read()
        for seq, first, value, row in zip(self.seqs, self.first.tolist(), out, parents, strict=True):
            depths = [0] * len(row)
            for j in range(1, len(row)):
                depths[j] = depths[row[j]] + 1
            if value is not None:
                log[(seq.request_id, first - 1)] = (value, max(depths))
        return out

    monkeypatch.setattr(ShadowDraft, "accepted", logged)
    return log


@pytest.mark.parametrize("shape", [CHAIN, TREE], ids=["chain", "tree"])
def test_shadow_explorations_score_drafts_as_verification_would(
    tiny_checkpoint, tiny_model, draft_dir, prompts, continuations, shape, monkeypatch
):
    """Shadow explorations (plain steps launched ahead that also draft, unverified) mixed with verify steps and plain
    steps: the outputs equal plain decoding's; each shadow draft scores the drafts greedy verification accepts from
    the same root — those of an engine that verifies every step, where both drafted from that root, and the depth
    the tree override made right everywhere — and the policy gets them as a verify step's acceptance."""
    chosen = [prompts[i] for i in (1, 3, 4)]
    by_request = {str(k): continuations[i] for k, i in enumerate((1, 3, 4))}  # `run` names requests by list index
    lengths = {r: len(chosen[int(r)]) + MAX_TOKENS for r in by_request}  # each sequence's tokens at the end
    depth = draft_shapes(shape["spec_topk"], shape["spec_steps"], shape.get("spec_num_draft_tokens", 4))[0].max_depth
    verified = {}
    always = make_engine(tiny_checkpoint, tiny_model, draft_dir, spec_adaptive=False, overlap_scheduling=False, **shape)
    always.spec.tree_override = _depth_by_position(always, by_request, salt=5)
    finish_verify = always.spec.finish_verify

    def logged(launch, rows, followed):
        emitted = finish_verify(launch, rows, followed)
        for i, tokens in zip(rows, emitted, strict=True):
            verified[(launch.seqs[i].request_id, launch.seqs[i].num_computed_tokens)] = len(tokens) - 1
        return emitted

    always.spec.finish_verify = logged
    expected = [by_request[r][:MAX_TOKENS] for r in sorted(by_request)]
    assert run(always, chosen, greedy()) == expected

    shadowed = _shadow_log(monkeypatch)
    engine = make_engine(tiny_checkpoint, tiny_model, draft_dir, **shape)
    engine.spec.tree_override = _depth_by_position(engine, by_request, salt=5)
    policy = engine.spec.policy
    for bucket in (1, 2, 4):
        measure(policy, bucket, {0: 1.0, 1: 1.0, -1: 1e-3})
    policy.choose = _script([-1] + [0] * 6)  # a plain step, then a shape for six steps ...
    policy.shadows = _script([True] * 4 + [False])  # ... explored in shadow, but every fifth time verified
    handed = []
    record_acceptance = policy.record_acceptance
    policy.record_acceptance = lambda option, counts: (handed.extend(counts), record_acceptance(option, counts))
    assert run(engine, chosen, greedy()) == expected
    stats = engine.spec_stats
    assert stats.num_verify_steps >= 2 and stats.num_shadow_drafts >= 20 and not engine.spec.shadows

    def right(key, tree_depth):  # the override's right depth, within the tree and the tokens emitted
        request, root = key
        return min(random.Random(f"5/{request}/{root}").randint(0, 3), tree_depth, lengths[request] - 1 - root)

    assert all(value == right(key, tree_depth) for key, (value, tree_depth) in shadowed.items())
    shadowed = {key: value for key, (value, _) in shadowed.items()}
    assert stats.num_shadow_drafts == len(shadowed) and stats.num_shadow_accepted == sum(shadowed.values())
    assert len(handed) == stats.num_shadow_drafts + stats.num_drafts  # shadow drafts, then verify steps' drafts
    assert sum(handed) == stats.num_shadow_accepted + stats.num_accepted_tokens
    common = [key for key in shadowed if key in verified and key[1] + depth < lengths[key[0]]]
    assert len(common) >= 3 and all(shadowed[key] == verified[key] for key in common)
    assert {shadowed[key] for key in common} != {0}  # drafts were accepted, not only rejected


@pytest.mark.parametrize("forced", ["right", "wrong"])
def test_shadow_drafts_on_the_graph_path_are_not_timed_as_plain_steps(
    tiny_checkpoint, tiny_model, draft_dir, prompts, continuations, forced, monkeypatch
):
    """Shadow explorations through the draft graphs (run eagerly here: the static inputs and trees, a padded bucket),
    with forced acceptance: drafts that are the continuation score the chain's depth (where the tokens reach), wrong
    ones nothing; each step's catch-up of one position replays the short flush graph (SHORT_FLUSH_WIDTH positions a
    row, not a ring's); every plain step after the first is launched ahead and explores, and none of them is timed as
    plain decoding (a shadow step also drafts, and its host work falls in the step before it), while each counts as
    one of the run's timed steps with no time (the shape's step times are its verify steps' alone)."""
    chosen = [prompts[i] for i in (1, 3, 4)]
    engine = make_engine(tiny_checkpoint, tiny_model, draft_dir, forced=forced, **CHAIN)
    for k, i in enumerate((1, 3, 4)):
        engine.spec.forced_continuations[str(k)] = prompts[i] + continuations[i]
    _eager_graphs(engine, [1, 2, 4])  # 3 sequences: bucket 4, one padded row
    policy = engine.spec.policy
    for bucket in (1, 2, 4):
        measure(policy, bucket, {0: 1.0, 1: 1.0, -1: 1e-3})
    policy.choose = _script([-1] + [0] * 1000)  # the first decode step plain, from the host; the rest a shape
    policy.shadows = _script([True])
    counted = sum(policy.num_timed[(0, b)] for b in (1, 2, 4))
    times = {b: list(policy.recent_seconds[(0, b)]) for b in (1, 2, 4)}
    timed = []
    record_step = policy.record_step
    policy.record_step = lambda option, num_seqs, seconds: (timed.append(option), record_step(option, num_seqs,
                                                                                              seconds))  # fmt: skip
    shadowed = _shadow_log(monkeypatch)
    widths = []  # of the flush graphs replayed: a shadow step catches up one position, in the short rows
    flush = engine.spec.graphs.flush
    engine.spec.graphs.flush = lambda block, rows, width: widths.append(width) or flush(block, rows, width)
    shadow_steps = []
    shadow_draft = engine.spec.shadow_draft
    engine.spec.shadow_draft = lambda *args: shadow_steps.append(shadow_draft(*args)) or shadow_steps[-1]
    assert run(engine, chosen, greedy()) == [continuations[i][:MAX_TOKENS] for i in (1, 3, 4)]
    stats = engine.spec_stats
    assert stats.num_verify_steps == 0 and stats.num_shadow_drafts == len(shadowed) >= 3 * (MAX_TOKENS - 3)
    lengths = {str(k): len(prompts[i]) + MAX_TOKENS for k, i in enumerate((1, 3, 4))}
    for (request, root), (value, _) in shadowed.items():
        assert value == (min(3, lengths[request] - 1 - root) if forced == "right" else 0)
    assert all(shadow_steps) and -1 not in timed and 0 not in timed
    assert sum(policy.num_timed[(0, b)] for b in (1, 2, 4)) - counted == len(shadow_steps)
    assert {b: list(policy.recent_seconds[(0, b)]) for b in (1, 2, 4)} == times
    assert len(widths) >= len(shadow_steps) - 1 and set(widths) == {SHORT_FLUSH_WIDTH}  # the first: none to catch up
    assert engine.spec.graphs.flush_widths == [SHORT_FLUSH_WIDTH, engine.spec.ring]


@pytest.mark.parametrize(
    "engine_args",
    [
        {"max_num_batched_tokens": 7},
        {"max_num_batched_tokens": 64, "num_pages": 13, "num_slots": 3, "max_model_len": 48},
    ],
    ids=["chunked-7", "preempting"],
)
def test_shadow_explorations_through_chunked_prefill_and_preemption(
    tiny_checkpoint, tiny_model, draft_dir, prompts, continuations, engine_args, monkeypatch
):
    """Shadow explorations (with verify steps between them) while prompts join in chunks of 7 tokens, or while
    sequences are preempted and recomputed (3 slots for 8 requests, 13 pages): the outputs are plain decoding's, every
    shadow draft is scored once its positions are emitted (forced right: the chain's depth where the tokens reach)
    and none is left pending, and no page or slot leaks (`run`)."""
    engine = make_engine(tiny_checkpoint, tiny_model, draft_dir, forced="right", **CHAIN, **engine_args)
    few = prompts[:4]
    many = few + few[::-1]
    expected = continuations[:4] + continuations[:4][::-1]
    for i, (p, c) in enumerate(zip(many, expected, strict=True)):
        engine.spec.forced_continuations[str(i)] = p + c
    policy = engine.spec.policy
    for bucket in (1, 2, 4, 8):
        measure(policy, bucket, {0: 1.0, 1: 1.0, -1: 1e-3})
    policy.choose = _script([-1] + [0] * 3)  # plain, then the chain for three steps, each in shadow
    policy.shadows = _script([True])
    shadowed = _shadow_log(monkeypatch)
    max_tokens = 10
    assert run(engine, many, greedy(max_tokens)) == [c[:max_tokens] for c in expected]
    stats = engine.spec_stats
    # (a batch the scheduler builds after a prefill step asks the script too: some steps verify)
    assert stats.num_shadow_drafts >= len(shadowed) >= 8 and not engine.spec.shadows
    lengths = {str(i): len(p) + max_tokens for i, p in enumerate(many)}
    assert all(value == min(3, lengths[request] - 1 - root) for (request, root), (value, _) in shadowed.items())
    if "num_slots" in engine_args:
        assert engine.scheduler.num_preemptions > 0


def test_first_guesses_bound_every_chain_and_a_chain_they_free_is_explored_at_once():
    """The draft's first guesses (`record_first_guesses`): with none right over a window, every chain is bound below
    plain decoding at its own median (a chain of 3 in 3 s: at most 1 + 3 · 0.054 tokens, against plain's 1 in 1 s), so
    explorations skip it; the window keeps the newest FIRST_GUESS_WINDOW positions; once the guesses turn right
    (sure of it at the lower bound), the chain is explored at its bucket's next step, the interval reset."""
    policy = AdaptivePolicy([DraftShape(topk=1, num_steps=3, num_draft_tokens=4)], adaptive=True)
    measure(policy, 1, {0: 3.0, -1: 1.0})
    policy.record_acceptance(0, [0])  # plain decoding is best
    policy.measured.add(1)
    policy.next_explore[1], policy.explore_every[1] = 500, 1024
    policy.bucket_steps[1] = 100
    assert not policy.cannot_win(0, 1) and policy.first_guess_bound() is None
    for _ in range(4):
        policy.record_first_guesses(0, 128)
    assert policy.first_guess_totals == [0, 512] and policy.first_guess_bound() == pytest.approx(0.0541, abs=1e-4)
    assert policy.cannot_win(0, 1) and policy._explorable(1, -1) == [-1]
    policy.record_first_guesses(0, 128)  # the oldest catch-up leaves the window
    assert policy.first_guess_totals == [0, 512] and len(policy.first_guesses) == 4
    assert policy.next_explore[1] == 500  # still ruled out: nothing moved
    for _ in range(4):
        policy.record_first_guesses(128, 128)  # every guess right: up to 1 + 3 tokens in 3 s, plain's rate
    assert not policy.cannot_win(0, 1)
    assert policy.next_explore[1] == 100 and policy.explore_every[1] == EXPLORE_EVERY
    assert policy.choose(1) == 0  # explored at once


def _guess_log(monkeypatch) -> list[tuple[str, int, int]]:
    """(request id, position t, the draft's first guess there) of every catch-up's scored guesses."""
    log = []
    score = FirstGuesses.score

    def logged(self, forced):
        table = self.guesses.read()
        for (seq, start, end), row in zip(self.rows, table, strict=True):
            log.extend((seq.request_id, t, row[t - start]) for t in range(start, min(end, len(seq.token_ids) - 2)))
        return score(self, forced)

    monkeypatch.setattr(FirstGuesses, "score", logged)
    return log


@pytest.mark.parametrize("forced", [None, "right", "wrong"])
def test_catch_ups_score_the_drafts_first_guesses(
    tiny_checkpoint, tiny_model, draft_dir, prompts, continuations, forced, monkeypatch
):
    """Every catch-up (an 8-position ring here, on the graph path run eagerly) takes the draft's top token at each
    position it catches up on and, once plain decoding has emitted the token two positions on, scores it: the guess
    at t is exactly the first draft of a chain grown from t + 1 (a shadow draft from that root holds it), and the
    policy's window gets the counts (forced acceptance: all right, or none)."""
    chosen = [prompts[i] for i in (1, 3, 4)]
    engine = make_engine(tiny_checkpoint, tiny_model, draft_dir, forced=forced, spec_feature_ring=8, **CHAIN)
    for k, i in enumerate((1, 3, 4)):
        engine.spec.forced_continuations[str(k)] = prompts[i] + continuations[i]
    _eager_graphs(engine, [1, 2, 4])
    policy = engine.spec.policy
    for bucket in (1, 2, 4):
        measure(policy, bucket, {0: 1.0, 1: 1.0, -1: 1e-3})
    policy.choose = _script([-1] * 12 + [0])  # plain stretches (ring catch-ups), then a shadow draft
    policy.shadows = _script([True])
    guesses, shadowed = _guess_log(monkeypatch), []
    accepted = ShadowDraft.accepted

    def first_drafts(self, depth):  # (request id, root position, the chain's first draft)
        tokens, _ = self.nodes.read()
        rows = zip(self.seqs, self.first.tolist(), tokens, strict=True)
        shadowed.extend((seq.request_id, first - 1, row[1]) for seq, first, row in rows)
        return accepted(self, depth)

    monkeypatch.setattr(ShadowDraft, "accepted", first_drafts)
    assert run(engine, chosen, greedy(max_tokens=MAX_TOKENS + 8)) == [continuations[i] for i in (1, 3, 4)]
    stats = engine.spec_stats
    assert stats.num_first_guesses == len(guesses) >= 30 and not engine.spec.first_guesses
    full = {str(k): prompts[i] + continuations[i] for k, i in enumerate((1, 3, 4))}
    right = sum(guess == full[request][t + 2] for request, t, guess in guesses)
    assert stats.num_first_guesses_right == {None: right, "right": len(guesses), "wrong": 0}[forced]
    assert 0 < policy.first_guess_totals[1] <= len(guesses)
    if forced is None:  # the draft's own guesses: the same token a chain from the next root drafts first
        by_position = {(request, t): guess for request, t, guess in guesses}
        common = [(r, root) for r, root, _ in shadowed if (r, root - 1) in by_position]
        assert len(common) >= 3
        assert all(by_position[(r, root - 1)] == token for r, root, token in shadowed if (r, root - 1) in by_position)


def test_first_guesses_are_scored_against_the_token_two_positions_on(tiny_checkpoint, tiny_model, draft_dir, prompts):
    """A catch-up whose draft guesses like an oracle at every position but each row's last (there its input row holds
    the token two positions on: position t's input is token t + 1): all those are scored right, the last ones wrong."""
    engine = make_engine(tiny_checkpoint, tiny_model, draft_dir, spec_feature_ring=8, **CHAIN)
    drafter = engine.spec.drafters[0]
    extend_rows = drafter.extend_rows
    lasts = [0]

    def oracle(ids, features, starts, kv, valid, guesses=None):
        out = extend_rows(ids, features, starts, kv, valid, guesses)
        if guesses is not None:
            guesses.fill_(-1)
            for row, count in enumerate(valid.tolist()):
                guesses[row, : count - 1] = ids[row, 1:count]  # position t's guess: token t + 2
                lasts[0] += count > 0
        return out

    drafter.extend_rows = oracle
    engine.spec.policy.forced_option = -1  # plain decoding throughout: ring catch-ups only
    run(engine, [prompts[i] for i in (1, 3)], greedy(max_tokens=MAX_TOKENS + 8))
    stats = engine.spec_stats
    assert stats.num_first_guesses >= 20 and stats.num_first_guesses - stats.num_first_guesses_right <= lasts[0]
    assert stats.num_first_guesses_right >= stats.num_first_guesses - lasts[0] > 0


@pytest.mark.parametrize("pattern", ["alternating", "plain", "runs"])
def test_only_steady_steps_are_timed(tiny_checkpoint, tiny_model, draft_dir, prompts, pattern):
    """With overlap scheduling, only steps launched ahead of the one in flight are timed for the policy: a plain or
    verify step that starts with the pipeline empty (after a step of the other kind) runs unoverlapped. Timing
    plain ones made plain decoding look slower the more often speculation was chosen (a loop that ran 77% verify
    steps at 0.51x); a verify step started from the host also first catches the draft up on a plain stretch
    (timing those kept the draft shape out of 96% of MT-bench's batch-1 steps, session 41)."""
    engine = make_engine(tiny_checkpoint, tiny_model, draft_dir, **TREE)
    policy = engine.spec.policy
    script = itertools.cycle({"alternating": [0, -1], "plain": [-1], "runs": [-1] * 4 + [0] * 3}[pattern])
    policy.choose = lambda num_seqs: next(script)
    timed = []
    policy.record_step = lambda option, num_seqs, seconds: timed.append(option)
    caught_up = []  # per verify step launched from the host: whether it first caught the draft up
    launch_verify = engine.runner.launch_verify

    def watched(batch):
        launch = launch_verify(batch)
        caught_up.append(engine.spec.verify_caught_up)
        return launch

    engine.runner.launch_verify = watched
    params = greedy(max_tokens=40)
    assert run(engine, [prompts[0]], params) == _plain_outputs(tiny_checkpoint, tiny_model, draft_dir, [prompts[0]],
                                                                params)  # fmt: skip
    ahead = engine.spec_stats.num_verify_steps_ahead
    assert engine.num_verify_steps == len(caught_up) + ahead
    if pattern == "alternating":  # every step follows one of the other kind: none runs ahead, none is timed
        # The first verify step follows the prefill, which caught the draft up.
        assert len(caught_up) >= 5 and caught_up == [False] + [True] * (len(caught_up) - 1)
        assert ahead == 0 and timed == []
    elif pattern == "plain":
        assert timed.count(-1) >= 30 and caught_up == []
    else:  # each run of verify steps: the first catches up (not timed), the next ones run ahead and are timed
        assert caught_up.count(True) >= 3 and ahead >= 6
        assert timed.count(0) == ahead and timed.count(-1) >= 3


def test_a_choice_made_ahead_is_dropped_by_a_prefill_step(tiny_checkpoint, tiny_model, draft_dir, prompts):
    """A draft shape kept for the next VERIFY step does not outlive a PREFILL step that came instead (an admission
    after the drain): the next decode batch asks the policy again."""
    engine = make_engine(tiny_checkpoint, tiny_model, draft_dir, **TREE)
    engine.add_request("a", prompts[0], greedy(max_tokens=4))
    engine.step()  # prefill
    engine.spec._next_option = 1  # as plan_decode_ahead leaves it
    engine.add_request("b", prompts[1], greedy(max_tokens=4))
    engine.step()  # a PREFILL step (b's prompt, a riding along)
    assert engine.spec._next_option is None
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.is_idle_and_clean()


def test_a_policy_variant_sets_its_longest_exploration_interval():
    """`max_explore_every` (a class attribute, for variants such as bench/policy_sim.py's candidates) caps the
    doubling: a tree that never pays is explored every 256 steps at most once the interval reaches it."""

    class ShortCap(AdaptivePolicy):
        max_explore_every = 256

    policy = ShortCap([DraftShape(topk=1, num_steps=3, num_draft_tokens=4)], adaptive=True)
    starts, previous = [], None  # the steps that begin a run of the tree
    for step in range(3000):
        option = policy.choose(1)
        if option == 0:
            policy.record_acceptance(0, [0])
            if previous != 0:
                starts.append(step)
        policy.record_step(option, 1, {0: 1.1, -1: 1.0}[option])
        previous = option
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    assert policy.explore_every[1] == 256 and gaps[-3:] == [256] * 3


@pytest.mark.parametrize("num_rows,width", [(1, 1), (1, 4), (3, 3), (4, 128), (5, 7)])
def test_a_flush_block_holds_its_views_apart_and_aligned(num_rows, width):
    """A catch-up's block (`flush_block_views`): the four views cover disjoint stretches, in order, each 16-byte
    aligned on the device tensor as on the host array, and round-trip the values written through them."""
    size = flush_block_size(num_rows, width)
    host = np.zeros(size, dtype=np.int64)
    ids, starts, valid, slots = flush_block_views(host, num_rows, width)
    assert ids.shape == (num_rows, width) and starts.shape == valid.shape == slots.shape == (num_rows,)
    ids[:] = np.arange(num_rows * width).reshape(num_rows, width) + 1000
    starts[:], valid[:], slots[:] = np.arange(num_rows), np.arange(num_rows) + 100, np.arange(num_rows) + 200
    block = torch.from_numpy(host.copy())
    views = flush_block_views(block, num_rows, width)
    for view, expected in zip(views, (ids, starts, valid, slots), strict=True):
        assert view.data_ptr() % 16 == 0 and view.tolist() == expected.tolist()
    offsets = [(v.data_ptr() - block.data_ptr()) // 8 for v in views]
    assert offsets == sorted(offsets) and offsets[1] >= num_rows * width and offsets[3] + num_rows <= size
