"""Speculative decoding on CUDA with the Triton ops: graph replay of the draft, verify and catch-up steps equals their
eager run for every bucket; the engine with graphs equals the engine without; speculative output agrees with plain
greedy (tiny fp32; a 4-layer model of the real 2B shapes in fp32 with forced drafts, exactly; the trained default model
and its draft in bf16, on ≥ 99.5% of tokens)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from jetserve.engine import graph_split
from jetserve.engine.bench_offline import random_model
from jetserve.engine.config import EngineConfig
from jetserve.engine.engine import LLMEngine
from jetserve.engine.speculative import FIRST_GUESS_MAX_POSITIONS, flush_block_size, flush_block_views
from jetserve.model.loader import load_model
from jetserve.sampling_params import SamplingParams
from jetserve.spec.eagle3 import make_draft_checkpoint, random_draft_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

MAX_TOKENS = 24
PROMPT_LENGTHS = (1, 5, 17, 33, 300, 64, 9, 128)
CHAIN = dict(spec_topk=1, spec_steps=4)
TREE = dict(spec_topk=2, spec_steps=3, spec_num_draft_tokens=6)


@pytest.fixture(scope="module")
def gpu_model(tiny_checkpoint):
    return load_model(tiny_checkpoint, dtype="float32", device="cuda")


@pytest.fixture(scope="module")
def draft_dir(tiny_checkpoint, tmp_path_factory):
    return str(make_draft_checkpoint(tiny_checkpoint, tmp_path_factory.mktemp("draft"), seed=2, draft_vocab_size=200))


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def make_engine(tiny_checkpoint, gpu_model, **engine_args) -> LLMEngine:
    forced = engine_args.pop("forced", None)
    args = dict(device="cuda", page_size=16, num_pages=512, num_slots=17, max_num_seqs=16, max_model_len=512)
    config = EngineConfig(model=str(tiny_checkpoint), **(args | engine_args))
    return LLMEngine(config, model=gpu_model, tokenizer=None, forced_acceptance=forced)


def run(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out.output_token_ids
    assert engine.is_idle_and_clean()
    return [final[str(i)] for i in range(len(prompts))]


def prefix_agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Share of tokens before the first difference (the rest follow a different text and are not comparable)."""
    same = 0
    for x, y in zip(a, b, strict=True):
        n = next((i for i, (s, t) in enumerate(zip(x, y, strict=True)) if s != t), len(x))
        same += n
    return same / sum(len(x) for x in a)


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.mark.parametrize("shape", [CHAIN, TREE], ids=["chain", "tree"])
@pytest.mark.parametrize("forced", [None, "right"])
def test_gpu_speculative_graphs_equal_eager_and_agree_with_plain(
    tiny_checkpoint, gpu_model, draft_dir, prompts, shape, forced
):
    """Eager, graphs with verify steps launched ahead (overlap scheduling), and graphs one verify step at a time
    (which drafts each verify step's trees during the step before, same rows) give the same tokens."""
    plain = run(make_engine(tiny_checkpoint, gpu_model, enforce_eager=True), prompts, greedy())
    runs = {}
    for eager, overlap in ((True, True), (False, True), (False, False)):
        engine = make_engine(tiny_checkpoint, gpu_model, draft=draft_dir, spec_adaptive=False, enforce_eager=eager,
                             forced=forced, overlap_scheduling=overlap, **shape)  # fmt: skip
        assert (engine.spec.graphs is None) == eager
        for i, (p, c) in enumerate(zip(prompts, plain, strict=True)):
            engine.spec.forced_continuations[str(i)] = p + c
        runs[eager, overlap] = run(engine, prompts, greedy())
        assert engine.num_verify_steps > 0
        assert (engine.spec_stats.num_verify_steps_ahead > 0) == overlap
        if not overlap:
            assert engine.spec.graphs.num_drafts_ahead[0] > 0
        if forced == "right":
            assert engine.spec_stats.acceptance_rate_per_depth[0] >= 0.95
    assert runs[True, True] == runs[False, True] == runs[False, False]
    # Verify kernels and decode kernels round differently (fla's chunk kernel uses TF32 on Hopper even in fp32).
    assert prefix_agreement(runs[False, True], plain) >= 0.9


