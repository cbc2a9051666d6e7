"""The `attn` and `swa` mixers: Qwen2 GQA with RoPE over paged K/V (SWA keeps only its window)."""

from __future__ import annotations

import torch
from torch import nn

from jetserve.config import ModelConfig
from jetserve.model.forward_batch import ForwardBatch, KVMetadata, Phase
from jetserve.model.fusion import InputProjections
from jetserve.model.layers import Linear, Output
from jetserve.ops.attention import apply_rope, attention_decode, attention_prefill, attention_verify, kv_cache_commit
from jetserve.ops.linear.reference import AddNorm


def rotated_qkv(
    attn: InputProjections, x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [T, H, Dh] and k [T, HK, Dh] rotated, v [T, HK, Dh], from one GEMM of an attention module with `num_heads`,
    `num_kv_heads` and `head_dim` whose input projections are q, k, v (the target's layers and the draft's)."""
    T, H, HK, Dh = x.shape[0], attn.num_heads, attn.num_kv_heads, attn.head_dim
    qkv = attn.project(x)  # [T, (H + 2 HK) Dh]: q, k, v side by side
    q, k, v = qkv.split([H * Dh, HK * Dh, HK * Dh], dim=-1)  # views, rows strided: the ops take them as they are
    q, k = apply_rope(q.view(T, H, Dh), k.view(T, HK, Dh), positions, cos_sin)  # [T, H, Dh], [T, HK, Dh]
    return q, k, v.view(T, HK, Dh)


class Attention(InputProjections, nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.is_sliding = config.layer_types[layer_id] == "swa"
        self.window_tokens = config.swa_window_size if self.is_sliding else 0
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = self.head_dim**-0.5
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)
        self.cos_sin: torch.Tensor | None = None  # [max_pos, Dh] fp32, one table shared by all layers (set_rope)
        self.k_cache: torch.Tensor | None = None  # [num_pages, page_size, HK, Dh]
        self.v_cache: torch.Tensor | None = None

    def set_rope(self, cos_sin: torch.Tensor) -> None:
        self.cos_sin = cos_sin

    def bind_cache(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        self.k_cache, self.v_cache = k_cache, v_cache

    def input_projections(self) -> tuple[nn.Linear, ...]:
        return self.q_proj, self.k_proj, self.v_proj

    def forward(self, x: torch.Tensor, fb: ForwardBatch, add_norm: AddNorm | None = None) -> Output:
        """[T, hidden], or with `add_norm` the next RMSNorm's pair (`layers.Linear`)."""
        assert self.k_cache is not None, f"layer {self.layer_id}: no K/V cache bound"
        q, k, v = rotated_qkv(self, x, fb.positions, self.cos_sin)
        meta = fb.swa_kv if self.is_sliding else fb.kv
        assert meta is not None, f"layer {self.layer_id}: ForwardBatch has no K/V metadata for this layer kind"
        window = self.window_tokens
        if meta.ring_tokens and meta.ring_tokens < window:
            # The ring was capped at max_model_len: it never wraps, and a window longer than any sequence cuts
            # nothing, so the ring's length is an equivalent window.
            window = meta.ring_tokens
        kwargs = dict(scale=self.scale, window_tokens=window, ring_tokens=meta.ring_tokens)
        caches = (self.k_cache, self.v_cache)
        if fb.phase is Phase.PREFILL:
            o = attention_prefill(
                q, k, v, *caches, fb.cu_seqlens, fb.context_lens, meta.block_tables, meta.slot_mapping,
                max_seqlen_q=fb.max_seqlen_q, **kwargs,
            )  # fmt: skip
        elif fb.phase is Phase.DECODE:
            o = attention_decode(q, k, v, *caches, fb.context_lens, meta.block_tables, meta.slot_mapping, **kwargs)
        else:
            o = attention_verify(
                q, k, v, *caches, fb.tree_mask, fb.context_lens, meta.block_tables, meta.slot_mapping, **kwargs
            )
        return self.o_proj(o.reshape(x.shape[0], self.num_heads * self.head_dim), add_norm)  # [T, hidden]

    def commit(
        self, meta: KVMetadata, prefix_lens: torch.Tensor, accepted_nodes: torch.Tensor, num_accepted: torch.Tensor
    ) -> None:
        """Move the accepted nodes' K/V of the last VERIFY step to consecutive positions after each prefix."""
        kv_cache_commit(
            self.k_cache, self.v_cache, meta.block_tables, prefix_lens, accepted_nodes, num_accepted,
            ring_tokens=meta.ring_tokens,
        )  # fmt: skip
