"""The engine on CUDA with the Triton ops: the CPU suite's invariants, and CUDA-graph replay == eager for every
decode bucket (tiny fp32 model, and a 4-layer model of the real 2B shapes in bf16)."""

from __future__ import annotations

import pytest
import torch

from jetserve.engine import graph_split
from jetserve.engine.bench_offline import random_model
from jetserve.engine.config import EngineConfig
from jetserve.engine.engine import LLMEngine
from jetserve.generate import generate_tokens
from jetserve.llm import LLM
from jetserve.model.loader import load_model
from jetserve.sampling_params import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

MAX_TOKENS = 12
PROMPT_LENGTHS = (1, 5, 17, 33, 300)


@pytest.fixture(scope="module")
def gpu_model(tiny_checkpoint):
    return load_model(tiny_checkpoint, dtype="float32", device="cuda")


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def greedy_alone(gpu_model, prompts) -> list[list[int]]:
    return [generate_tokens(gpu_model, p, MAX_TOKENS).token_ids for p in prompts]


def make_llm(tiny_checkpoint, gpu_model, tiny_tokenizer, **engine_args) -> LLM:
    args = dict(device="cuda", page_size=16, num_pages=512, num_slots=9, max_model_len=512) | engine_args
    return LLM(str(tiny_checkpoint), model_instance=gpu_model, tokenizer=tiny_tokenizer, **args)


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.mark.parametrize("engine_args", [{}, {"enforce_eager": True}], ids=["graphs", "eager"])
def test_gpu_engine_equals_each_prompt_alone(
    tiny_checkpoint, gpu_model, tiny_tokenizer, prompts, greedy_alone, engine_args
):
    """Whole prefills then decode steps: the same kernels as the unbatched path, so the same tokens."""
    llm = make_llm(tiny_checkpoint, gpu_model, tiny_tokenizer, **engine_args)
    many = prompts + prompts[::-1]
    outs = llm.generate(many, greedy())
    assert [o.output_token_ids for o in outs] == greedy_alone + greedy_alone[::-1]
    assert llm.engine.is_idle_and_clean()


