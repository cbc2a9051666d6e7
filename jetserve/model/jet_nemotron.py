"""JetNemotronForCausalLM: embedding, decoder layers of three kinds (`attn`, `swa`, `jet`), final norm, lm_head."""

from __future__ import annotations

import torch
from torch import nn

from jetserve.config import ModelConfig
from jetserve.model.attention import Attention
from jetserve.model.forward_batch import ForwardBatch
from jetserve.model.jet_block import JetBlock
from jetserve.model.layers import MLP, RMSNorm
from jetserve.ops.attention import rope_cos_sin
from jetserve.ops.linear import logits_linear

# Parameters that stay fp32 whatever the model dtype (the official code upcasts them too).
FP32_PARAMETERS = ("A_log", "dt_bias")


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.kind = config.layer_types[layer_id]
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = JetBlock(config, layer_id) if self.kind == "jet" else Attention(config, layer_id)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor, fb: ForwardBatch, next_norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`x` is this layer's normed input and `residual` its input hidden states (the residual stream), [T, hidden]
        each. Returns the same pair for the layer after it: `next_norm` is that layer's input norm (the model's final
        norm after the last layer). Each residual add and RMSNorm goes to the GEMM that produces its input (o_proj,
        down: `ops.linear`'s `add_norm`), which runs it in its epilogue or as the norm op after it."""
        post = self.post_attention_layernorm
        x, residual = self.self_attn(x, fb, (residual, post.weight, post.eps))
        return self.mlp(x, (residual, next_norm.weight, next_norm.eps))


class JetNemotronModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class JetNemotronForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = JetNemotronModel(config)
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, False)
        self.aux_hidden_states: list[torch.Tensor] = []  # inputs of fb.capture_layers, set by forward
        self.init_rope(torch.empty(0).device)

    def init_rope(self, device: torch.device | str) -> None:
        """Build the one RoPE table (not a checkpoint tensor) on `device` and share it with every attention layer."""
        config = self.config
        table = rope_cos_sin(config.max_position_embeddings, config.head_dim, config.rope_theta).to(device)
        for layer in self.model.layers:
            if layer.kind != "jet":
                layer.self_attn.set_rope(table)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight  # [vocab, hidden]

    def bind_caches(
        self,
        kv_caches: dict[int, tuple[torch.Tensor, torch.Tensor]],
        conv_states: dict[int, torch.Tensor],
        recurrent_states: dict[int, torch.Tensor],
    ) -> None:
        """Give each layer its slice of the pools, keyed by layer index (called once, when they are allocated)."""
        for i, layer in enumerate(self.model.layers):
            if layer.kind == "jet":
                layer.self_attn.bind_state(conv_states[i], recurrent_states[i])
            else:
                layer.self_attn.bind_cache(*kv_caches[i])

    def forward(self, fb: ForwardBatch, input_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Returns the final-normed hidden states [T, hidden] of every token in the batch."""
        hidden = self.model.embed_tokens(fb.input_ids) if input_embeds is None else input_embeds  # [T, hidden]
        layers = self.model.layers
        x, residual = layers[0].input_layernorm(hidden), hidden
        # a capture layer's feature is its input hidden states: the residual stream entering it, a tensor of its own
        captured: list[torch.Tensor] = []
        for i, layer in enumerate(layers):
            if i in fb.capture_layers:
                captured.append(residual)
            next_norm = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.model.norm
            x, residual = layer(x, residual, fb, next_norm)
        self.aux_hidden_states = captured
        return x

    def commit_verified(self, fb: ForwardBatch, accepted_nodes: torch.Tensor, num_accepted: torch.Tensor) -> None:
        """After a VERIFY step `fb`: keep only each sequence's accepted path (`accepted_nodes` [N, T_d] node indices,
        root first; `num_accepted` [N], counting the root) in every layer's state. Rows with 0 change nothing."""
        assert fb.tree_parents is not None, "commit_verified needs the VERIFY batch it follows"
        # A chain's accepted path is its first nodes, whose K/V the VERIFY step wrote at prefix + node already: the
        # move would copy each onto itself, so a chain moves no K/V.
        prefix_lens = None if fb.tree_is_chain else fb.context_lens - fb.tree_parents.shape[1]  # [N]
        for layer in self.model.layers:
            if layer.kind == "jet":
                layer.self_attn.commit(fb.state_indices, accepted_nodes, num_accepted)
            elif prefix_lens is not None:
                meta = fb.swa_kv if layer.kind == "swa" else fb.kv
                layer.self_attn.commit(meta, prefix_lens, accepted_nodes, num_accepted)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """`hidden` [N, hidden] → logits [N, vocab] in fp32 (into `out` when given)."""
        return logits_linear(hidden, self.lm_head_weight, out)


def cast_model(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Cast floating parameters to `dtype`, keeping `FP32_PARAMETERS` (and the RoPE table) in fp32. Run it before
    `fuse_projections`: a cast replaces the parameters, so a fused model runs unfused until fused again."""
    for name, param in model.named_parameters():
        param.data = param.data.to(parameter_dtype(name, dtype))
    return model


def parameter_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype parameter `name` is kept in: fp32 for `FP32_PARAMETERS`, else the model's `dtype`."""
    return torch.float32 if name.rsplit(".", 1)[-1] in FP32_PARAMETERS else dtype
