"""MemoryPlan: how many KV pages and state slots to allocate, found at start-up from the memory left for caches."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from jetserve.config import ModelConfig
from jetserve.engine.config import EngineConfig
from jetserve.engine.state_pool import state_shapes

# At most this share of the cache budget goes to state slots (JetBlock state + SWA rings); the rest is KV pages.
MAX_SLOT_SHARE = 0.5


@dataclass(frozen=True)
class MemoryPlan:
    """Cache sizes for one engine; counts include the reserved page 0 and slot 0."""

    page_size: int  # tokens per KV page
    num_pages: int  # `attn` KV pages
    num_slots: int  # state slots (each with its JetBlock state and its SWA ring)
    ring_tokens: int  # SWA ring per slot, whole pages (0 without `swa` layers)
    max_model_len: int  # tokens one sequence may reach (prompt + output)
    page_bytes: int  # K/V of one page in every `attn` layer, plus the draft's layer when speculating
    slot_bytes: int
    num_draft_tokens: int = 0  # tree nodes of the largest verify step (0: no speculation)

    @property
    def max_pages_per_seq(self) -> int:
        return -(-self.max_model_len // self.page_size)

    @property
    def cache_bytes(self) -> int:
        return self.num_pages * self.page_bytes + self.num_slots * self.slot_bytes


def ring_tokens_for(config: ModelConfig, page_size: int, num_draft_tokens: int, max_model_len: int) -> int:
    """An SWA ring holds the window plus the tree of one verify step (rejected nodes stay stored until overwritten, so
    it needs window + T_d - 1; window + T_d is kept), rounded up to whole pages."""
    if config.swa_window_size is None or "swa" not in config.layer_types:
        return 0
    tokens = min(config.swa_window_size + num_draft_tokens, max_model_len)
    return -(-tokens // page_size) * page_size


def page_bytes_for(config: ModelConfig, page_size: int, dtype: torch.dtype) -> int:
    """K and V of one page in every `attn` layer."""
    num_attn = sum(kind == "attn" for kind in config.layer_types)
    return num_attn * 2 * page_size * config.num_key_value_heads * config.head_dim * dtype.itemsize


def slot_bytes_for(config: ModelConfig, ring_tokens: int, dtype: torch.dtype) -> int:
    """One slot: every `jet` layer's conv window (model dtype) and recurrent state (fp32), every `swa` layer's ring."""
    (w, d), (h, k, v) = state_shapes(config)
    num_jet = len(config.jet_layer_ids)
    num_swa = sum(kind == "swa" for kind in config.layer_types)
    jet = num_jet * (w * d * dtype.itemsize + h * k * v * 4)
    swa = num_swa * 2 * ring_tokens * config.num_key_value_heads * config.head_dim * dtype.itemsize
    return jet + swa


def draft_slot_bytes_for(
    hidden_size: int, num_capture_layers: int, feature_ring: int, draft_hidden_size: int, dtype: torch.dtype
) -> int:
    """What speculation keeps per state slot: the target features of `feature_ring` positions at each capture layer
    (the draft's deferred catch-up) and the draft's hidden state at the last cached position."""
    return (feature_ring * num_capture_layers * hidden_size + draft_hidden_size) * dtype.itemsize


def draft_page_bytes_for(num_kv_heads: int, head_dim: int, page_size: int, dtype: torch.dtype) -> int:
    """K and V of one page of the EAGLE-3 draft's one layer (its positions use the target's `attn` pages)."""
    return 2 * page_size * num_kv_heads * head_dim * dtype.itemsize


def plan_memory(
    model_config: ModelConfig,
    engine_config: EngineConfig,
    dtype: torch.dtype,
    cache_budget_bytes: int,
    draft_page_bytes: int = 0,
    draft_slot_bytes: int = 0,
) -> MemoryPlan:
    """Split `cache_budget_bytes` between state slots (up to `max_num_seqs`, at most half the budget) and pages,
    unless `num_pages` / `num_slots` are given. `draft_page_bytes` (speculation: the draft's K/V per page) rides on
    every page, `draft_slot_bytes` (its feature ring and hidden state per slot) on every slot. Raises ValueError when
    one full-length sequence does not fit."""
    ec = engine_config
    page_size = ec.page_size
    user_len = ec.max_model_len
    max_model_len = user_len or model_config.max_position_embeddings
    if max_model_len > model_config.max_position_embeddings:
        raise ValueError(
            f"max_model_len: {max_model_len} exceeds the model's max_position_embeddings "
            f"({model_config.max_position_embeddings})"
        )
    num_draft_tokens = ec.draft_tree_size
    ring_tokens = ring_tokens_for(model_config, page_size, num_draft_tokens, max_model_len)
    page_bytes = page_bytes_for(model_config, page_size, dtype) + draft_page_bytes
    slot_bytes = slot_bytes_for(model_config, ring_tokens, dtype) + draft_slot_bytes

    num_slots = ec.num_slots
    if num_slots is None:
        affordable = int(cache_budget_bytes * MAX_SLOT_SHARE) // max(slot_bytes, 1)
        num_slots = min(ec.max_num_seqs, affordable - 1) + 1
        if num_slots < 2:
            raise ValueError(
                f"gpu_memory_utilization: the cache budget ({cache_budget_bytes / 2**30:.2f} GiB) cannot hold one "
                f"state slot ({slot_bytes / 2**20:.1f} MiB); raise it or free device memory"
            )
    num_pages = ec.num_pages
    if num_pages is None:
        left = cache_budget_bytes - num_slots * slot_bytes
        # Without `attn` layers pages cost nothing: enough for every slot at full length (accounting only).
        num_pages = left // page_bytes if page_bytes else 1 + num_slots * -(-max_model_len // page_size)
    capacity = (num_pages - 1) * page_size if page_bytes else max_model_len
    if capacity < max_model_len:
        if user_len is not None or ec.num_pages is not None:
            raise ValueError(
                f"max_model_len: {max_model_len} tokens do not fit the {num_pages - 1} usable KV pages of "
                f"{page_size} tokens; lower max_model_len or give the caches more memory"
            )
        max_model_len = capacity  # the model's own limit, not the user's: shrink it to what fits
        if max_model_len < 2:
            raise ValueError("gpu_memory_utilization: no room for a KV page after the state slots")
        ring_tokens = min(ring_tokens, -(-max_model_len // page_size) * page_size)
    return MemoryPlan(
        page_size, num_pages, num_slots, ring_tokens, max_model_len, page_bytes, slot_bytes, num_draft_tokens
    )


def cache_budget_bytes(engine_config: EngineConfig, device: torch.device, activation_bytes: int) -> int:
    """Bytes the caches may take: on CUDA, `gpu_memory_utilization` of the device less what is in use (weights,
    other processes) and the activation peak of the largest step; elsewhere `cpu_cache_bytes`."""
    if device.type != "cuda":
        return engine_config.cpu_cache_bytes
    free, total = torch.cuda.mem_get_info(device)
    used = total - free
    budget = int(total * engine_config.gpu_memory_utilization) - used - activation_bytes
    if budget <= 0:
        raise ValueError(
            f"gpu_memory_utilization: {engine_config.gpu_memory_utilization} of {total / 2**30:.1f} GiB leaves no "
            f"room for caches ({used / 2**30:.1f} GiB in use, {activation_bytes / 2**30:.2f} GiB for activations)"
        )
    return budget