@pytest.mark.parametrize("forced", ["right", "wrong"])
def test_gpu_shadow_explorations_through_the_graphs(tiny_checkpoint, gpu_model, draft_dir, prompts, forced):
    """Shadow explorations (`SpecDecoder.shadow_draft`) with the captured draft and catch-up graphs, every plain step
    launched ahead exploring the chain: the tokens are plain decoding's, and the drafts score as verification would
    (forced right: the chain's depth wherever the tokens reach; wrong: none), with nothing verified."""
    plain = run(make_engine(tiny_checkpoint, gpu_model), prompts, greedy())  # with its decode graphs
    engine = make_engine(tiny_checkpoint, gpu_model, draft=draft_dir, forced=forced, **CHAIN)
    assert engine.spec.graphs is not None
    for i, (p, c) in enumerate(zip(prompts, plain, strict=True)):
        engine.spec.forced_continuations[str(i)] = p + c + [0] * CHAIN["spec_steps"]
    policy = engine.spec.policy
    for bucket in (1, 2, 4, 8):
        for _ in range(5):
            policy.record_step(0, bucket, 1.0)
            policy.record_step(-1, bucket, 1e-3)
    script = itertools.chain([-1], itertools.repeat(0))  # the first decode step plain, from the host; then the chain
    policy.choose = lambda num_seqs: next(script)
    policy.shadows = lambda option, bucket: True
    outs = run(engine, prompts, greedy())
    stats = engine.spec_stats
    assert stats.num_verify_steps == 0 and stats.num_shadow_drafts >= len(prompts) * (MAX_TOKENS - 8)
    assert outs == plain  # the speculating engine's plain steps are plain decoding's (same kernels, same graphs)
    if forced == "right":  # every draft whose positions were all emitted accepts the whole chain
        assert stats.num_shadow_accepted >= 0.9 * CHAIN["spec_steps"] * stats.num_shadow_drafts
    else:
        assert stats.num_shadow_accepted == 0


def _random_caches(engine: LLMEngine, gen: torch.Generator) -> list[torch.Tensor]:
    tensors = [engine.state_pool.conv_states, engine.state_pool.recurrent_states, engine.spec.k_cache,
               engine.spec.v_cache, engine.spec.last_hidden]  # fmt: skip
    tensors += [t for pair in engine.runner.kv_caches.values() for t in pair] + [engine.spec.missed_features]
    for t in tensors:
        t.copy_(torch.randn(t.shape, generator=gen, device="cuda").to(t.dtype) * 0.5)
    return tensors


