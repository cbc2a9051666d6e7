"""EAGLE-3 draft model: SpecForge-layout checkpoints load unchanged, mismatches are clear errors, and the forward on the
tiny target's features matches a dense PyTorch formulation in every phase (prefill, decode, tree verify)."""

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from jetserve.checkpoint import make_checkpoint
from jetserve.model.forward_batch import ForwardBatch, KVMetadata, Phase
from jetserve.model.loader import load_model
from jetserve.model.static_cache import StaticCache
from jetserve.spec.eagle3 import load_draft_model, make_draft_checkpoint

# The tensor names of SpecForge's LlamaForCausalLMEagle3 state dict (embedding excluded, as SpecForge saves it).
SPECFORGE_NAMES = {
    "fc.weight",
    "midlayer.input_layernorm.weight",
    "midlayer.hidden_norm.weight",
    "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight",
    "midlayer.post_attention_layernorm.weight",
    "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight",
    "norm.weight",
    "lm_head.weight",
    "d2t",
    "t2d",
}
DRAFT_VOCAB = 100
PAGE = 8


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return make_checkpoint("tiny", tmp_path_factory.mktemp("tiny_target"), seed=0)


@pytest.fixture(scope="module")
def target(target_dir):
    return load_model(target_dir, dtype="float32")


@pytest.fixture(scope="module")
def draft_dir(target_dir, tmp_path_factory):
    return make_draft_checkpoint(target_dir, tmp_path_factory.mktemp("draft"), seed=1, draft_vocab_size=DRAFT_VOCAB)


@pytest.fixture(scope="module")
def draft(draft_dir, target):
    return load_draft_model(draft_dir, target)


def _copy_with(draft_dir, out, config_update=None, tensors_update=None, drop=(), as_bin=False):
    """A copy of the draft checkpoint with config keys / tensors changed."""
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((draft_dir / "config.json").read_text())
    config.update(config_update or {})
    (out / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(draft_dir / "model.safetensors"))
    tensors.update(tensors_update or {})
    for name in drop:
        del tensors[name]
    if as_bin:
        torch.save(tensors, out / "pytorch_model.bin")
    else:
        save_file(tensors, str(out / "model.safetensors"))
    return out


def test_random_draft_has_the_specforge_layout(draft_dir, target):
    tensors = load_file(str(draft_dir / "model.safetensors"))
    assert set(tensors) == SPECFORGE_NAMES
    config = json.loads((draft_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == DRAFT_VOCAB
    H = target.config.hidden_size
    assert tensors["fc.weight"].shape == (H, 3 * H)
    assert tensors["midlayer.self_attn.q_proj.weight"].shape[1] == 2 * H
    assert tensors["lm_head.weight"].shape == (DRAFT_VOCAB, H)
    d2t, t2d = tensors["d2t"], tensors["t2d"]
    assert t2d.dtype == torch.bool and int(t2d.sum()) == DRAFT_VOCAB
    assert torch.equal(torch.nonzero(t2d).squeeze(1), torch.arange(DRAFT_VOCAB) + d2t)


def test_loads_safetensors_and_bin_identically_and_shares_embedding(draft, draft_dir, target, tmp_path):
    assert draft.embed_tokens is None
    ids = torch.tensor([3, 100, 7])
    assert torch.equal(draft.embed(ids), target.model.embed_tokens(ids))
    from_bin = load_draft_model(_copy_with(draft_dir, tmp_path / "bin", as_bin=True), target)
    for (name, a), (_, b) in zip(draft.state_dict().items(), from_bin.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    assert draft.feature_layers == (2, 2, 1)  # tiny target (4 layers): ids [1, 1, 0] + 1
    assert draft.capture_layers == (1, 2)


def test_ships_own_embedding(draft_dir, target, tmp_path):
    H, V = target.config.hidden_size, target.config.vocab_size
    own = torch.randn(V, H)
    model = load_draft_model(_copy_with(draft_dir, tmp_path / "emb", tensors_update={"embed_tokens.weight": own}),
                             target)  # fmt: skip
    assert torch.equal(model.embed(torch.tensor([5])), own[5:6])


@pytest.mark.parametrize(
    "config_update, match",
    [
        ({"target_hidden_size": 96}, "target_hidden_size"),
        ({"vocab_size": 400}, "vocab_size"),
        ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 3]}}, "eagle_aux_hidden_state_layer_ids"),
        ({"num_hidden_layers": 2}, "num_hidden_layers"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling"),
    ],
)
def test_config_mismatch_is_a_clear_error(draft_dir, target, tmp_path, config_update, match):
    with pytest.raises(ValueError, match=match):
        load_draft_model(_copy_with(draft_dir, tmp_path / "bad", config_update=config_update), target)


def test_hidden_size_mismatch_without_own_embedding(draft_dir, target, tmp_path):
    bad = _copy_with(draft_dir, tmp_path / "hidden", config_update={"hidden_size": 32, "target_hidden_size": 64})
    with pytest.raises(ValueError, match="hidden_size: 32 differs"):
        load_draft_model(bad, target)


