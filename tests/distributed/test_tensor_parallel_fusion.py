"""Projection fusion after tensor-parallel sharding: each rank's loaded (and random) shard is fused, and its greedy and
verify logits equal both its own unfused run and the unfused single process."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from tp_ranks import greedy_run, run_ranks, verify_run

from jetserve.config import ModelConfig
from jetserve.model.fusion import InputProjections
from jetserve.model.jet_nemotron import JetNemotronForCausalLM

PROMPTS = [[5, 17, 99, 3, 250, 41, 7], [300, 2, 64, 64, 128, 9, 11, 13, 200, 1, 77, 31]]
NUM_STEPS = 4
CHAIN = [3, 141, 59, 26]
NUM_ACCEPTED = 2


def _groups(model) -> list[InputProjections]:
    return [m for m in model.modules() if isinstance(m, InputProjections)]


def _is_fused(model) -> bool:
    return all(m.fused_input is not None and m.fused_input.is_current(m.input_projections()) for m in _groups(model))


def _runs(model) -> dict:
    logits, tokens = greedy_run(model, PROMPTS, NUM_STEPS)
    return {"logits": logits, "tokens": tokens, "verify": verify_run(model, PROMPTS[1], CHAIN, NUM_ACCEPTED)}


def fused_and_unfused_shards(group, checkpoint: str) -> dict:
    """Rank body: the loaded shard's runs fused and (its fused copies dropped) unfused; whether a random shard is
    fused too."""
    from jetserve.distributed.loader import load_sharded_model, random_sharded_model

    model = load_sharded_model(checkpoint, group, dtype="float32")
    is_fused = _is_fused(model)
    fused = _runs(model)
    for m in _groups(model):
        m.fused_input = None
    unfused = _runs(model)
    random_is_fused = _is_fused(random_sharded_model(ModelConfig.from_hf(checkpoint), group, "float32"))
    return {"is_fused": is_fused, "random_is_fused": random_is_fused, "fused": fused, "unfused": unfused}


def test_tp2_fused_equals_unfused(tiny_checkpoint):
    single = JetNemotronForCausalLM(ModelConfig.from_hf(tiny_checkpoint))
    single.load_state_dict(load_file(str(tiny_checkpoint / "model.safetensors")))
    want = _runs(single.eval().requires_grad_(False))
    assert not any(m.fused_input for m in _groups(single))
    for rank, out in enumerate(run_ranks(fused_and_unfused_shards, 2, str(tiny_checkpoint))):
        assert out["is_fused"] and out["random_is_fused"], f"rank {rank}"
        for got, own in zip(out["fused"]["logits"] + out["fused"]["verify"],
                            out["unfused"]["logits"] + out["unfused"]["verify"], strict=True):  # fmt: skip
            torch.testing.assert_close(got, own, rtol=1e-6, atol=1e-6, msg=f"rank {rank}")
        assert out["fused"]["tokens"] == want["tokens"], f"rank {rank}"
        for got, ref in zip(out["fused"]["logits"] + out["fused"]["verify"], want["logits"] + want["verify"],
                            strict=True):  # fmt: skip
            # Split sums round differently: 1e-5 relative to the logits' scale (fp32), as test_tensor_parallel_model.
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()), msg=f"rank {rank}")


def norm_in_decode_shard(group, checkpoint: str) -> dict:
    """Rank body: the loaded shard's greedy run, its decode steps on the Triton ops (the CPU interpreter; the prefill
    on the reference ops) with the JetBlock's output norm in the gated delta rule's decode launch (thresholds lowered
    so the tiny model's two-row steps take it; the launches counted)."""
    from jetserve.distributed.loader import load_sharded_model
    from jetserve.model import jet_block
    from jetserve.model.static_cache import StaticCache
    from jetserve.ops import gated_delta_rule
    from jetserve.ops.backend import set_backend
    from jetserve.ops.gated_delta_rule import decode

    jet_block.GEMV_MAX_ROWS = 1
    gated_delta_rule.NORM_MIN_PAIRS = 1
    calls = []
    original = decode.gated_delta_rule_decode
    decode.gated_delta_rule_decode = lambda *a, **kw: calls.append(kw.get("norm") is not None) or original(*a, **kw)
    model = load_sharded_model(checkpoint, group, dtype="float32")
    cache = StaticCache(model, num_seqs=len(PROMPTS), max_tokens=128, page_size=4)
    seq_ids, batch, all_logits = list(range(len(PROMPTS))), PROMPTS, []
    with torch.inference_mode():
        for step in range(NUM_STEPS + 1):
            set_backend("reference" if step == 0 else "triton")
            fb = cache.batch(seq_ids, batch)
            logits = model.compute_logits(model(fb)[fb.cu_seqlens[1:].long() - 1])  # [N, V]
            all_logits.append(logits.clone())
            batch = [[t] for t in logits.argmax(-1).tolist()]
    set_backend(None)
    return {"logits": all_logits, "calls": calls}


def test_tp2_output_norm_in_the_decode_launch(tiny_checkpoint):
    """Under tensor parallelism each rank's heads are whole, so the norm in the decode launch is local; o_proj's
    all-reduce and the residual add follow as for the unfused norm. Greedy logits equal the single process's."""
    from jetserve import envs

    if not envs.triton_interpret():
        pytest.skip("Triton needs a GPU or TRITON_INTERPRET=1")
    single = JetNemotronForCausalLM(ModelConfig.from_hf(tiny_checkpoint))
    single.load_state_dict(load_file(str(tiny_checkpoint / "model.safetensors")))
    logits, _ = greedy_run(single.eval().requires_grad_(False), PROMPTS, NUM_STEPS)
    jet_layers = sum(layer.kind == "jet" for layer in single.model.layers)
    for rank, out in enumerate(run_ranks(norm_in_decode_shard, 2, str(tiny_checkpoint), timeout_s=600)):
        assert out["calls"] == [True] * (jet_layers * NUM_STEPS), f"rank {rank}: {out['calls']}"  # every decode step
        assert len(out["logits"]) == len(logits)
        for got, ref in zip(out["logits"], logits, strict=True):
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()), msg=f"rank {rank}")