@torch.inference_mode()
@pytest.mark.parametrize("greedy_rows", [True, False])
def test_gpu_spec_graph_replay_equals_eager(tiny_checkpoint, gpu_model, draft_dir, greedy_rows):
    """Every bucket and draft shape: drafting and verify (acceptance, commit, catch-up) replayed from the graphs give
    the eager result and leave the same caches, for N = B and N = B - 1 (padded) rows; so does the catch-up on what
    plain steps skipped (the flush graphs), with 0 to a ring's length (32 here) or to SHORT_FLUSH_WIDTH positions a
    row, and the draft's first guesses the flush graphs within FIRST_GUESS_MAX_POSITIONS take."""
    engine = make_engine(tiny_checkpoint, gpu_model, draft=draft_dir, spec_topk=2, spec_steps=3,
                         spec_num_draft_tokens=6, num_slots=40, max_num_seqs=32, spec_feature_ring=32)  # fmt: skip
    spec, graphs = engine.spec, engine.spec.graphs
    assert graphs is not None and graphs.batch_sizes == [1, 2, 4, 8, 16, 32]
    # every flush, draft and verify graph from one capture (engine.graph_split), beside the decode graphs' own
    assert all(isinstance(g, graph_split.SplitGraph) for g in graphs.graphs.values())
    assert len({id(g.keep_alive) for g in graphs.graphs.values()}) == 1
    decode = engine.runner.graph_runner.graphs.values()
    assert {id(g.keep_alive) for g in decode}.isdisjoint(id(g.keep_alive) for g in graphs.graphs.values())
    gen = torch.Generator(device="cuda").manual_seed(0)
    caches = _random_caches(engine, gen)
    # Every slot owns the pages of a 200-token sequence.
    pages_per_seq = 13
    table = engine.runner.block_table
    table.zero_()
    table[1:, :pages_per_seq] = torch.arange(1, 1 + 39 * pages_per_seq, dtype=torch.int32, device="cuda").view(39, -1)
    sampler = engine.runner.sampler
    for slot in range(1, 40):
        sampler.set_slot(slot, SamplingParams(temperature=0.0 if greedy_rows else 0.9, top_k=20, seed=slot), slot)
    sampler.sync()

    def check_caches(eager_caches, label):
        for i, (g, e) in enumerate(zip(caches, eager_caches, strict=True)):
            # Slot 0 / page 0 take the padded rows' writes, which differ between N and the bucket.
            rows = g[:, 1:] if i < 2 else g[1:]
            ref = e[:, 1:] if i < 2 else e[1:]
            torch.testing.assert_close(rows, ref, rtol=1e-5, atol=1e-5, msg=f"cache {i} {label}")

    for B in graphs.batch_sizes:
        for N in sorted({B, max(1, B - 1)}):
            for width in graphs.flush_widths:  # the short rows (SHORT_FLUSH_WIDTH) and a ring's
                slots = torch.randperm(39, generator=gen, device="cuda")[:N] + 1
                ids = torch.randint(0, engine.model_config.vocab_size, (N, width), generator=gen, device="cuda")
                starts = torch.randint(20, 150, (N,), generator=gen, device="cuda")
                valid = torch.randint(0, width + 1, (N,), generator=gen, device="cuda")
                before = [t.clone() for t in caches]
                guesses = torch.empty_like(ids)
                spec.flush_rows(ids, starts, valid, slots, guesses)
                eager_caches = [t.clone() for t in caches]
                for t, saved in zip(caches, before, strict=True):
                    t.copy_(saved)
                block = np.zeros(flush_block_size(B, width), dtype=np.int64)  # the rows padded to the bucket
                for view, rows in zip(flush_block_views(block, B, width), (ids, starts, valid, slots), strict=True):
                    view[:N] = rows.cpu().numpy()
                graph_guesses = graphs.flush(block, B, width)
                graph_guesses = None if graph_guesses is None else graph_guesses[:N]
                check_caches(eager_caches, f"flush B={B} N={N} width={width}")
                if graph_guesses is not None:  # the draft's first guesses (FIRST_GUESS_MAX_POSITIONS); a padded
                    # bucket's GEMM tiles may round differently, which can flip an argmax at a near-tie
                    differ = (graph_guesses != guesses).float().mean().item()
                    assert differ <= 1e-2, f"first guesses B={B} N={N} width={width}: {differ:.2%} differ"
                assert (graph_guesses is None) == (B * width > FIRST_GUESS_MAX_POSITIONS)
            for shape in range(len(spec.shapes)):
                slots = torch.randperm(39, generator=gen, device="cuda")[:N] + 1
                prefix = torch.randint(20, 190, (N,), generator=gen, device="cuda")
                roots = torch.randint(0, engine.model_config.vocab_size, (N,), generator=gen, device="cuda")
                before = [t.clone() for t in caches]
                tree = spec.draft_tree(shape, roots, prefix, slots)
                sampling = None if greedy_rows else spec.runner.sampler.rows(slots, prefix + 1)
                eager = spec.verify(shape, tree, prefix, slots, sampling).clone()
                eager_caches = [t.clone() for t in caches]
                for t, saved in zip(caches, before, strict=True):
                    t.copy_(saved)
                graph_tree = graphs.draft(shape, torch.stack([roots, prefix, slots]))
                assert torch.equal(graph_tree.tokens, tree.tokens) and torch.equal(graph_tree.parents, tree.parents)
                replayed = graphs.verify(shape, N, greedy_rows).clone()
                assert torch.equal(replayed, eager), f"B={B} N={N} shape={shape}"
                check_caches(eager_caches, f"B={B} N={N} shape={shape}")


