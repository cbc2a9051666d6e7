"""ForwardBatch: the device tensors one model step reads, passed explicitly to every layer."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from jetserve.ops.gated_delta_rule.chunk_table import DeltaRuleChunks


class Phase(enum.Enum):
    PREFILL = "prefill"  # varlen chunks of prompt (or recomputed) tokens
    DECODE = "decode"  # one new token per sequence
    VERIFY = "verify"  # a draft tree of T_d nodes per sequence, node 0 the last committed token


@dataclass
class KVMetadata:
    """Where one kind of attention layer (`attn` or `swa`) keeps and finds K/V for this batch.

    Logical position p of sequence i lives in logical page `q // page_size`, row `q % page_size`, where
    q = p for a plain cache and q = p % ring_tokens for a ring (SWA layers keep only their window).
    """

    slot_mapping: torch.Tensor  # [T] int64: physical slot (page * page_size + row) each new token writes; -1 skips
    block_tables: torch.Tensor  # [N, P] int32: logical page → physical page
    ring_tokens: int = 0  # 0: plain cache; > 0: positions wrap modulo this many tokens


@dataclass
class ForwardBatch:
    phase: Phase
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64: RoPE positions (VERIFY: prefix length + node depth)
    cu_seqlens: torch.Tensor  # [N+1] int32: packed offsets of each sequence's new tokens
    context_lens: torch.Tensor  # [N] int32: tokens in the sequence after this step (prefix + new)
    state_indices: torch.Tensor  # [N] int32: StatePool slot per sequence; padded rows point at slot 0
    has_initial_state: torch.Tensor  # [N] bool: the slot already holds this sequence's JetBlock state
    max_seqlen_q: int  # host copy of max(new tokens per sequence), for launch grids
    kv: KVMetadata | None = None  # `attn` layers
    swa_kv: KVMetadata | None = None  # `swa` layers
    tree_parents: torch.Tensor | None = None  # [N, T_d] int32, VERIFY only: parent node, -1 for node 0
    tree_mask: torch.Tensor | None = None  # [N, T_d, T_d] bool, VERIFY only: mask[i, a] = a is i or an ancestor
    tree_is_chain: bool = False  # VERIFY only: every tree is a chain (topk = 1; the delta rule's faster kernel)
    capture_layers: tuple[int, ...] = ()  # layers whose input hidden states are returned (EAGLE-3 features)
    delta_chunks: DeltaRuleChunks | None = None  # PREFILL: the delta rule's chunk table, one for every JetBlock
    last_indices: torch.Tensor | None = None  # [N] int64, PREFILL: each sequence's last new token (its logits row)

    @property
    def num_seqs(self) -> int:
        return self.cu_seqlens.shape[0] - 1

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]
