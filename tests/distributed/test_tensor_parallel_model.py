"""Tensor parallel 2 over gloo == one process at the model level (tiny checkpoint, fp32, StaticCache), weights
sharded while loading; and the shard plan's sizes and refusals."""

from __future__ import annotations

import pytest
import torch
from tp_ranks import greedy_run, run_ranks, tensor_parallel_greedy, verify_run

from jetserve.checkpoint import preset_config
from jetserve.config import ModelConfig
from jetserve.distributed.group import TensorParallelGroup
from jetserve.distributed.sharding import check_tensor_parallel, local_config, shard_model
from jetserve.model.jet_nemotron import JetNemotronForCausalLM
from jetserve.model.loader import load_model

PROMPTS = [[5, 17, 99, 3, 250, 41, 7], [300, 2, 64, 64, 128, 9, 11, 13, 200, 1, 77, 31]]
NUM_STEPS = 6
CHAIN = [3, 141, 59, 26]  # draft tokens after PROMPTS[1]; the first 3 nodes (root + 2 drafts) get committed
NUM_ACCEPTED = 3


@pytest.fixture(scope="module")
def single_process(tiny_checkpoint):
    model = load_model(tiny_checkpoint, dtype="float32", device="cpu")
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    return greedy_run(model, PROMPTS, NUM_STEPS), shapes, verify_run(model, PROMPTS[1], CHAIN, NUM_ACCEPTED)


@pytest.fixture(scope="module")
def two_ranks(tiny_checkpoint):
    return run_ranks(tensor_parallel_greedy, 2, str(tiny_checkpoint), PROMPTS, NUM_STEPS, CHAIN, NUM_ACCEPTED)


def test_tp2_equals_one_process(single_process, two_ranks):
    (logits, tokens), _, _ = single_process
    for rank, out in enumerate(two_ranks):
        assert out["tokens"] == tokens, f"rank {rank}"
        assert len(out["logits"]) == len(logits)
        for step, (got, want) in enumerate(zip(out["logits"], logits, strict=True)):
            assert got.shape == want.shape
            # Split sums round differently: 1e-5 relative to the logits' scale (fp32).
            atol = 1e-5 * float(want.abs().max())
            torch.testing.assert_close(got, want, rtol=1e-5, atol=atol, msg=lambda m, s=step: f"step {s}: {m}")
    # The logits are gathered, so the ranks sample from bit-identical rows.
    for a, b in zip(two_ranks[0]["logits"], two_ranks[1]["logits"], strict=True):
        assert torch.equal(a, b)


def test_tp2_verify_and_commit_equal_one_process(single_process, two_ranks):
    """A VERIFY step over a draft chain, the commit of part of it, and the decode after: same logits."""
    _, _, want = single_process
    for rank, out in enumerate(two_ranks):
        for got, ref in zip(out["verify"], want, strict=True):
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()), msg=f"rank {rank}")