@pytest.mark.parametrize(
    "engine_args",
    [
        {"max_num_batched_tokens": 7},
        {"max_num_batched_tokens": 64, "page_size": 4, "num_pages": 80, "num_slots": 3, "max_model_len": 316},
    ],
    ids=["chunked-7", "preempting"],
)
def test_gpu_chunked_and_preempted_agree_up_to_ties(tiny_checkpoint, gpu_model, tiny_tokenizer, prompts, engine_args):
    """Chunked prefill (and decode rows riding in prefill batches) runs fla's chunk kernel, which uses TF32 on Hopper
    even in fp32 (~2e-4 relative): tokens must match until a near-tie in the reference's log-probs, if any, and the
    log-probs of the matching tokens must agree."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
    many = prompts + prompts[::-1]
    reference = make_llm(tiny_checkpoint, gpu_model, tiny_tokenizer, enforce_eager=True).generate(many, params)
    llm = make_llm(tiny_checkpoint, gpu_model, tiny_tokenizer, **engine_args)
    outs = llm.generate(many, params)
    for ref, out in zip(reference, outs, strict=True):
        for i, (a, b) in enumerate(zip(ref.logprobs, out.logprobs, strict=True)):
            if a.token_id != b.token_id:
                gap = a.top_logprobs[0] - a.top_logprobs[1]
                assert gap < 5e-3, f"tokens differ at {i} with a top-2 gap of {gap:.2e}: not a tie"
                break
            assert b.logprob == pytest.approx(a.logprob, abs=1e-2)  # seen on an H200: 2.9e-3 after 12 tokens
    if "num_slots" in engine_args:
        assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.is_idle_and_clean()


def test_gpu_seeded_sampling_matches_unbatched(tiny_checkpoint, gpu_model, tiny_tokenizer, prompts):
    expected = generate_tokens(gpu_model, prompts[3], MAX_TOKENS, 0.8, 0.9, 50, seed=77).token_ids
    llm = make_llm(tiny_checkpoint, gpu_model, tiny_tokenizer)
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=77, max_tokens=MAX_TOKENS, ignore_eos=True)
    other = SamplingParams(temperature=1.0, seed=5, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([prompts[1], prompts[3], prompts[4]], [other, params, greedy()])
    assert outs[1].output_token_ids == expected
    assert llm.engine.is_idle_and_clean()


def _snapshot(engine: LLMEngine) -> list[torch.Tensor]:
    tensors = [engine.state_pool.conv_states, engine.state_pool.recurrent_states]
    tensors += [t for pair in engine.runner.kv_caches.values() for t in pair]
    return tensors


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, rel: float, what: str) -> None:
    assert torch.isfinite(actual).all(), what
    err = (actual.float() - expected.float()).norm() / expected.float().norm().clamp_min(1e-12)
    assert err <= rel, f"{what}: relative error {err:.2e} > {rel:.0e}"


def _check_graph_buckets(engine: LLMEngine, rel: float) -> None:
    runner, graphs = engine.runner, engine.runner.graph_runner
    assert graphs is not None and graphs.graphs
    gen = torch.Generator(device="cuda").manual_seed(0)
    for tensor in _snapshot(engine):  # every cache holds finite, non-zero values
        tensor.copy_(torch.randn(tensor.shape, generator=gen, device="cuda").to(tensor.dtype) * 0.5)
    num_slots = engine.plan.num_slots
    # Every slot its own pages for the positions used below: rows sharing a page would race on the K/V writes.
    cols = 200 // engine.runner.page_size + 1
    pages = torch.randperm(engine.plan.num_pages - 1, generator=gen, device="cuda")[: num_slots * cols] + 1
    engine.runner.block_table[:, :cols] = pages.view(num_slots, cols).to(engine.runner.block_table.dtype)
    for B in graphs.batch_sizes:
        for N in sorted({B, max(1, B - 1)}):
            slots = (torch.randperm(num_slots - 1, generator=gen, device="cuda")[:N] + 1).to(torch.int32)
            positions = torch.randint(1, 200, (N,), generator=gen, device="cuda")
            input_ids = torch.randint(0, engine.model_config.vocab_size, (N,), generator=gen, device="cuda")
            before = [t.clone() for t in _snapshot(engine)]
            eager_logits = runner.decode_logits(input_ids, positions, slots).clone()
            eager_state = [t.clone() for t in _snapshot(engine)]
            for t, saved in zip(_snapshot(engine), before, strict=True):
                t.copy_(saved)
            if N == B:  # from the host, one copy into the bucket's block
                host = torch.stack([input_ids, positions, slots.long()]).cpu().numpy()
                graph_logits, used, held_slots = graphs.run_host(host)
                graph_logits = graph_logits.clone()
                assert torch.equal(used, positions) and torch.equal(held_slots.long(), slots.long()), f"host B={B}"
            else:  # from the device, a copy each and a fill of the padding
                graph_logits = graphs.run(input_ids, positions, slots).clone()
            _assert_close(graph_logits, eager_logits, rel, f"logits B={B} N={N}")
            # the argmax an all-greedy step takes instead of the sampler's
            assert torch.equal(graphs.greedy[:N], graph_logits.argmax(dim=-1)), f"greedy B={B} N={N}"
            # left behind: the next step's inputs for these rows (`run_next`), padding still padding
            next_ids, next_positions, held = graphs.inputs(B)
            assert torch.equal(graphs.used_positions[:N], positions), f"used positions B={B} N={N}"
            assert torch.equal(next_positions[:N], positions + 1), f"next positions B={B} N={N}"
            assert torch.equal(next_ids[:N], graphs.greedy[:N]), f"next tokens B={B} N={N}"
            assert not (next_ids[N:].any() or next_positions[N:].any() or held[N:].any()), f"padding B={B} N={N}"
            for i, (g, e, b) in enumerate(zip(_snapshot(engine), eager_state, before, strict=True)):
                if i >= 2:  # K/V caches: padded rows write nothing (slot_mapping -1)
                    _assert_close(g, e, rel, f"cache {i} B={B} N={N}")
                    continue
                # State pools: padded rows write only the reserved slot 0; every other slot is untouched.
                _assert_close(g[:, 1:], e[:, 1:], rel, f"state {i} B={B} N={N}")
                untouched = torch.ones(num_slots, dtype=torch.bool, device="cuda")
                untouched[slots.long()] = False
                untouched[0] = False
                assert torch.equal(g[:, untouched], b[:, untouched]), f"state {i} B={B} N={N}: padding leaked"


@torch.inference_mode()
def test_graph_replay_equals_eager_tiny(tiny_checkpoint, gpu_model, tiny_tokenizer):
    llm = make_llm(tiny_checkpoint, gpu_model, tiny_tokenizer, num_slots=40, max_num_seqs=32, num_pages=1024)
    graphs = llm.engine.runner.graph_runner
    assert graphs.batch_sizes == [1, 2, 4, 8, 16, 32]
    # all six from one capture (engine.graph_split), not one capture each
    assert all(isinstance(g, graph_split.SplitGraph) for g in graphs.graphs.values())
    assert len({id(g.keep_alive) for g in graphs.graphs.values()}) == 1
    _check_graph_buckets(llm.engine, rel=1e-5)


@torch.inference_mode()
def test_a_capture_per_bucket_replays_equal_eager(tiny_checkpoint, gpu_model, tiny_tokenizer, monkeypatch):
    monkeypatch.setenv("JETSERVE_ONE_CAPTURE", "0")
    llm = make_llm(tiny_checkpoint, gpu_model, tiny_tokenizer, num_slots=40, max_num_seqs=16, num_pages=1024)
    graphs = llm.engine.runner.graph_runner
    assert all(isinstance(g, torch.cuda.CUDAGraph) for g in graphs.graphs.values()) and len(graphs.graphs) == 5
    _check_graph_buckets(llm.engine, rel=1e-5)


@torch.inference_mode()
def test_named_buckets_replay_equal_eager(tiny_checkpoint, gpu_model, tiny_tokenizer):
    llm = make_llm(tiny_checkpoint, gpu_model, tiny_tokenizer, num_slots=40, max_num_seqs=32, num_pages=1024,
                   cuda_graph_batch_sizes="8,1,3")  # fmt: skip
    graphs = llm.engine.runner.graph_runner
    assert graphs.batch_sizes == [1, 3, 8] and sorted(graphs.graphs) == [1, 3, 8]
    assert graphs.bucket(2) == 3 and graphs.fits(8) and not graphs.fits(9)  # 9 and more decode eagerly
    _check_graph_buckets(llm.engine, rel=1e-5)


@torch.inference_mode()
def test_graph_replay_equals_eager_2b_shapes():
    model = random_model("2b", "bfloat16", torch.device("cuda"), seed=0, num_layers=4)
    assert set(model.config.layer_types) == {"jet", "attn", "swa"}
    # Caches sized for the batch, not for the device: the check clones them whole (the H200 ran out of memory
    # cloning the 65 GB that gpu_memory_utilization 0.5 gives).
    config = EngineConfig(device="cuda", max_num_seqs=48, max_model_len=2048, num_slots=49,
                          num_pages=48 * 2048 // 16 + 16)  # fmt: skip
    engine = LLMEngine(config, model=model, tokenizer=None)
    assert engine.plan.num_slots == 49 and engine.plan.num_pages > 48 * 2048 // 16
    _check_graph_buckets(engine, rel=2e-2)
    prompt = torch.randint(0, 151936, (40,)).tolist()
    engine.add_request("x", prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs[-1].finished and len(outs[-1].output_token_ids) == 8
    assert engine.is_idle_and_clean()


@torch.inference_mode()
def test_batched_decode_2b_shapes_as_close_as_reference_ops(decode_norm_calls):
    """64 rows of decode at the 2B shapes (bf16, 4 layers) take the JetBlock's batched path (the output norm in the
    delta rule's launch, o_proj a plain GEMM), which the other GPU tests check only graph against eager (the 2B-shape
    bucket of 48). Against the same weights in fp32 on the reference ops, its logits are within 1.25x (+1e-3) of the
    bf16 reference ops' own error: rounding, not a wrong path (whose error would be of order 1)."""
    from jetserve.model.fusion import fuse_projections
    from jetserve.model.jet_nemotron import cast_model
    from jetserve.model.static_cache import StaticCache
    from jetserve.ops.backend import set_backend

    model = random_model("2b", "bfloat16", torch.device("cuda"), seed=1, num_layers=4)
    exact = fuse_projections(cast_model(random_model("2b", "bfloat16", torch.device("cuda"), seed=1, num_layers=4),
                                        torch.float32))  # fmt: skip
    gen = torch.Generator().manual_seed(5)
    batch = 64
    lengths = torch.randint(3, 20, (batch,), generator=gen)
    prompts = [torch.randint(0, 151936, (int(n),), generator=gen).tolist() for n in lengths]

    def run(net) -> list[torch.Tensor]:
        cache = StaticCache(net, batch, 64)
        rows = list(range(batch))
        out = [net.compute_logits(net(cache.batch(rows, prompts)))]
        for step in range(2):
            out.append(net.compute_logits(net(cache.batch(rows, [[100 + step + i] for i in rows]))))
        return out

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a.float() - b.float()).norm() / b.float().norm())

    try:
        set_backend("reference")
        truth, reference = run(exact), run(model)
        set_backend("triton")
        got = run(model)
    finally:
        set_backend(None)
    jet_layers = sum(layer.kind == "jet" for layer in model.model.layers)
    assert jet_layers > 0 and decode_norm_calls == [True] * (2 * jet_layers)
    for step, (g, r, t) in enumerate(zip(got, reference, truth, strict=True)):
        assert torch.isfinite(g).all(), f"step {step}"
        err, floor = rel(g, t), rel(r, t)
        print(f"step {step}: Triton {err:.2e}, bf16 reference ops {floor:.2e} (relative to fp32)")
        assert err <= 1.25 * floor + 1e-3, f"step {step}: error {err:.2e} against the bf16 reference ops' {floor:.2e}"