def _forced_2b_runs(dtype: str, forced: str, prompt_lengths: tuple[int, ...], **shape) -> tuple[LLMEngine, list, list]:
    """4 layers of the real 2B shapes with a random draft: the prompts decoded plainly, then speculatively with the
    drafts forced (`forced`) to that plain run's greedy continuation, every step verified, from the CUDA graphs.
    Returns (the engine, the plain outputs, the speculative outputs)."""
    model = random_model("2b", dtype, torch.device("cuda"), seed=0, num_layers=4)
    draft = random_draft_model(model, seed=1)
    prompts = [torch.randint(0, 151936, (n,)).tolist() for n in prompt_lengths]
    config = EngineConfig(draft="random", spec_adaptive=False, device="cuda", max_num_seqs=4, max_model_len=2048,
                          gpu_memory_utilization=0.5, **shape)  # fmt: skip
    engine = LLMEngine(config, model=model, tokenizer=None, draft=draft, forced_acceptance=forced)
    assert engine.spec.graphs is not None
    engine.set_speculation(False)
    plain = run(engine, prompts, greedy())
    engine.set_speculation(True)
    for i, (p, c) in enumerate(zip(prompts, plain, strict=True)):
        engine.spec.forced_continuations[str(i)] = p + c
    return engine, plain, run(engine, prompts, greedy())


@torch.inference_mode()
@pytest.mark.parametrize("shape,min_tau", [(dict(spec_topk=1, spec_steps=5), 4.0),
                                          (dict(spec_topk=2, spec_steps=3, spec_num_draft_tokens=8), 3.0)],
                         ids=["chain", "tree"])  # fmt: skip
def test_gpu_speculative_2b_shapes_fp32_forced_right_is_exact(shape, min_tau):
    """4 layers of the real 2B shapes in fp32 (every Triton kernel and GEMM fp32-accurate: IEEE fp32, or tf32x3
    products in the skinny GEMM's tensor-core tiles and the tree verify) with a random draft forced to the plain run's
    greedy continuation: the speculative output is the plain output token for token, and nearly every draft is
    accepted. (In bf16 these random weights put the top two logits within the bf16 noise of the two paths at many
    steps, so forced drafts there measure rounding, not verify: see the trained model's test below.)"""
    engine, plain, outs = _forced_2b_runs("float32", "right", (40, 300, 7, 1000), **shape)
    assert outs == plain
    assert engine.spec_stats.mean_acceptance_length > min_tau


@torch.inference_mode()
@pytest.mark.parametrize("shape", [CHAIN, TREE], ids=["chain", "tree"])
def test_gpu_forced_all_in_bf16_accepts_every_draft_from_the_graphs(shape):
    """Forced "all" at 4 layers of the 2B shapes in bf16, from the CUDA graphs: every drafted depth accepted and the
    output the plain run's (where "right" leaves it within a few tokens: the docstring above)."""
    engine, plain, outs = _forced_2b_runs("bfloat16", "all", (40, 300, 7), **shape)
    assert outs == plain
    rates = engine.spec_stats.acceptance_rate_per_depth
    assert engine.num_verify_steps > 0 and rates and all(r == 1.0 for r in rates)


