"""K/V metadata of a step (slot mappings, block tables, ring tables) from per-token positions and state slots:
`kv_metadata` runs one Triton launch (`kernels.py`) when `use_triton(positions)` says so, else the reference."""

from __future__ import annotations

import torch

from jetserve.ops.backend import use_triton
from jetserve.ops.kv_metadata import kernels, reference

Metadata = tuple[torch.Tensor, torch.Tensor]  # (slot_mapping [T] int64, tables [N, cols] int32)


def kv_metadata(
    positions: torch.Tensor,
    rows: torch.Tensor,
    seq_ends: torch.Tensor,
    state_indices: torch.Tensor,
    block_table: torch.Tensor,
    num_cols: int,
    page_size: int,
    ring_tokens: int,
    attn: bool,
    swa: bool,
) -> tuple[Metadata | None, Metadata | None]:
    """positions, rows, seq_ends [T], state_indices [N], block_table [S, P] int32 → ((slot_mapping [T], block_tables
    [N, num_cols]) for `attn` layers or None, (slot_mapping [T], ring tables [N, ring_tokens / page_size]) for `swa`
    layers or None). See `reference.kv_metadata`."""
    fn = kernels.kv_metadata if use_triton(positions) else reference.kv_metadata
    return fn(positions, rows, seq_ends, state_indices, block_table, num_cols, page_size, ring_tokens, attn, swa)
