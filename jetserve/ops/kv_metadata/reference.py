"""Where a step's new tokens write their K/V and where each sequence finds its pages, for `attn` layers (paged) and
`swa` layers (a ring of `ring_tokens` per state slot): the contract of `kv_metadata`, in plain PyTorch."""

from __future__ import annotations

import torch


def check_metadata_args(
    positions: torch.Tensor, rows: torch.Tensor, seq_ends: torch.Tensor, state_indices: torch.Tensor,
    block_table: torch.Tensor, num_cols: int,
) -> None:  # fmt: skip
    num_tokens = positions.shape[0]
    if positions.dim() != 1 or rows.shape != (num_tokens,) or seq_ends.shape != (num_tokens,):
        raise ValueError(f"kv_metadata: positions {tuple(positions.shape)}, rows {tuple(rows.shape)} and seq_ends "
                         f"{tuple(seq_ends.shape)} must be [T]")  # fmt: skip
    if state_indices.dim() != 1:
        raise ValueError(f"kv_metadata: state_indices {tuple(state_indices.shape)} must be [N]")
    if block_table.dim() != 2 or block_table.dtype != torch.int32 or not 0 <= num_cols <= block_table.shape[1]:
        raise ValueError(f"kv_metadata: block_table {tuple(block_table.shape)} {block_table.dtype} must be [S, P] "
                         f"int32 with num_cols {num_cols} <= P")  # fmt: skip


def kv_metadata(
    positions: torch.Tensor,  # [T] int64: the position each new token is stored at
    rows: torch.Tensor,  # [T]: the state slot of each token's sequence (0: padding, writes nothing)
    seq_ends: torch.Tensor,  # [T]: the length of each token's sequence after this step
    state_indices: torch.Tensor,  # [N]: each sequence's state slot
    block_table: torch.Tensor,  # [S, P] int32: logical → physical `attn` page of the sequence in each slot
    num_cols: int,  # block-table columns to pass
    page_size: int,
    ring_tokens: int,  # tokens of a slot's `swa` ring (a multiple of page_size)
    attn: bool,  # there are `attn` layers: their metadata
    swa: bool,  # there are `swa` layers: theirs
) -> tuple[tuple[torch.Tensor, torch.Tensor] | None, tuple[torch.Tensor, torch.Tensor] | None]:
    """((slot_mapping [T] int64, block_tables [N, num_cols] int32) for `attn` layers or None, (slot_mapping [T]
    int64, ring tables [N, ring_tokens / page_size] int32) for `swa` layers or None). A slot mapping is the physical
    slot (page * page_size + row) each token writes, -1 where it writes nothing: padding rows, and in a ring the
    tokens a later token of the same step overwrites (position < seq_end - ring_tokens). Ring page r of slot s is
    physical page s * R + r."""
    check_metadata_args(positions, rows, seq_ends, state_indices, block_table, num_cols)
    positions, rows = positions.long(), rows.long()
    is_real = rows > 0
    kv = swa_kv = None
    if attn:
        pages = block_table[rows, positions // page_size].long()  # [T]
        slot_mapping = torch.where(is_real, pages * page_size + positions % page_size, -1)  # [T]
        kv = (slot_mapping, block_table[state_indices.long(), :num_cols])
    if swa:
        ring_pages = ring_tokens // page_size
        is_kept = is_real & (positions >= seq_ends - ring_tokens)  # [T]
        slot_mapping = torch.where(is_kept, rows * ring_tokens + positions % ring_tokens, -1)  # [T]
        offsets = torch.arange(ring_pages, device=positions.device)
        swa_kv = (slot_mapping, (state_indices.long()[:, None] * ring_pages + offsets).to(torch.int32))  # [N, R]
    return kv, swa_kv
