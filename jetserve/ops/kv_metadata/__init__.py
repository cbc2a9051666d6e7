"""K/V metadata of a step (slot mappings, block tables, ring tables) from per-token positions and state slots:
`kv_metadata` runs one Triton launch (`kernels.py`) when `use_triton(positions)` says so, else the reference."""

from __future__ import annotations

from jetserve.ops.backend import use_triton
from jetserve.ops.kv_metadata import kernels, reference


def kv_metadata(positions, rows, seq_ends, state_indices, block_table, num_cols, page_size, ring_tokens, attn, swa):
    """See `reference.kv_metadata`: ((slot_mapping [T], block_tables [N, num_cols]) | None, (slot_mapping [T],
    ring tables [N, R]) | None)."""
    fn = kernels.kv_metadata if use_triton(positions) else reference.kv_metadata
    return fn(positions, rows, seq_ends, state_indices, block_table, num_cols, page_size, ring_tokens, attn, swa)
