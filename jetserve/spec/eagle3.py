"""The EAGLE-3 draft model: config, module (fc over three target features, one decoder layer, reduced-vocabulary head
with d2t/t2d), loading of EAGLE-3 / SpecForge checkpoints unchanged, and random draft checkpoints for tests."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from jetserve.config import ModelConfig
from jetserve.model.attention import rotated_qkv
from jetserve.model.forward_batch import ForwardBatch, Phase
from jetserve.model.fusion import InputProjections, fuse_projections
from jetserve.model.jet_nemotron import JetNemotronForCausalLM
from jetserve.model.layers import MLP, Linear, RMSNorm
from jetserve.model.loader import DTYPES
from jetserve.ops.attention import attention_decode, attention_prefill, attention_verify, rope_cos_sin
from jetserve.ops.norm import embed_norm_pair
from jetserve.ops.sampling import top_logprob

DEFAULT_DRAFT_VOCAB = 32000  # a random draft's reduced vocabulary (at most the target's), a common EAGLE-3 size
# Where a checkpoint's config lists the target layers it was trained on (SpecForge and SGLang read both places).
AUX_LAYER_IDS_KEY = "eagle_aux_hidden_state_layer_ids"
NUM_FEATURES = 3


@dataclass(frozen=True)
class DraftConfig:
    """The draft's config.json (a Llama config with `draft_vocab_size`, as SpecForge writes it)."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # the target's vocabulary (t2d covers it)
    draft_vocab_size: int  # rows of the draft lm_head
    target_hidden_size: int  # width of each target feature fc reads (3 of them)
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    attention_bias: bool
    # Target layers named by their *outputs* (SGLang/SpecForge convention): feature k is the input of layer id + 1.
    aux_layer_ids: tuple[int, ...] | None = None
    torch_dtype: str = "bfloat16"
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_hf(cls, path: str | Path) -> DraftConfig:
        path = Path(path)
        file = path / "config.json" if path.is_dir() else path
        if not file.is_file():
            raise ValueError(f"draft: no config.json at {path}")
        return cls.from_dict(json.loads(file.read_text()))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DraftConfig:
        def integer(key: str, default: int | None = None) -> int:
            value = data.get(key, default)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"draft config {key}: expected an integer, got {value!r}")
            return value

        hidden = integer("hidden_size")
        heads = integer("num_attention_heads")
        if heads <= 0 or hidden <= 0:
            raise ValueError(f"draft config hidden_size/num_attention_heads: must be positive, got {hidden}/{heads}")
        kv_heads = integer("num_key_value_heads", heads)
        if kv_heads <= 0 or heads % kv_heads:
            raise ValueError(f"draft config num_key_value_heads: {kv_heads} must divide num_attention_heads ({heads})")
        head_dim = integer("head_dim", hidden // heads) if data.get("head_dim") is not None else hidden // heads
        if head_dim % 2:
            raise ValueError(f"draft config head_dim: {head_dim} must be even for rotary embeddings")
        if integer("num_hidden_layers", 1) != 1:
            raise ValueError(f"draft config num_hidden_layers: {data['num_hidden_layers']} (EAGLE-3 drafts have 1)")
        if data.get("hidden_act", "silu") != "silu":
            raise ValueError(f"draft config hidden_act: {data['hidden_act']!r} is not supported (only silu)")
        scaling = data.get("rope_scaling")
        if scaling is not None and (scaling.get("rope_type") or scaling.get("type")) not in (None, "default"):
            raise ValueError(f"draft config rope_scaling: {scaling!r} is not supported (only none/default)")
        vocab = integer("vocab_size")
        draft_vocab = integer("draft_vocab_size", vocab)
        if not 0 < draft_vocab <= vocab:
            raise ValueError(f"draft config draft_vocab_size: {draft_vocab} must be in [1, vocab_size={vocab}]")
        eagle = data.get("eagle_config") or {}
        ids = eagle.get(AUX_LAYER_IDS_KEY, data.get(AUX_LAYER_IDS_KEY))
        if ids is not None and (
            not isinstance(ids, list) or len(ids) != NUM_FEATURES or not all(isinstance(i, int) for i in ids)
        ):
            raise ValueError(f"draft config eagle_config.{AUX_LAYER_IDS_KEY}: expected 3 integers, got {ids!r}")
        rope_theta = data.get("rope_theta", (data.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        return cls(
            hidden_size=hidden,
            intermediate_size=integer("intermediate_size"),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            vocab_size=vocab,
            draft_vocab_size=draft_vocab,
            target_hidden_size=integer("target_hidden_size", hidden),
            rms_norm_eps=float(data.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            max_position_embeddings=integer("max_position_embeddings", 32768),
            attention_bias=bool(data.get("attention_bias", False)),
            aux_layer_ids=None if ids is None else tuple(ids),
            torch_dtype=str(data.get("torch_dtype") or "bfloat16"),
            raw=data,
        )

    def feature_layers(self, num_target_layers: int) -> tuple[int, ...]:
        """The target layers whose *inputs* are the three features, in fc's order (they may repeat on tiny targets):
        the config's ids + 1, else layers 2, L/2 and L-3 (clamped into the model)."""
        if self.aux_layer_ids is None:
            L = num_target_layers
            return tuple(min(max(i, 0), L - 1) for i in (2, L // 2, L - 3))
        layers = tuple(i + 1 for i in self.aux_layer_ids)
        if not all(0 <= i < num_target_layers for i in layers):
            raise ValueError(
                f"draft config eagle_config.{AUX_LAYER_IDS_KEY}: {list(self.aux_layer_ids)} names layer outputs; each "
                f"must be in [-1, {num_target_layers - 2}] for a target of {num_target_layers} layers"
            )
        return layers

    def check_target(self, target: ModelConfig, has_own_embedding: bool) -> None:
        """ValueError naming the field where this draft cannot serve `target`."""
        if self.target_hidden_size != target.hidden_size:
            key = "target_hidden_size" if "target_hidden_size" in self.raw else "hidden_size"
            raise ValueError(
                f"draft config {key}: the draft reads target features of width {self.target_hidden_size}, but the "
                f"target's hidden_size is {target.hidden_size}"
            )
        if self.vocab_size != target.vocab_size:
            raise ValueError(
                f"draft config vocab_size: {self.vocab_size} differs from the target's vocab_size {target.vocab_size}"
            )
        if not has_own_embedding and self.hidden_size != target.hidden_size:
            raise ValueError(
                f"draft config hidden_size: {self.hidden_size} differs from the target's {target.hidden_size}, and "
                f"the draft ships no embed_tokens.weight of its own to use instead of the target's"
            )
        self.feature_layers(target.num_hidden_layers)


class Eagle3Attention(InputProjections, nn.Module):
    """Causal GQA with RoPE over the draft's own paged K/V; q/k/v read [embedding; feature] (2H), as one GEMM."""

    def __init__(self, config: DraftConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = self.head_dim**-0.5
        width, bias = 2 * config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(width, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(width, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(width, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)
        self.cos_sin: torch.Tensor | None = None  # [max_pos, Dh] fp32
        self.k_cache: torch.Tensor | None = None  # [num_pages, page_size, HK, Dh]
        self.v_cache: torch.Tensor | None = None

    def input_projections(self) -> tuple[nn.Linear, ...]:
        return self.q_proj, self.k_proj, self.v_proj

    def forward(self, x: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        """x [T, 2H] → [T, H]; K/V of the new tokens are stored at `fb.kv.slot_mapping`."""
        assert self.k_cache is not None and self.cos_sin is not None, "draft: bind_cache and init_rope first"
        assert fb.kv is not None, "draft: the ForwardBatch carries no K/V metadata for the draft's cache"
        q, k, v = rotated_qkv(self, x, fb.positions, self.cos_sin)
        caches, meta = (self.k_cache, self.v_cache), fb.kv
        if fb.phase is Phase.PREFILL:
            o = attention_prefill(
                q, k, v, *caches, fb.cu_seqlens, fb.context_lens, meta.block_tables, meta.slot_mapping,
                scale=self.scale, max_seqlen_q=fb.max_seqlen_q,
            )  # fmt: skip
        elif fb.phase is Phase.DECODE:
            o = attention_decode(
                q, k, v, *caches, fb.context_lens, meta.block_tables, meta.slot_mapping, scale=self.scale
            )
        else:
            o = attention_verify(
                q, k, v, *caches, fb.tree_mask, fb.context_lens, meta.block_tables, meta.slot_mapping,
                scale=self.scale,
            )  # fmt: skip
        return self.o_proj(o.reshape(x.shape[0], self.num_heads * self.head_dim))  # [T, H]


class Eagle3DecoderLayer(nn.Module):
    """`midlayer`: h = fc(features) (or the previous draft step's output); attention over
    [input_layernorm(embed(token)); hidden_norm(h)], residual h; then the usual post-norm SwiGLU MLP block."""

    def __init__(self, config: DraftConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Eagle3Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)

    def forward(
        self, x: torch.Tensor, hidden: torch.Tensor, fb: ForwardBatch, final_norm: RMSNorm | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x [T, 2H] the attention input (`Eagle3DraftModel.attention_input`), hidden [T, H] its feature half before
        the norm (the residual) → the layer output [T, H] (before the final norm); with `final_norm`, the pair
        (final_norm(output), output) from the down projection's add-norm: one launch fewer than the add, then the
        norm."""
        attn = self.self_attn(x, fb)  # [T, H]
        x, residual = self.post_attention_layernorm(attn, hidden)
        if final_norm is None:
            return self.mlp(x) + residual
        return self.mlp(x, add_norm=(residual, final_norm.weight, final_norm.eps))


class Eagle3DraftModel(nn.Module):
    """Parameter names are the checkpoint's: fc, midlayer.*, norm, lm_head, d2t, t2d (and embed_tokens when the
    draft ships one; otherwise the target's embedding is shared through `share_embedding`)."""

    def __init__(self, config: DraftConfig, feature_layers: tuple[int, ...], has_own_embedding: bool = False) -> None:
        super().__init__()
        assert len(feature_layers) == NUM_FEATURES
        self.config = config
        self.feature_layers = feature_layers  # fc's order, may repeat
        self.capture_layers = tuple(sorted(set(feature_layers)))  # what the target's ForwardBatch asks for
        self._feature_index = [self.capture_layers.index(i) for i in feature_layers]
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size) if has_own_embedding else None
        self._shared_embedding: tuple[nn.Embedding, ...] = ()  # the target's, kept out of this module's parameters
        self.fc = Linear(NUM_FEATURES * config.target_hidden_size, config.hidden_size, bias=False)
        self.midlayer = Eagle3DecoderLayer(config)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64))  # target = d + d2t[d]
        self.register_buffer("t2d", torch.ones(config.vocab_size, dtype=torch.bool))  # target token in draft vocab

    def share_embedding(self, embedding: nn.Embedding) -> None:
        assert self.embed_tokens is None, "the draft has its own embedding"
        self._shared_embedding = (embedding,)

    def init_rope(self, device: torch.device | str, max_positions: int) -> None:
        config = self.config
        table = rope_cos_sin(max_positions, config.head_dim, config.rope_theta).to(device)  # [max_pos, Dh]
        self.midlayer.self_attn.cos_sin = table

    def bind_cache(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        """The draft's own K/V pages: [num_pages, page_size, HK, Dh] each."""
        attn = self.midlayer.self_attn
        expected = (attn.num_kv_heads, attn.head_dim)
        if k_cache.shape != v_cache.shape or tuple(k_cache.shape[2:]) != expected:
            raise ValueError(f"draft KV cache must be [num_pages, page_size, {expected[0]}, {expected[1]}]")
        attn.k_cache, attn.v_cache = k_cache, v_cache

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        embedding = self.embed_tokens if self.embed_tokens is not None else self._shared_embedding[0]
        return embedding(input_ids)  # [T, H]

    def project_features(self, aux_hidden_states: list[torch.Tensor]) -> torch.Tensor:
        """The target's captured hidden states (one [T, H_t] per layer of `capture_layers`, in that order) →
        fc([f_0; f_1; f_2]) [T, H]."""
        if len(aux_hidden_states) != len(self.capture_layers):
            raise ValueError(
                f"draft: expected the target's features at layers {self.capture_layers}, got "
                f"{len(aux_hidden_states)} tensors (run the target with fb.capture_layers = draft.capture_layers)"
            )
        features = torch.cat([aux_hidden_states[i] for i in self._feature_index], dim=-1)  # [T, 3 H_t]
        return self.fc(features.to(self.fc.weight.dtype))

    def forward(
        self, input_ids: torch.Tensor, hidden: torch.Tensor, fb: ForwardBatch, input_embeds: torch.Tensor | None = None
    ) -> torch.Tensor:
        """input_ids [T] (target vocabulary), hidden [T, H] (`project_features` of the target's features, or this
        model's own output at the parent token) → the output [T, H] that the next draft step takes as `hidden`.
        `input_embeds` [T, H] replaces the embedding of `input_ids` (a VLM prompt's rows, image embeddings included,
        as the target saw them)."""
        return self.midlayer(self.attention_input(input_ids, hidden, input_embeds), hidden, fb)

    def forward_normed(
        self, input_ids: torch.Tensor, hidden: torch.Tensor, fb: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward`'s output [T, H] with the final norm applied, then the output itself: what `top_candidate(...,
        normed=True)` takes, and the next draft step's `hidden`."""
        return self.midlayer(self.attention_input(input_ids, hidden), hidden, fb, self.norm)

    def attention_input(
        self, input_ids: torch.Tensor, hidden: torch.Tensor, input_embeds: torch.Tensor | None = None
    ) -> torch.Tensor:
        """[input_layernorm(embed(input_ids)); hidden_norm(hidden)] [T, 2H]: the embedding gather and both norms in one
        launch (`ops.norm.embed_norm_pair`; both norms take the config's rms_norm_eps) from a whole-vocabulary
        embedding; from a vocabulary-parallel one (tensor parallelism: each rank holds a slice of the rows), or with
        `input_embeds` [T, H] in place of the embeddings, the two norms and a concatenation."""
        layer = self.midlayer
        norms = layer.input_layernorm, layer.hidden_norm
        embedding = self.embed_tokens if self.embed_tokens is not None else self._shared_embedding[0]
        if input_embeds is None and isinstance(embedding, nn.Embedding):
            weights = (norms[0].weight, norms[1].weight)
            return embed_norm_pair(input_ids, embedding.weight, hidden, weights, norms[0].eps)
        embeds = self.embed(input_ids) if input_embeds is None else input_embeds  # [T, H]
        return torch.cat([norms[0](embeds), norms[1](hidden)], dim=-1)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [T, H] → draft-vocabulary logits [T, V_d] fp32."""
        return self.lm_head(self.norm(hidden)).float()

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def top_candidate(
        self, hidden: torch.Tensor, normed: bool = False, out: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The most likely next token: (log-prob [T] fp32, target-vocabulary id [T] int64); ties go to the lower
        draft id. One split reduction over the draft logits as the lm_head writes them (`top_logprob`, the
        d2t shift included), where `top_candidates(hidden, 1)` sorts. `normed`: hidden is already norm(hidden)
        (`forward_normed`). `out`: the pair's buffers (any stride: a chain's level column)."""
        return top_logprob(self.lm_head(hidden if normed else self.norm(hidden)), self.d2t, out)

    def top_candidates(self, hidden: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The k most likely next tokens: (log-probs [T, k] fp32, target-vocabulary ids [T, k] int64)."""
        logprobs, draft_ids = torch.log_softmax(self.compute_logits(hidden), dim=-1).topk(k, dim=-1)
        return logprobs, self.draft_to_target(draft_ids)


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint folder: safetensors (single or indexed shards) or pytorch_model.bin (likewise)."""
    for index_name, single in (("model.safetensors.index.json", "*.safetensors"), ("pytorch_model.bin.index.json",
                                                                                   "pytorch_model*.bin")):  # fmt: skip
        index = path / index_name
        if index.is_file():
            files = [path / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
        else:
            files = sorted(path.glob(single))
        if files:
            break
    else:
        raise ValueError(f"draft: {path} has no model.safetensors or pytorch_model.bin")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        if file.suffix == ".safetensors":
            with safe_open(str(file), framework="pt", device="cpu") as f:
                tensors.update({name: f.get_tensor(name) for name in f.keys()})
        else:
            tensors.update(torch.load(file, map_location="cpu", weights_only=True))
    return tensors


def load_draft_model(
    path: str | Path,
    target: JetNemotronForCausalLM,
    dtype: torch.dtype | None = None,
    ignore_unused: bool = False,
) -> Eagle3DraftModel:
    """Load an EAGLE-3 / SpecForge draft checkpoint for `target`, on the target's device and (by default) dtype.

    A mismatch with the target (feature width, vocabulary, layer ids) is a ValueError naming the config field; a
    missing or misshapen tensor one naming the tensor. d2t/t2d may be absent only when the draft vocabulary is the
    whole target vocabulary (then they are the identity).
    """
    path = Path(path)
    config = DraftConfig.from_hf(path)
    tensors = _read_tensors(path)
    has_own_embedding = "embed_tokens.weight" in tensors
    config.check_target(target.config, has_own_embedding)
    embedding = target.model.embed_tokens.weight
    device, dtype = embedding.device, dtype or embedding.dtype
    with torch.device("meta"):
        model = Eagle3DraftModel(config, config.feature_layers(target.config.num_hidden_layers), has_own_embedding)
    expected = dict(model.named_parameters()) | dict(model.named_buffers())
    if config.draft_vocab_size == config.vocab_size:
        tensors.setdefault("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64))
        tensors.setdefault("t2d", torch.ones(config.vocab_size, dtype=torch.bool))
    missing = [name for name in expected if name not in tensors]
    if missing:
        raise ValueError(f"draft {path}: missing tensor(s) {', '.join(missing)}")
    unused = sorted(name for name in tensors if name not in expected and not name.endswith("rotary_emb.inv_freq"))
    if unused and not ignore_unused:
        raise ValueError(f"draft {path}: tensor(s) an EAGLE-3 draft does not have: {', '.join(unused[:5])}")
    state = {}
    for name, param in expected.items():
        tensor = tensors[name]
        if tuple(tensor.shape) != tuple(param.shape):
            raise ValueError(f"draft {path}: {name} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
        kind = param.dtype if name in ("d2t", "t2d") else dtype
        state[name] = tensor.to(device=device, dtype=kind)
    targets = torch.arange(config.draft_vocab_size, device=device) + state["d2t"]
    if bool(((targets < 0) | (targets >= config.vocab_size)).any()):
        raise ValueError(f"draft {path}: d2t maps draft tokens outside the target vocabulary [0, {config.vocab_size})")
    model.load_state_dict(state, strict=True, assign=True)
    if not has_own_embedding:
        model.share_embedding(target.model.embed_tokens)
    model.init_rope(device, max(config.max_position_embeddings, target.config.max_position_embeddings))
    return fuse_projections(model.eval().requires_grad_(False))


def random_draft_config(target: ModelConfig, draft_vocab_size: int | None = None, dtype: str = "auto") -> dict:
    """The config.json of a draft for `target` (SpecForge's LlamaForCausalLMEagle3: the target's attention/MLP sizes,
    `draft_vocab_size` — default min(vocab, DEFAULT_DRAFT_VOCAB) — and eagle_config with the default aux layer ids)."""
    vocab = target.vocab_size
    draft_vocab = min(vocab, DEFAULT_DRAFT_VOCAB) if draft_vocab_size is None else draft_vocab_size
    if not 0 < draft_vocab <= vocab:
        raise ValueError(f"draft_vocab_size: {draft_vocab} must be in [1, {vocab}]")
    torch_dtype = target.torch_dtype if dtype == "auto" else dtype
    if torch_dtype not in DTYPES:
        raise ValueError(f"dtype: {torch_dtype!r} is not one of auto, {', '.join(DTYPES)}")
    L = target.num_hidden_layers
    default_inputs = (2, L // 2, L - 3)
    data = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": target.hidden_size,
        "intermediate_size": target.intermediate_size,
        "num_attention_heads": target.num_attention_heads,
        "num_key_value_heads": target.num_key_value_heads,
        "head_dim": target.head_dim,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "attention_bias": False,
        "max_position_embeddings": target.max_position_embeddings,
        "rms_norm_eps": target.rms_norm_eps,
        "rope_theta": target.rope_theta,
        "rope_scaling": None,
        "tie_word_embeddings": False,
        "vocab_size": vocab,
        "draft_vocab_size": draft_vocab,
        "target_hidden_size": target.hidden_size,
        "eagle_config": {AUX_LAYER_IDS_KEY: [min(max(i, 0), L - 1) - 1 for i in default_inputs]},
        "torch_dtype": torch_dtype,
    }
    DraftConfig.from_dict(data)  # validates
    return data


def random_draft_tensors(data: dict, num_target_layers: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights (fan-in scaled; norms near 1) and a random sorted draft vocabulary for the config `data`."""
    config = DraftConfig.from_dict(data)
    gen = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        model = Eagle3DraftModel(config, config.feature_layers(num_target_layers))
    torch_dtype, vocab, draft_vocab = data["torch_dtype"], config.vocab_size, config.draft_vocab_size
    tensors = {}
    for name, param in model.named_parameters():
        shape = tuple(param.shape)
        if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            t = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        elif name.endswith(".bias"):
            t = 0.1 * torch.randn(shape, generator=gen)
        else:
            t = torch.randn(shape, generator=gen) / math.sqrt(shape[-1])  # fan-in scaling
        tensors[name] = t.to(DTYPES[torch_dtype]).contiguous()
    kept = torch.randperm(vocab, generator=gen)[:draft_vocab].sort().values  # [V_d] target ids of the draft vocab
    tensors["d2t"] = kept - torch.arange(draft_vocab)
    tensors["t2d"] = torch.zeros(vocab, dtype=torch.bool).index_fill_(0, kept, True)
    return tensors


def make_draft_checkpoint(
    target_dir: str | Path,
    out_dir: str | Path,
    seed: int = 0,
    draft_vocab_size: int | None = None,
    dtype: str = "auto",
) -> Path:
    """Write a random EAGLE-3 draft for the target checkpoint at `target_dir`, in the SpecForge layout: config.json
    (`random_draft_config`) and model.safetensors (no embedding: the target's is shared). The draft vocabulary is a
    random sorted subset of the target's."""
    target = ModelConfig.from_hf(target_dir)
    data = random_draft_config(target, draft_vocab_size, dtype)
    tensors = random_draft_tensors(data, target.num_hidden_layers, seed)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(data, indent=2) + "\n")
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def random_draft_model(
    target: JetNemotronForCausalLM, seed: int = 0, draft_vocab_size: int | None = None
) -> Eagle3DraftModel:
    """A random draft for `target`, built in memory on its device and dtype (benchmarks of random-weight targets)."""
    data = random_draft_config(target.config, draft_vocab_size, "float32")
    config = DraftConfig.from_dict(data)
    embedding = target.model.embed_tokens.weight
    tensors = random_draft_tensors(data, target.config.num_hidden_layers, seed)
    model = Eagle3DraftModel(config, config.feature_layers(target.config.num_hidden_layers))
    model.load_state_dict(tensors, strict=True)
    model = model.to(device=embedding.device)
    for param in model.parameters():
        param.data = param.data.to(embedding.dtype)
    model.share_embedding(target.model.embed_tokens)
    model.init_rope(embedding.device, max(config.max_position_embeddings, target.config.max_position_embeddings))
    return fuse_projections(model.eval().requires_grad_(False))
