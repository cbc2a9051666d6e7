"""Scheduler, BlockManager and StatePool on fabricated inputs: a fake model whose next token is a hash of the prefix."""

from __future__ import annotations

import random

import pytest

from jetserve.engine.block_manager import BlockManager
from jetserve.engine.scheduler import Scheduler
from jetserve.engine.sequence import FinishReason, Sequence, SequenceStatus
from jetserve.engine.state_pool import StatePool
from jetserve.model.forward_batch import Phase
from jetserve.sampling_params import SamplingParams

VOCAB = 50
EOS = 0


def make_scheduler(num_pages: int, num_slots: int, page_size: int = 4, max_num_seqs: int = 8, budget: int = 16):
    pool = StatePool(num_slots, (), (0, 0), (0, 0, 0), dtype=None, device="cpu")
    blocks = BlockManager(num_pages, page_size)
    return Scheduler(blocks, pool, max_num_seqs, budget, eos_token_ids=(EOS,))


def make_seq(prompt: list[int], max_tokens: int, **params) -> Sequence:
    params = SamplingParams(max_tokens=max_tokens, **params)
    return Sequence(f"r{prompt[0]}-{len(prompt)}", prompt, params, 0, max_tokens)


def fake_next_token(tokens: list[int]) -> int:
    """A deterministic 'model': the next token depends on the whole prefix, like a real one."""
    return 1 + hash(tuple(tokens)) % (VOCAB - 1)


def run_to_completion(scheduler: Scheduler, seqs: list[Sequence], check=None) -> dict[str, list[int]]:
    for seq in seqs:
        scheduler.add(seq)
    steps = 0
    while scheduler.has_unfinished():
        batch = scheduler.schedule()
        assert batch is not None, "unfinished requests but nothing scheduled: a deadlock"
        assert batch.num_tokens <= scheduler.max_num_batched_tokens
        assert batch.num_seqs <= scheduler.max_num_seqs
        assert len({s.seq_id for s in batch.seqs}) == batch.num_seqs
        page_size = scheduler.block_manager.page_size
        tokens = []
        rows = zip(batch.seqs, batch.start_positions, batch.num_new_tokens, batch.is_sampling, strict=True)
        for seq, start, n, sampled in rows:
            assert seq.status == SequenceStatus.RUNNING and seq.slot > 0 and n >= 1
            assert len(seq.pages) * page_size >= start + n, "pages do not cover the scheduled tokens"
            assert 0 not in seq.pages
            tokens.append(fake_next_token(seq.token_ids[: start + n]) if sampled else -1)
        if batch.phase is Phase.DECODE:
            assert all(n == 1 and s > 0 for n, s in zip(batch.num_new_tokens, batch.start_positions, strict=True))
        if check is not None:
            check(batch)
        scheduler.postprocess(batch, tokens)
        steps += 1
        assert steps < 10_000
    return {s.request_id: s.output_token_ids for s in seqs}


def random_prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, VOCAB) for _ in range(rng.randrange(1, 20))] for _ in range(n)]


def test_outputs_do_not_depend_on_pressure_and_nothing_leaks():
    prompts = random_prompts(12)
    roomy = make_scheduler(num_pages=200, num_slots=13, max_num_seqs=12, budget=64)
    expected = run_to_completion(roomy, [make_seq(p, 12, ignore_eos=True) for p in prompts])
    assert roomy.num_preemptions == 0
    assert all(len(out) == 12 for out in expected.values())
    preemptions = {}
    for num_pages, num_slots, budget in [(9, 3, 5), (10, 13, 1), (9, 2, 7), (30, 4, 64)]:
        tight = make_scheduler(num_pages=num_pages, num_slots=num_slots, max_num_seqs=12, budget=budget)
        seqs = [make_seq(p, 12, ignore_eos=True) for p in prompts]
        assert run_to_completion(tight, seqs) == expected, (num_pages, num_slots, budget)
        assert all(s.status == SequenceStatus.FINISHED and s.finish_reason == FinishReason.LENGTH for s in seqs)
        assert tight.block_manager.num_free_pages == num_pages - 1
        assert tight.state_pool.num_free_slots == num_slots - 1
        assert all(s.pages == [] and s.slot == 0 for s in seqs)
        preemptions[num_pages, num_slots, budget] = tight.num_preemptions
    assert preemptions[9, 3, 5] > 0, preemptions  # (9, 2, 7) has one usable slot: nothing to preempt


def test_preemption_happens_and_the_preempted_request_finishes():
    # Two sequences that each need most of the pool: the newer is preempted and recomputed later.
    scheduler = make_scheduler(num_pages=8, num_slots=3, page_size=4, budget=64)
    seqs = [make_seq([5, 6, 7, 8, 9, 10], 20, ignore_eos=True), make_seq([11, 12, 13], 20, ignore_eos=True)]
    out = run_to_completion(scheduler, seqs)
    assert scheduler.num_preemptions >= 1
    assert seqs[1].num_preemptions >= 1 and seqs[0].num_preemptions == 0
    alone = {}
    for p in ([5, 6, 7, 8, 9, 10], [11, 12, 13]):
        alone |= run_to_completion(make_scheduler(30, 2), [make_seq(p, 20, ignore_eos=True)])
    assert out == alone