def test_weights_sharded_at_load(single_process, two_ranks):
    _, full_shapes, _ = single_process
    config = ModelConfig.from_dict(preset_config("tiny"))
    jet, dh = config.jet, config.head_dim
    for rank, out in enumerate(two_ranks):
        shapes, reads = out["shapes"], out["reads"]
        assert set(shapes) == set(full_shapes)
        # Every tensor was read once, as exactly the rank's part (the loader never reads a whole sharded tensor).
        assert reads == shapes, f"rank {rank}"
        p = "model.layers.0.self_attn."  # jet
        assert shapes[p + "q_proj.weight"] == (jet.key_dim // 2, config.hidden_size)
        assert shapes[p + "v_proj.weight"] == (jet.value_dim // 2, config.hidden_size)
        assert shapes[p + "A_log"] == (jet.num_heads // 2,)
        assert (
            shapes[p + "dynamic_conv1d.kernel_generator.w1.weight"]
            == full_shapes[p + "dynamic_conv1d.kernel_generator.w1.weight"]
        )
        assert shapes[p + "dynamic_conv1d.kernel_generator.w2.weight"] == (
            jet.value_dim // 2 * jet.conv_size, jet.generator_dim,
        )  # fmt: skip
        assert shapes[p + "o_proj.weight"] == (config.hidden_size, jet.value_dim // 2)
        assert shapes[p + "o_norm.weight"] == (jet.head_v_dim,)
        p = "model.layers.3.self_attn."  # attn: 4 heads, 2 K/V heads
        assert shapes[p + "q_proj.weight"] == (2 * dh, config.hidden_size)
        assert shapes[p + "k_proj.bias"] == (dh,)
        assert shapes[p + "o_proj.weight"] == (config.hidden_size, 2 * dh)
        assert shapes["model.layers.1.mlp.down_proj.weight"] == (config.hidden_size, config.intermediate_size // 2)
        assert shapes["model.embed_tokens.weight"] == (config.vocab_size // 2, config.hidden_size)
        assert shapes["model.norm.weight"] == (config.hidden_size,)
        sharded = sum(1 for n in shapes if shapes[n] != full_shapes[n])
        assert sharded > len(shapes) // 2


def _meta_shard(config: ModelConfig, world: int, rank: int) -> JetNemotronForCausalLM:
    with torch.device("meta"):
        model = JetNemotronForCausalLM(config)
    shard_model(model, TensorParallelGroup(rank, world, torch.device("cpu")))
    return model


def test_kv_heads_replicated_beyond_their_count():
    """4 ranks over 2 K/V heads: each rank keeps one K/V head, the one its two q heads read (ranks 0,1 → head 0)."""
    config = ModelConfig.from_dict(preset_config("tiny") | {"efficient_attention_config": {
        "jet": {"num_heads": 4, "head_dim": 16, "expand_v": 2.0}, "swa": {"window_size": 16}}})  # fmt: skip
    specs_by_rank = []
    for rank in range(4):
        with torch.device("meta"):
            model = JetNemotronForCausalLM(config)
        specs_by_rank.append(shard_model(model, TensorParallelGroup(rank, 4, torch.device("cpu"))))
        attn = model.model.layers[3].self_attn
        assert (attn.num_heads, attn.num_kv_heads) == (1, 1)
        assert model.config.num_key_value_heads == 1 and model.config.jet.num_heads == 1
    k = "model.layers.3.self_attn.k_proj.weight"
    dh = config.head_dim
    assert [(s[k].start, s[k].end) for s in specs_by_rank] == [(0, dh), (0, dh), (dh, 2 * dh), (dh, 2 * dh)]
    q = "model.layers.3.self_attn.q_proj.weight"
    assert [s[q].start for s in specs_by_rank] == [0, dh, 2 * dh, 3 * dh]


def test_vocab_padded_when_not_divisible():
    config = ModelConfig.from_dict(preset_config("tiny") | {"vocab_size": 321})
    model = _meta_shard(config, 2, 1)
    spec_rows = model.model.embed_tokens.weight.shape[0]
    assert spec_rows == 161 and model.model.embed_tokens.vocab_start == 161
    assert model.config.vocab_size == 321  # logits stay whole


def test_refuses_indivisible_sizes():
    config = ModelConfig.from_dict(preset_config("tiny"))
    with pytest.raises(ValueError, match="tensor_parallel_size: 3 does not divide num_attention_heads"):
        check_tensor_parallel(config, 3)
    with pytest.raises(ValueError, match="efficient_attention_config.jet.num_heads"):
        check_tensor_parallel(config, 4)  # 4 attention heads, 2 K/V (replicated), but 2 jet heads
    two_b = ModelConfig.from_dict(preset_config("2b"))
    check_tensor_parallel(two_b, 2)
    check_tensor_parallel(two_b, 4)
    with pytest.raises(ValueError, match="num_attention_heads"):
        check_tensor_parallel(two_b, 8)
    local = local_config(ModelConfig.from_dict(preset_config("4b")), 8)
    assert (local.num_attention_heads, local.num_key_value_heads, local.jet.num_heads) == (2, 1, 2)
