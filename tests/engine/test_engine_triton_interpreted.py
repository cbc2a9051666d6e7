"""The engine on the Triton backend, in the interpreter: every op's Triton variant called the way `ModelRunner` calls it
(the K/V metadata launch for prefill, decode and verify; the draft's feature ring with a draft attached; the fused
mixer at batch 1 when asked for) generates what the reference backend generates. The GPU tests run the same paths
compiled; this runs them where CI runs."""

from __future__ import annotations

import collections

import pytest
import torch

from jetserve import envs
from jetserve.engine.config import EngineConfig
from jetserve.engine.cuda_graph import GraphRunner
from jetserve.engine.engine import LLMEngine
from jetserve.ops.backend import set_backend
from jetserve.ops.decode_inputs import kernels as decode_inputs_kernels
from jetserve.ops.feature_ring import store as feature_ring_store
from jetserve.ops.gated_delta_rule import chunk as delta_rule_chunk
from jetserve.ops.jet_mixer import decode as jet_mixer_decode
from jetserve.ops.kv_metadata import kernels as kv_metadata_kernels
from jetserve.sampling_params import SamplingParams
from jetserve.spec.eagle3 import make_draft_checkpoint

pytestmark = pytest.mark.skipif(not envs.triton_interpret(), reason="Triton variants run here in the interpreter")

ENGINE_ARGS = dict(device="cpu", page_size=4, num_pages=256, num_slots=9, max_model_len=128)


@pytest.fixture(scope="module")
def draft_dir(tiny_checkpoint, tmp_path_factory):
    return str(make_draft_checkpoint(tiny_checkpoint, tmp_path_factory.mktemp("draft"), seed=2, draft_vocab_size=200))


class _EagerGraph:
    """A captured graph's stand-in off the GPU: `replay` runs the captured body on the static buffers."""

    def __init__(self, body) -> None:
        self.replay = body


def generate(
    tiny_checkpoint, tiny_model, backend: str, prompts, mode: str, draft_dir: str, padded=None, decode_graphs=None,
    **engine_args,
):  # fmt: skip
    """(greedy tokens per request, the draft's feature ring and last hidden states or None). mode: "plain" (no
    draft), "verify" (a chain draft verified at every step) or "ready" (a draft kept ready while the policy decodes
    plainly: features into the ring, catch-ups). `padded` (buckets, max sequences): PREFILL steps padded as a prefill
    graph's (`engine.prefill_graph`), run eagerly. `decode_graphs` (buckets): DECODE steps through a `GraphRunner`
    whose graphs run their bodies eagerly on its static buffers."""
    spec = dict(draft=draft_dir, spec_topk=1, spec_steps=2, spec_feature_ring=4) if mode != "plain" else {}
    set_backend(backend)
    try:
        config = EngineConfig(model=str(tiny_checkpoint), **(ENGINE_ARGS | spec | engine_args))
        engine = LLMEngine(config, model=tiny_model, tokenizer=None)
        if padded is not None:
            engine.runner.use_prefill_graphs(*padded, capture=False)
        if decode_graphs is not None:
            graphs = GraphRunner(engine.runner, decode_graphs)
            graphs.graphs = {B: _EagerGraph(lambda B=B: graphs._step(B)) for B in graphs.batch_sizes}
            engine.runner.graph_runner = graphs
        if mode != "plain":
            engine.spec.policy.forced_option = 0 if mode == "verify" else -1
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
        out: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            for o in engine.step():
                out.setdefault(o.request_id, []).extend(o.new_token_ids)
        draft_state = (engine.spec.missed_features, engine.spec.last_hidden) if mode != "plain" else None
        return out, draft_state
    finally:
        set_backend("reference")  # the engine modules' CPU default


def count_chunk_tables(monkeypatch) -> collections.Counter:
    """Counts the chunk tables the delta rule's chunked prefill is given, call by call: "fresh", "continuing", or
    "none: cu_seqlens read back" (the op builds one itself)."""
    seen = collections.Counter()
    chunk_prefill = delta_rule_chunk.chunk_gated_delta_rule_prefill

    def counted(*args):  # the op passes its arguments positionally, the step's chunk table last
        table = args[12]
        seen.update(["none: cu_seqlens read back" if table is None else "fresh" if table.fresh else "continuing"])
        return chunk_prefill(*args)

    monkeypatch.setattr(delta_rule_chunk, "chunk_gated_delta_rule_prefill", counted)
    return seen