def _prefill_snapshot(engine: LLMEngine) -> list[torch.Tensor]:
    """What PREFILL steps write: every slot's JetBlock state but the padding slot's, the K/V caches, and when
    speculating the draft's per-slot hidden state and K/V."""
    tensors = [engine.state_pool.conv_states[:, 1:], engine.state_pool.recurrent_states[:, 1:]]
    tensors += [t for pair in engine.runner.kv_caches.values() for t in pair]
    if engine.spec is not None:
        tensors += [engine.spec.last_hidden[1:], engine.spec.k_cache, engine.spec.v_cache]
    return tensors


def _check_prefill_graphs(
    make, prompts: list[list[int]], rel: float, logprob_tol: float, buckets: list[int] | None = None
) -> None:
    """Prefill every prompt (one token each, log-probs on) through an engine replaying prefill graphs and through
    one prefilling eagerly: the same first tokens (up to near-ties), log-probs and written state; `buckets`: the
    buckets the steps must have replayed, in order."""
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, logprobs=2)
    graphed, eager = make(), make(prefill_graph_max_tokens=0)
    graphs = graphed.runner.prefill_graphs
    assert graphs is not None and graphs.is_graphed and eager.runner.prefill_graphs is None
    replayed = []
    run = graphs.run
    graphs.run = lambda batch, slots, bucket: replayed.append(bucket) or run(batch, slots, bucket)
    want, got = _generate(eager, prompts, params), _generate(graphed, prompts, params)
    assert len(replayed) >= len(prompts) // 2, replayed
    assert buckets is None or replayed == buckets, replayed
    for a, b in zip(want, got, strict=True):
        x, y = a.logprobs[0], b.logprobs[0]
        if x.token_id != y.token_id:
            assert x.top_logprobs[0] - x.top_logprobs[1] < logprob_tol, "first tokens differ: not a tie"
        assert y.logprob == pytest.approx(x.logprob, abs=logprob_tol)
    for i, (g, e) in enumerate(zip(_prefill_snapshot(graphed), _prefill_snapshot(eager), strict=True)):
        _assert_close(g, e, rel, f"prefill state {i}")
    assert graphed.is_idle_and_clean()