def test_decode_first_and_chunk_budget():
    scheduler = make_scheduler(num_pages=100, num_slots=5, budget=6)
    a = make_seq(list(range(1, 4)), 5, ignore_eos=True)
    scheduler.add(a)
    batch = scheduler.schedule()
    assert batch.phase is Phase.PREFILL and batch.num_new_tokens == [3] and batch.is_sampling == [True]
    scheduler.postprocess(batch, [7])
    b = make_seq(list(range(1, 15)), 5, ignore_eos=True)
    scheduler.add(b)
    batch = scheduler.schedule()
    # a decodes first (1 token), b's prompt is chunked into the remaining 5 tokens and does not sample yet.
    assert batch.seqs == [a, b] and batch.num_new_tokens == [1, 5] and batch.is_sampling == [True, False]
    assert batch.phase is Phase.PREFILL
    scheduler.postprocess(batch, [8, 99])
    assert a.output_token_ids == [7, 8] and b.output_token_ids == [] and b.num_computed_tokens == 5
    batch = scheduler.schedule()
    assert batch.seqs == [a, b] and batch.num_new_tokens == [1, 5]
    scheduler.postprocess(batch, [9, 99])
    batch = scheduler.schedule()
    assert batch.num_new_tokens == [1, 4] and batch.is_sampling == [True, True]
    scheduler.postprocess(batch, [10, 3])
    batch = scheduler.schedule()
    assert batch.phase is Phase.DECODE and batch.num_new_tokens == [1, 1]


def test_stop_conditions():
    scheduler = make_scheduler(num_pages=100, num_slots=5)
    eos = make_seq([1, 2], 10)
    ignore = make_seq([3, 4], 3, ignore_eos=True)
    stop_token = make_seq([5, 6], 10, stop_token_ids=[42])
    for s in (eos, ignore, stop_token):
        scheduler.add(s)
    batch = scheduler.schedule()
    scheduler.postprocess(batch, [EOS, EOS, 42])
    assert eos.finish_reason == FinishReason.STOP and eos.stop_reason is None and eos.output_token_ids == [EOS]
    assert stop_token.finish_reason == FinishReason.STOP and stop_token.stop_reason == 42
    assert not ignore.is_finished
    for _ in range(2):
        scheduler.postprocess(scheduler.schedule(), [EOS])
    assert ignore.finish_reason == FinishReason.LENGTH and ignore.output_token_ids == [EOS] * 3
    assert not scheduler.has_unfinished()
    assert scheduler.block_manager.num_free_pages == 99 and scheduler.state_pool.num_free_slots == 4


def test_abort_frees_pages_and_slot():
    scheduler = make_scheduler(num_pages=20, num_slots=4)
    seqs = [make_seq([i + 1] * 6, 10, ignore_eos=True) for i in range(3)]
    for s in seqs:
        scheduler.add(s)
    scheduler.postprocess(scheduler.schedule(), [1, 2, 3])
    assert scheduler.block_manager.num_free_pages == 14 and scheduler.state_pool.num_free_slots == 0
    assert scheduler.abort(seqs[1].request_id) is seqs[1]
    assert seqs[1].finish_reason == FinishReason.ABORT and seqs[1].pages == [] and seqs[1].slot == 0
    assert scheduler.abort("nope") is None
    waiting = make_seq([9, 9], 5)
    scheduler.add(waiting)
    assert scheduler.abort(waiting.request_id) is waiting and waiting not in scheduler.waiting
    for s in (seqs[0], seqs[2]):
        scheduler.abort(s.request_id)
    assert scheduler.block_manager.num_free_pages == 19 and scheduler.state_pool.num_free_slots == 3
    assert not scheduler.has_unfinished() and scheduler.schedule() is None


def test_block_manager_and_state_pool_accounting():
    blocks = BlockManager(num_pages=6, page_size=4)
    seq = make_seq([1] * 9, 4)
    assert blocks.pages_needed(seq, 9) == 3 and blocks.num_fitting_tokens(seq) == 20
    blocks.append(seq, 9)
    assert len(seq.pages) == 3 and 0 not in seq.pages and blocks.num_free_pages == 2
    seq.num_computed_tokens = 9
    assert blocks.pages_needed(seq, 3) == 0 and blocks.pages_needed(seq, 4) == 1
    assert blocks.pages_needed(seq, 12) == 3 > blocks.num_free_pages and blocks.num_fitting_tokens(seq) == 11
    blocks.free(seq)
    assert blocks.num_free_pages == 5 and seq.pages == []
    pool = StatePool(3, (0, 2), (3, 5), (2, 4, 4), dtype=None, device="cpu")
    assert pool.conv_states.shape == (2, 3, 3, 5) and pool.recurrent_states.shape == (2, 3, 2, 4, 4)
    slots = {pool.allocate(), pool.allocate()}
    assert slots == {1, 2} and pool.num_free_slots == 0
    with pytest.raises(AssertionError):
        pool.free(0)
    conv, recurrent = pool.layer_states()
    assert set(conv) == {0, 2} and conv[2].data_ptr() == pool.conv_states[1].data_ptr()