@torch.inference_mode()
def test_gpu_plain_stretches_with_catch_ups_launched_ahead_are_exact():
    """The policy scripted to plain stretches longer than the draft's feature ring (40 steps, a ring of 32) between
    verify steps, with overlap scheduling and graphs: each ring-wrap catch-up replays the flush graph queued behind the
    step in flight (no drain), and the forced-right drafts verified after each stretch give the plain output token for
    token (fp32, 4 layers of the 2B shapes, as above)."""
    model = random_model("2b", "float32", torch.device("cuda"), seed=0, num_layers=4)
    draft = random_draft_model(model, seed=1)
    prompts = [torch.randint(0, 151936, (n,)).tolist() for n in (40, 300, 7)]
    config = EngineConfig(draft="random", spec_topk=1, spec_steps=5, device="cuda", max_num_seqs=4, max_model_len=2048,
                          gpu_memory_utilization=0.5, overlap_scheduling=True, spec_feature_ring=32)  # fmt: skip
    engine = LLMEngine(config, model=model, tokenizer=None, draft=draft, forced_acceptance="right")
    params = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    engine.set_speculation(False)
    plain = run(engine, prompts, params)
    engine.set_speculation(True)
    spec = engine.spec
    for i, (p, c) in enumerate(zip(prompts, plain, strict=True)):
        spec.forced_continuations[str(i)] = p + c
    script = itertools.cycle([-1] * 40 + [0] * 2)
    spec.policy.choose = lambda num_seqs: next(script)
    planning, flushes_ahead = [False], [0]
    plan, flush = spec.plan_decode_ahead, spec.graphs.flush

    def planned(*args):  # deciding a step launched ahead of the one in flight
        planning[0] = True
        try:
            return plan(*args)
        finally:
            planning[0] = False

    def counting_flush(*args):
        flushes_ahead[0] += planning[0]
        return flush(*args)

    spec.plan_decode_ahead, spec.graphs.flush = planned, counting_flush
    outs = run(engine, prompts, params)
    assert outs == plain
    assert engine.num_verify_steps >= 4 and flushes_ahead[0] >= 2
    assert engine.spec_stats.mean_acceptance_length > 4.0


def token_agreement(a: list[list[int]], b: list[list[int]]) -> tuple[float, int]:
    """Greedy token agreement of two runs: each sequence agrees up to its first difference, which counts as one
    disagreement (after it the two follow different texts); returns (agreeing / compared, differences)."""
    same = diffs = 0
    for x, y in zip(a, b, strict=True):
        n = next((i for i, (s, t) in enumerate(zip(x, y, strict=True)) if s != t), len(x))
        same += n
        diffs += n < len(x)
    return same / (same + diffs), diffs


@torch.inference_mode()
@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_gpu_speculative_default_model_bf16_agrees_with_plain(shape):
    """The embedded trained model and its draft in bf16 on MT-bench first turns: speculative greedy agrees with plain
    greedy on ≥ 99.5% of tokens (issue 5's bf16 target), with drafts accepted (τ > 1.5)."""
    from jetserve.assets import DEFAULT_DRAFT, DEFAULT_MODEL
    from jetserve.evals.mtbench import load_questions

    spec_args = CHAIN if shape == "chain" else TREE
    config = EngineConfig(model=str(DEFAULT_MODEL), draft=str(DEFAULT_DRAFT), dtype="bfloat16", device="cuda",
                          spec_adaptive=False, max_num_seqs=80, max_model_len=1024, gpu_memory_utilization=0.3,
                          **spec_args)  # fmt: skip
    engine = LLMEngine(config)
    tok = engine.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q["turns"][0]}]))
               for q in load_questions()]  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=96, ignore_eos=True)
    engine.set_speculation(False)
    plain = run(engine, prompts, params)
    engine.set_speculation(True)
    outs = run(engine, prompts, params)
    agreement, diffs = token_agreement(outs, plain)
    print(
        f"{shape}: agreement {agreement:.4f} ({diffs} of 80 sequences part), tau "
        f"{engine.spec_stats.mean_acceptance_length:.2f}"
    )
    assert agreement >= 0.995
    assert engine.spec_stats.mean_acceptance_length > 1.5