def _generate(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> list:
    """Each prompt's final output, in order."""
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    final = {}
    while engine.has_unfinished_requests():
        final |= {out.request_id: out for out in engine.step() if out.finished}
    return [final[str(i)] for i in range(len(prompts))]


@pytest.mark.parametrize("speculating", [False, True], ids=["plain", "draft"])
@torch.inference_mode()
def test_prefill_graph_replay_equals_eager_tiny(tiny_checkpoint, gpu_model, tiny_tokenizer, tmp_path, speculating):
    """Two prompts a step (1 + 16 tokens: bucket 32; 17 + 100: 128; 300 + 480: 1024), fp32: the padded graphs
    against the unpadded eager steps (fla's chunk kernels use TF32 on Hopper either way)."""
    args = dict(max_num_seqs=2, prefill_graph_max_tokens=1024, max_model_len=1024)
    if speculating:
        from jetserve.spec.eagle3 import make_draft_checkpoint

        args |= dict(draft=str(make_draft_checkpoint(tiny_checkpoint, tmp_path / "draft", seed=2)), spec_topk=1)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (1, 16, 17, 100, 300, 480)]

    def make(**extra):
        return make_llm(tiny_checkpoint, gpu_model, tiny_tokenizer, **(args | extra)).engine

    assert make().runner.prefill_graphs.buckets == [16, 32, 64, 128, 256, 384, 512, 768, 1024]
    _check_prefill_graphs(make, prompts, rel=1e-3, logprob_tol=5e-3)


