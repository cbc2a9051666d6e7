"""Paged GQA attention (prefill, decode, tree verify, KV commit) and RoPE, over the paged K/V cache."""

from jetserve.ops.attention.reference import (
    apply_rope,
    attention_decode,
    attention_prefill,
    attention_verify,
    kv_cache_commit,
    rope_cos_sin,
)

__all__ = [
    "apply_rope",
    "attention_decode",
    "attention_prefill",
    "attention_verify",
    "kv_cache_commit",
    "rope_cos_sin",
]
