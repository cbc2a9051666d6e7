"""Prefill graphs' padded steps (`engine.prefill_graph`) on the CPU, run eagerly: what a bucket's graph replays — the
real rows, empty rows and a padding sequence in slot 0, the chunk table padded past its end — gives every request
the tokens of the unpadded step, chunked, batched, sampled and speculating. (Replay == eager on a GPU:
tests/engine/test_engine_gpu.py.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_engine import MAX_TOKENS, greedy, make_llm

from jetserve.checkpoint import make_checkpoint, preset_config
from jetserve.engine.config import EngineConfig
from jetserve.engine.prefill_graph import prefill_buckets
from jetserve.engine.scheduler import Batch
from jetserve.generate import generate_tokens
from jetserve.model.forward_batch import Phase
from jetserve.model.loader import load_model
from jetserve.ops.gated_delta_rule.chunk_table import CHUNK_SIZE
from jetserve.sampling_params import SamplingParams
from jetserve.spec.eagle3 import make_draft_checkpoint
from jetserve.tokenizer import load_tokenizer

# Lengths cross the page size (4), the SWA window (16), a chunk (64) and the buckets below; one is a single token.
PROMPT_LENGTHS = (1, 5, 17, 33, 70, 16)
BUCKETS = [16, 32, 48, 96]


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def greedy_alone(tiny_model, prompts) -> list[list[int]]:
    return [generate_tokens(tiny_model, p, MAX_TOKENS).token_ids for p in prompts]


def padded_llm(tiny_checkpoint, tiny_model, tiny_tokenizer, max_seqs=2, **engine_args):
    """An engine whose PREFILL steps of up to 96 tokens in up to `max_seqs` sequences run padded to their bucket;
    `replayed` counts them by bucket."""
    llm = make_llm(tiny_checkpoint, tiny_model, tiny_tokenizer, **({"max_model_len": 160} | engine_args))
    runner = llm.engine.runner
    runner.use_prefill_graphs(BUCKETS, max_seqs, capture=False)
    graphs = runner.prefill_graphs
    llm.replayed = {}
    run = graphs.run

    def counted(batch, slots, bucket):
        llm.replayed[bucket] = llm.replayed.get(bucket, 0) + 1
        return run(batch, slots, bucket)

    graphs.run = counted
    return llm


@pytest.mark.parametrize("budget", [7, 40, 8192])
def test_padded_prefill_steps_equal_each_prompt_alone(
    tiny_checkpoint, tiny_model, tiny_tokenizer, prompts, greedy_alone, budget
):
    """Greedy tokens equal the unbatched path's, whole prompts or chunks of 7 / 40 (continuing chunks start from the
    slot's state, which a graph reads on the device): steps of one or two sequences padded, or (six running) a mix of
    padded steps and eager ones."""
    for max_num_seqs in (1, 2, 6):
        llm = padded_llm(tiny_checkpoint, tiny_model, tiny_tokenizer, max_num_seqs=max_num_seqs,
                         max_num_batched_tokens=budget)  # fmt: skip
        outs = llm.generate(prompts, greedy())
        assert [o.output_token_ids for o in outs] == greedy_alone, max_num_seqs
        assert llm.engine.is_idle_and_clean()
        if max_num_seqs <= 2:  # every prefill step fits a bucket
            assert sum(llm.replayed.values()) >= sum(-(-n // budget) for n in PROMPT_LENGTHS) / max_num_seqs
        if max_num_seqs == 1 and budget == 8192:  # each prompt alone: 1, 5, 16 → 16, 17 → 32, 33 → 48, 70 → 96
            assert llm.replayed == {16: 3, 32: 1, 48: 1, 96: 1}


def test_padded_prefill_under_preemption(tiny_checkpoint, tiny_model, tiny_tokenizer, prompts, greedy_alone):
    """Two usable slots and 21 usable pages of 4 tokens (the longest request's 80 tokens): sequences are preempted
    and recomputed through padded prefill steps (their generated tokens included), and every request still gets its
    unbatched tokens."""
    llm = padded_llm(tiny_checkpoint, tiny_model, tiny_tokenizer, num_pages=22, num_slots=3, max_model_len=84)
    many = prompts + prompts[::-1]
    outs = llm.generate(many, greedy())
    assert [o.output_token_ids for o in outs] == greedy_alone + greedy_alone[::-1]
    assert llm.engine.scheduler.num_preemptions > 0 and sum(llm.replayed.values()) > len(many) / 2
    assert llm.engine.is_idle_and_clean()


def test_padded_prefill_keeps_seeded_sampling_and_logprobs(tiny_checkpoint, tiny_model, tiny_tokenizer, prompts):
    params = [SamplingParams(temperature=1.0, top_p=0.9, max_tokens=MAX_TOKENS, seed=100 + i, ignore_eos=True,
                             logprobs=2 if i % 2 else None) for i in range(len(prompts))]  # fmt: skip
    eager = make_llm(tiny_checkpoint, tiny_model, tiny_tokenizer, max_model_len=160).generate(prompts, params)
    llm = padded_llm(tiny_checkpoint, tiny_model, tiny_tokenizer, max_num_seqs=2)
    padded = llm.generate(prompts, params)
    assert sum(llm.replayed.values()) >= len(prompts) / 2
    assert [o.output_token_ids for o in padded] == [o.output_token_ids for o in eager]
    for want, got in zip(eager, padded, strict=True):
        assert (want.logprobs is None) == (got.logprobs is None)
        for a, b in zip(want.logprobs or [], got.logprobs or [], strict=True):
            assert a.token_id == b.token_id and b.logprob == pytest.approx(a.logprob, abs=1e-5)


def test_padded_prefill_catches_the_draft_up_as_the_eager_step(
    tiny_checkpoint, tiny_model, tiny_tokenizer, prompts, greedy_alone, tmp_path
):
    """Speculating, the padded step's catch-up (graph B: the draft over the step's tokens, the sampled one last) leaves
    the draft where the eager step does: the same drafts are accepted, and greedy output is plain greedy."""
    draft = str(make_draft_checkpoint(tiny_checkpoint, tmp_path / "draft", seed=2, draft_vocab_size=200))
    args = dict(draft=draft, spec_topk=1, spec_steps=3, spec_adaptive=False, max_num_batched_tokens=40, max_num_seqs=2)
    eager = make_llm(tiny_checkpoint, tiny_model, tiny_tokenizer, max_model_len=160, **args)
    padded = padded_llm(tiny_checkpoint, tiny_model, tiny_tokenizer, **args)
    want = eager.generate(prompts, greedy())
    got = padded.generate(prompts, greedy())
    assert [o.output_token_ids for o in want] == greedy_alone
    assert [o.output_token_ids for o in got] == greedy_alone
    assert sum(padded.replayed.values()) >= len(prompts)
    stats = padded.engine.spec_stats
    assert stats.num_verify_steps > 0 and stats.as_dict() == eager.engine.spec_stats.as_dict() | {
        k: v for k, v in stats.as_dict().items() if "ms" in k
    }
    assert padded.engine.is_idle_and_clean()
    # Speculation off (the bucket's rows hold no draft row then), then back on: the same greedy tokens.
    for enabled in (False, True):
        padded.engine.set_speculation(enabled)
        assert [o.output_token_ids for o in padded.generate(prompts[:3], greedy())] == greedy_alone[:3]


def test_which_steps_replay_a_bucket(tiny_checkpoint, tiny_model, tiny_tokenizer, prompts):
    llm = padded_llm(tiny_checkpoint, tiny_model, tiny_tokenizer)
    engine = llm.engine
    graphs = engine.runner.prefill_graphs

    def batch_of(*lengths, **params):
        seqs = []
        for i, n in enumerate(lengths):
            engine.add_request(f"r{i}", prompts[4][:n], SamplingParams(max_tokens=1, **params))
            seqs.append(engine._requests[f"r{i}"])
        batch = Batch(Phase.PREFILL, seqs, list(lengths))
        for seq in seqs:
            engine.abort_request(seq.request_id)
        return batch

    assert graphs.bucket(batch_of(16)) == 16
    assert graphs.bucket(batch_of(17)) == 32
    assert graphs.bucket(batch_of(40, 50)) == 96
    assert graphs.bucket(batch_of(60, 40)) is None  # 100 tokens: past the largest bucket
    assert graphs.bucket(batch_of(3, 3, 3)) is None  # three sequences: past max_seqs
    assert graphs.bucket(batch_of(3, logprobs=1)) == 16  # from the graph's logits
    assert graphs.bucket(batch_of(3, prompt_logprobs=1)) is None  # every position's: the eager step's hidden states


def test_padded_rows_and_chunk_table(tiny_checkpoint, tiny_model, tiny_tokenizer, prompts):
    """A bucket's rows: the real tokens, then the padding sequence (slot 0, positions from 0) in the last row; empty
    rows between; the chunk table padded to ceil(T_b / 64) + N_b rows with chunks past the padding sequence's end."""
    llm = padded_llm(tiny_checkpoint, tiny_model, tiny_tokenizer)
    engine = llm.engine
    engine.add_request("a", prompts[4], SamplingParams(max_tokens=1))
    seq = engine._requests["a"]
    host, layout = engine.runner.prefill_host_rows(Batch(Phase.PREFILL, [seq], [70]), np.array([5]), padded=(96, 3))
    assert (layout.num_tokens, layout.num_seqs, layout.max_seqlen_q) == (96, 3, 96)
    assert layout.num_chunks == 2 + 3 and layout.num_cols == engine.plan.max_pages_per_seq
    np.testing.assert_array_equal(host[0, :70], prompts[4])
    np.testing.assert_array_equal(host[1, 70:96], np.arange(26))  # the padding sequence's positions
    np.testing.assert_array_equal(host[2, :96], [0] * 70 + [2] * 26)  # owners
    np.testing.assert_array_equal(host[3, :4], [0, 70, 70, 96])  # cu_seqlens: row 1 empty
    np.testing.assert_array_equal(host[5, :3], [5, 0, 0])  # slots
    np.testing.assert_array_equal(host[7:9, :5].T, [[0, 0], [0, 1], [2, 0], [2, 1], [2, 2]])
    assert CHUNK_SIZE == 64
    engine.abort_request("a")