@torch.inference_mode()
def test_every_prefill_bucket_replays_equal_eager(tiny_checkpoint, gpu_model, tiny_tokenizer):
    """Each of the default buckets (16 … 2048), replayed for a prompt 3 tokens short of it, one prompt a step."""
    args = dict(max_num_seqs=1, max_model_len=2100, num_pages=1024)

    def make(**extra):
        return make_llm(tiny_checkpoint, gpu_model, tiny_tokenizer, **(args | extra)).engine

    buckets = make().runner.prefill_graphs.buckets
    assert buckets == [16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048]
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 256, (b - 3,), generator=gen).tolist() for b in buckets]
    _check_prefill_graphs(make, prompts, rel=1e-3, logprob_tol=5e-3, buckets=buckets)


@torch.inference_mode()
def test_prefill_graph_replay_equals_eager_2b_shapes():
    """A 4-layer model of the real 2B shapes, bf16, buckets up to 1024: prompts of 40, 200 and 1000 tokens."""
    model = random_model("2b", "bfloat16", torch.device("cuda"), seed=0, num_layers=4)

    def make(**extra):
        args = dict(device="cuda", max_num_seqs=2, max_model_len=1100, num_slots=3, num_pages=160,
                    prefill_graph_max_tokens=1024) | extra  # fmt: skip
        return LLMEngine(EngineConfig(**args), model=model, tokenizer=None)

    gen = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, 151936, (n,), generator=gen).tolist() for n in (40, 200, 1000)]
    _check_prefill_graphs(make, prompts, rel=2e-2, logprob_tol=5e-2)