def test_target_with_another_vocabulary_is_rejected(draft_dir, tmp_path):
    other = load_model(make_checkpoint("tiny", tmp_path / "t400", vocab_size=400), dtype="float32")
    with pytest.raises(ValueError, match="vocab_size: 320 differs from the target's vocab_size 400"):
        load_draft_model(draft_dir, other)


def test_missing_or_misshapen_tensors(draft_dir, target, tmp_path):
    with pytest.raises(ValueError, match="missing tensor.*d2t"):
        load_draft_model(_copy_with(draft_dir, tmp_path / "nod2t", drop=("d2t",)), target)
    with pytest.raises(ValueError, match="fc.weight has shape"):
        load_draft_model(_copy_with(draft_dir, tmp_path / "fc", tensors_update={"fc.weight": torch.zeros(64, 128)}),
                         target)  # fmt: skip
    with pytest.raises(ValueError, match="d2t maps"):
        bad_d2t = torch.full((DRAFT_VOCAB,), 1000, dtype=torch.int64)
        load_draft_model(_copy_with(draft_dir, tmp_path / "d2t", tensors_update={"d2t": bad_d2t}), target)
    with pytest.raises(ValueError, match="does not have: midlayer.extra"):
        extra = {"midlayer.extra.weight": torch.zeros(2)}
        load_draft_model(_copy_with(draft_dir, tmp_path / "extra", tensors_update=extra), target)


def test_full_draft_vocabulary_needs_no_maps(draft_dir, target, tmp_path):
    V = target.config.vocab_size
    lm_head = torch.randn(V, target.config.hidden_size)
    full = _copy_with(draft_dir, tmp_path / "full", config_update={"draft_vocab_size": V},
                      tensors_update={"lm_head.weight": lm_head}, drop=("d2t", "t2d"))  # fmt: skip
    model = load_draft_model(full, target)
    assert torch.equal(model.draft_to_target(torch.arange(V)), torch.arange(V))


# ---- forward ---------------------------------------------------------------------------------------------------