def test_bucket_lists():
    assert prefill_buckets(0, 8192) == []
    assert prefill_buckets(1024, 8192) == [16, 32, 64, 128, 256, 384, 512, 768, 1024]
    assert prefill_buckets(1000, 8192)[-2:] == [768, 1000]
    assert prefill_buckets(4096, 600) == [16, 32, 64, 128, 256, 384, 512, 600]
    assert prefill_buckets(8, 8192) == [] and prefill_buckets(2048, 7) == []  # under the smallest bucket: eager
    config = EngineConfig(prefill_graph_max_tokens=2048)
    assert config.prefill_graph_buckets(4096)[-1] == 2048
    assert config.prefill_graph_buckets(300)[-2:] == [256, 300]  # no padding sequence longer than a sequence may be
    assert EngineConfig(enforce_eager=True).prefill_graph_buckets(4096) == []
    assert EngineConfig(prefill_graph_max_tokens=0).prefill_graph_buckets(4096) == []
    assert EngineConfig(tensor_parallel_size=2).prefill_graph_buckets(4096) == []
    with pytest.raises(ValueError, match="prefill_graph_max_tokens"):
        EngineConfig(prefill_graph_max_tokens=-1)


def test_a_model_without_attn_layers_speculates_eagerly_and_padded(tmp_path, prompts):
    """The draft's prefill catch-up takes the step's `attn` K/V metadata (its pages are those layers'); a model of
    JetBlocks and sliding-window layers alone has none, so the catch-up builds its own (eager steps) and a padded step
    has no bucket. Greedy speculative output stays plain greedy either way."""
    config = preset_config("tiny") | {"layer_types": ["jet", "swa", "jet", "swa"]}
    checkpoint = make_checkpoint(config, tmp_path / "no-attn", seed=3)
    model = load_model(checkpoint, dtype="float32", device="cpu")
    tokenizer = load_tokenizer(checkpoint)
    want = [generate_tokens(model, p, MAX_TOKENS).token_ids for p in prompts[:4]]
    draft = str(make_draft_checkpoint(checkpoint, tmp_path / "draft", seed=2, draft_vocab_size=200))
    args = dict(draft=draft, spec_topk=1, spec_steps=3, spec_adaptive=False, max_num_seqs=2)
    for padded in (False, True):
        if padded:
            llm = padded_llm(checkpoint, model, tokenizer, **args)
        else:
            llm = make_llm(checkpoint, model, tokenizer, max_model_len=160, **args)
        assert not llm.engine.runner.has_attn
        outs = llm.generate(prompts[:4], greedy())
        assert [o.output_token_ids for o in outs] == want
        assert llm.engine.spec_stats.num_verify_steps > 0
        if padded:
            assert llm.replayed == {}