@pytest.mark.parametrize("mode", ["plain", "verify", "ready"])
@pytest.mark.parametrize("lone", [False, True])
def test_triton_engine_generates_what_the_reference_engine_does(
    tiny_checkpoint, tiny_model, draft_dir, monkeypatch, mode, lone
):
    """Two prompts (a batch) or one (batch 1: the fused mixer, asked for), plainly, verifying a chain draft at every
    step, or keeping the draft ready while decoding plainly; the Triton launches counted, so none is skipped, and the
    draft's ring and hidden states compared, since speculation's output is exact whatever the draft holds. The lone
    prompt's steps also run the norms in the GEMM epilogues (JETSERVE_ADD_NORM_EPILOGUE=1). Every JetBlock prefill
    takes its step's chunk table (no read of cu_seqlens back to the host a layer)."""
    monkeypatch.setenv("JETSERVE_FUSED_MIXER", "1")
    monkeypatch.setenv("JETSERVE_ADD_NORM_EPILOGUE", "1" if lone else "0")
    calls = collections.Counter()
    for module, name in ((kv_metadata_kernels, "kv_metadata"), (feature_ring_store, "store_features"),
                         (jet_mixer_decode, "jet_mixer_decode")):  # fmt: skip
        original = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _f=original, _n=name, **k: calls.update([_n]) or _f(*a, **k))
    tables = count_chunk_tables(monkeypatch)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (9, 5)][: 1 if lone else 2]
    want, want_draft = generate(tiny_checkpoint, tiny_model, "reference", prompts, mode, draft_dir)
    assert not calls
    got, got_draft = generate(tiny_checkpoint, tiny_model, "triton", prompts, mode, draft_dir)
    assert got == want and all(len(tokens) == 6 for tokens in got.values())
    if mode != "plain":  # greedy output is exact whatever the draft holds: compare what it holds
        for a, b in zip(got_draft, want_draft, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert calls["kv_metadata"] > 0
    # Every JetBlock layer of a PREFILL step takes the step's chunk table: none reads the device back for it.
    assert tables["fresh"] + tables["continuing"] > 0 and tables["none: cu_seqlens read back"] == 0
    assert (calls["store_features"] > 0) == (mode == "ready")
    assert (calls["jet_mixer_decode"] > 0) == (lone and mode != "verify")


def test_chunked_prefill_continues_from_the_stored_state(tiny_checkpoint, tiny_model, draft_dir, monkeypatch):
    """A prompt prefilled in chunks of 4 tokens: the first chunk's table is `fresh` (no stored state to read), the
    later ones are not (they continue from the slot's state), and the Triton engine generates what the reference one
    does — a later chunk started from zeros would not."""
    seen = count_chunk_tables(monkeypatch)
    prompt = torch.randint(0, 256, (11,), generator=torch.Generator().manual_seed(8)).tolist()
    want, _ = generate(tiny_checkpoint, tiny_model, "reference", [prompt], "plain", draft_dir, max_num_batched_tokens=4)
    got, _ = generate(tiny_checkpoint, tiny_model, "triton", [prompt], "plain", draft_dir, max_num_batched_tokens=4)
    assert got == want
    assert seen["fresh"] > 0 and seen["continuing"] > 0, seen


@pytest.mark.parametrize("mode", ["plain", "ready"])
def test_padded_prefill_steps_on_the_triton_ops(tiny_checkpoint, tiny_model, draft_dir, monkeypatch, mode):
    """A prefill graph's padded steps (`engine.prefill_graph`, run eagerly) on the Triton ops: the varlen conv, fla's
    chunk kernels with the table padded past the padding sequence's end, the attention over the padding sequence in
    slot 0 and the K/V metadata of padded rows — two prompts in one step of bucket 16, then chunks of 6 continuing
    from the slots' states — generate what the reference engine does unpadded, and leave the draft as it does."""
    seen = count_chunk_tables(monkeypatch)
    gen = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (9, 5)]
    for budget in (8192, 6):
        args = dict(max_num_batched_tokens=budget)
        want, want_draft = generate(tiny_checkpoint, tiny_model, "reference", prompts, mode, draft_dir, **args)
        got, got_draft = generate(tiny_checkpoint, tiny_model, "triton", prompts, mode, draft_dir, ([16], 2), **args)
        assert got == want, budget
        if mode != "plain":  # every slot's but the padding slot's, which the padded rows write
            for a, b in zip(got_draft, want_draft, strict=True):
                torch.testing.assert_close(a[1:], b[1:], rtol=1e-4, atol=1e-4)
    # Every padded step's table continues (a graph's never says fresh), and none is read back.
    assert seen["continuing"] > 0 and seen["fresh"] == 0 and seen["none: cu_seqlens read back"] == 0, seen


@pytest.mark.parametrize("mode", ["plain", "ready"])
def test_decode_graph_path_on_the_triton_ops(tiny_checkpoint, tiny_model, draft_dir, monkeypatch, mode):
    """Decode steps through the graph path (`GraphRunner`, buckets 1, 2 and 4, bodies run eagerly) on the Triton ops:
    three prompts in bucket 4 with a padding row, then two and one as they finish. The steps' inputs come from the
    host in one block (`run_host`: the slots as int32 in an int64 row) or are left by the step before
    (`advance_decode_inputs`, launched at the end of every body; steps launched ahead only replay), and the tokens and
    the draft's ring are the reference engine's without graphs."""
    calls = collections.Counter()
    advance = decode_inputs_kernels.advance_decode_inputs
    monkeypatch.setattr(decode_inputs_kernels, "advance_decode_inputs",
                        lambda *a: calls.update(["advance"]) or advance(*a))  # fmt: skip
    gen = torch.Generator().manual_seed(10)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (9, 5, 3)]
    want, want_draft = generate(tiny_checkpoint, tiny_model, "reference", prompts, mode, draft_dir)
    assert not calls
    got, got_draft = generate(tiny_checkpoint, tiny_model, "triton", prompts, mode, draft_dir, decode_graphs=[1, 2, 4])
    assert got == want and all(len(tokens) == 6 for tokens in got.values())
    assert calls["advance"] >= 5  # every decode step of the three requests went through a graph body
    if mode != "plain":  # every slot's but the padding slot's, which the padded row writes
        for a, b in zip(got_draft, want_draft, strict=True):
            torch.testing.assert_close(a[1:], b[1:], rtol=1e-4, atol=1e-4)