class DraftCache:
    """The draft's own paged K/V for a few sequences, with hand-built ForwardBatches (page 0 spare)."""

    def __init__(self, draft, num_seqs, max_tokens):
        attn = draft.midlayer.self_attn
        self.pages = -(-max_tokens // PAGE)
        shape = (1 + num_seqs * self.pages, PAGE, attn.num_kv_heads, attn.head_dim)
        draft.bind_cache(torch.full(shape, float("nan")), torch.full(shape, float("nan")))
        self.tables = 1 + torch.arange(num_seqs * self.pages, dtype=torch.int32).view(num_seqs, self.pages)

    def batch(self, phase, seq, positions, stored_at, context_len, tree_mask=None):
        stored = torch.tensor(stored_at)
        slots = self.tables[seq, stored // PAGE].long() * PAGE + stored % PAGE
        T = len(positions)
        return ForwardBatch(
            phase=phase,
            input_ids=torch.zeros(T, dtype=torch.long),
            positions=torch.tensor(positions),
            cu_seqlens=torch.tensor([0, T], dtype=torch.int32),
            context_lens=torch.tensor([context_len], dtype=torch.int32),
            state_indices=torch.zeros(1, dtype=torch.int32),
            has_initial_state=torch.tensor([context_len > T]),
            max_seqlen_q=T,
            kv=KVMetadata(slot_mapping=slots, block_tables=self.tables[seq : seq + 1]),
            tree_mask=tree_mask,
        )


def _dense_draft(draft, input_ids, hidden, positions, visible):
    """The draft layer written out densely: visible [T, T] bool says which tokens each query attends to."""
    p = dict(draft.named_parameters())
    cfg = draft.config
    eps = cfg.rms_norm_eps

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    def rope(x):
        half = cfg.head_dim // 2
        inv = 1.0 / cfg.rope_theta ** (torch.arange(half).float() * 2 / cfg.head_dim)
        ang = positions.float()[:, None, None] * inv  # [T, 1, Dh/2]
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * ang.cos() - x2 * ang.sin(), x2 * ang.cos() + x1 * ang.sin()], dim=-1)

    T = input_ids.shape[0]
    x = torch.cat([rms(draft.embed(input_ids), p["midlayer.input_layernorm.weight"]),
                   rms(hidden, p["midlayer.hidden_norm.weight"])], dim=-1)  # fmt: skip
    H, HK, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    q = rope((x @ p["midlayer.self_attn.q_proj.weight"].T).view(T, H, D))
    k = rope((x @ p["midlayer.self_attn.k_proj.weight"].T).view(T, HK, D)).repeat_interleave(H // HK, dim=1)
    v = (x @ p["midlayer.self_attn.v_proj.weight"].T).view(T, HK, D).repeat_interleave(H // HK, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / D**0.5
    attn = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    o = torch.einsum("hqk,khd->qhd", attn, v).reshape(T, H * D) @ p["midlayer.self_attn.o_proj.weight"].T
    h = o + hidden
    y = rms(h, p["midlayer.post_attention_layernorm.weight"])
    gate, up = y @ p["midlayer.mlp.gate_proj.weight"].T, y @ p["midlayer.mlp.up_proj.weight"].T
    return (torch.nn.functional.silu(gate) * up) @ p["midlayer.mlp.down_proj.weight"].T + h


@pytest.fixture(scope="module")
def features(target, draft):
    """The tiny target's features for a 20-token prompt, and the draft's inputs: tokens shifted by one (EAGLE pairs
    the feature at position t with the token at t + 1) plus the target's next token."""
    prompt = torch.randint(0, 259, (20,), generator=torch.Generator().manual_seed(3)).tolist()
    cache = StaticCache(target, 1, 64)
    fb = dataclasses.replace(cache.batch([0], [prompt]), capture_layers=draft.capture_layers)
    logits = target.compute_logits(target(fb))
    aux = target.aux_hidden_states
    assert len(aux) == len(draft.capture_layers) and aux[0].shape == (20, target.config.hidden_size)
    ids = torch.tensor(prompt[1:] + [int(logits[-1].argmax())])
    return ids, draft.project_features(aux)


def test_features_are_fc_over_the_configured_layers(target, draft, features):
    ids, hidden = features
    aux = target.aux_hidden_states  # inputs of layers (1, 2); fc reads layers (2, 2, 1)
    expected = torch.cat([aux[1], aux[1], aux[0]], dim=-1) @ draft.fc.weight.T
    torch.testing.assert_close(hidden, expected)


def test_prefill_matches_dense_and_decode_matches_prefill(draft, features):
    ids, hidden = features
    T = ids.shape[0]
    positions = torch.arange(T)
    dense = _dense_draft(draft, ids, hidden, positions, torch.ones(T, T, dtype=torch.bool).tril())

    cache = DraftCache(draft, 1, 32)
    whole = draft(ids, hidden, cache.batch(Phase.PREFILL, 0, list(range(T)), list(range(T)), T))
    torch.testing.assert_close(whole, dense, rtol=1e-4, atol=1e-4)

    cache = DraftCache(draft, 1, 32)
    split = [draft(ids[:7], hidden[:7], cache.batch(Phase.PREFILL, 0, list(range(7)), list(range(7)), 7))]
    for t in range(7, T):
        split.append(draft(ids[t : t + 1], hidden[t : t + 1], cache.batch(Phase.DECODE, 0, [t], [t], t + 1)))
    torch.testing.assert_close(torch.cat(split), whole, rtol=1e-4, atol=1e-4)

    logprobs, candidates = draft.top_candidates(whole, 4)
    assert logprobs.shape == (T, 4) and torch.all(logprobs[:, :-1] >= logprobs[:, 1:])
    assert bool(draft.t2d[candidates].all())
    draft_argmax = draft.compute_logits(whole).argmax(dim=-1)
    assert torch.equal(candidates[:, 0], draft_argmax + draft.d2t[draft_argmax])
    top_logprob, top_id = draft.top_candidate(whole)  # the chain's one reduction: the sort's first column
    assert torch.equal(top_id, candidates[:, 0])
    torch.testing.assert_close(top_logprob, logprobs[:, 0])


def test_tree_verify_matches_each_branch_alone(draft, features):
    """A prefix of 12 tokens, then a tree: node 0 (token 12), children 1 and 2 (two candidate tokens 13), and node 3
    under node 1. Each node must equal the dense causal run of its own branch."""
    ids, hidden = features
    prefix = 12
    cache = DraftCache(draft, 1, 32)
    draft(
        ids[:prefix], hidden[:prefix], cache.batch(Phase.PREFILL, 0, list(range(prefix)), list(range(prefix)), prefix)
    )
    other = (ids[13] + 1) % 320
    node_ids = torch.stack([ids[12], ids[13], other, ids[14]])
    node_hidden = torch.stack([hidden[12], hidden[13], hidden[13] * 0.5, hidden[14]])
    depths = [0, 1, 1, 2]
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    fb = cache.batch(Phase.VERIFY, 0, [prefix + d for d in depths], [prefix + j for j in range(4)], prefix + 4,
                     tree_mask=mask[None])  # fmt: skip
    out = draft(node_ids, node_hidden, fb)
    for node, branch in ((1, [0, 1]), (2, [0, 2]), (3, [0, 1, 3])):
        seq_ids = torch.cat([ids[:prefix], node_ids[branch]])
        seq_hidden = torch.cat([hidden[:prefix], node_hidden[branch]])
        T = seq_ids.shape[0]
        dense = _dense_draft(draft, seq_ids, seq_hidden, torch.arange(T), torch.ones(T, T, dtype=torch.bool).tril())
        torch.testing.assert_close(out[node], dense[-1], rtol=1e-4, atol=1e-4)


def test_dtype_override_keeps_the_maps_exact(draft_dir, target):
    model = load_draft_model(draft_dir, target, dtype=torch.float16)
    assert model.fc.weight.dtype == torch.float16 and model.d2t.dtype == torch.int64 and model.t2d.dtype == torch.bool
    assert not any(p is target.model.embed_tokens.weight for p in model.parameters())
