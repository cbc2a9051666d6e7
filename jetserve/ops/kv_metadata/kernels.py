"""`kv_metadata` in one Triton launch (the reference takes ~20 small kernels: a decode graph replays them every step).
Program i writes token i's slot mappings (i < T) and sequence i's block-table row and ring table (i < N)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from jetserve.ops.kv_metadata.reference import check_metadata_args
from jetserve.ops.layout import dense

BLOCK_COLS = 1024  # block-table columns copied per step, past SHORT_COLS columns
SHORT_COLS = 256  # ... and up to it, one block of this many: every prefill shorter than 4K tokens (16-token pages)
# launches one variant, where a block sized to the step's page count built a new one at each power of two (session 49:
# a compile, 25-400 ms, in the first prefill step of many a prompt length)


def block_cols(num_cols: int) -> int:
    """The BLOCK_COLS constexpr of a launch passing `num_cols` block-table columns: two values in all."""
    return SHORT_COLS if num_cols <= SHORT_COLS else BLOCK_COLS


# The counts vary with every step's shape: specialising on them (== 1, multiples of 16) would build variants on the
# first steps of new prompt lengths, for loop bounds and masks that gain nothing from it.
@triton.jit(do_not_specialize=["num_tokens", "num_seqs", "num_cols"])
def _kv_metadata_kernel(
    positions,  # [T]
    rows,  # [T]
    seq_ends,  # [T]
    state_indices,  # [N]
    block_table,  # [S, P] int32
    slot_mapping,  # [T] int64 out (attn)
    tables,  # [N, num_cols] int32 out (attn)
    swa_slot_mapping,  # [T] int64 out (swa)
    swa_tables,  # [N, R] int32 out (swa)
    num_tokens,
    num_seqs,
    num_cols,
    stride_bt,
    page_size,
    ring_tokens,
    ring_pages,
    ATTN: tl.constexpr,
    SWA: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    BLOCK_RING: tl.constexpr,
):
    i = tl.program_id(0)
    if i < num_tokens:
        pos = tl.load(positions + i).to(tl.int64)
        row = tl.load(rows + i).to(tl.int64)
        if ATTN:
            page = tl.load(block_table + row * stride_bt + pos // page_size).to(tl.int64)
            tl.store(slot_mapping + i, tl.where(row > 0, page * page_size + pos % page_size, -1))
        if SWA:
            end = tl.load(seq_ends + i).to(tl.int64)
            is_kept = (row > 0) & (pos >= end - ring_tokens)
            tl.store(swa_slot_mapping + i, tl.where(is_kept, row * ring_tokens + pos % ring_tokens, -1))
    if i < num_seqs:
        slot = tl.load(state_indices + i).to(tl.int64)
        i64 = i.to(tl.int64)
        if ATTN:
            for c0 in range(0, num_cols, BLOCK_COLS):
                o_c = c0 + tl.arange(0, BLOCK_COLS)
                m_c = o_c < num_cols
                b_pages = tl.load(block_table + slot * stride_bt + o_c, mask=m_c, other=0)
                tl.store(tables + i64 * num_cols + o_c, b_pages, mask=m_c)
        if SWA:
            o_r = tl.arange(0, BLOCK_RING)
            tl.store(swa_tables + i64 * ring_pages + o_r, (slot * ring_pages + o_r).to(tl.int32), mask=o_r < ring_pages)


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
) -> tuple[tuple[torch.Tensor, torch.Tensor] | None, tuple[torch.Tensor, torch.Tensor] | None]:
    """See `reference.kv_metadata`."""
    check_metadata_args(positions, rows, seq_ends, state_indices, block_table, num_cols)
    positions, rows, seq_ends, state_indices = dense(positions, rows, seq_ends, state_indices)
    assert block_table.stride(1) == 1, "block_table rows must be contiguous"
    num_tokens, num_seqs = positions.shape[0], state_indices.shape[0]
    device = positions.device
    ring_pages = ring_tokens // page_size if swa else 0
    slot_mapping = torch.empty(num_tokens if attn else 0, dtype=torch.int64, device=device)
    tables = torch.empty(num_seqs if attn else 0, num_cols, dtype=torch.int32, device=device)
    swa_slot_mapping = torch.empty(num_tokens if swa else 0, dtype=torch.int64, device=device)
    swa_tables = torch.empty(num_seqs if swa else 0, ring_pages, dtype=torch.int32, device=device)
    programs = max(num_tokens, num_seqs)
    if programs and (attn or swa):
        _kv_metadata_kernel[(programs,)](
            positions,
            rows,
            seq_ends,
            state_indices,
            block_table,
            slot_mapping,
            tables,
            swa_slot_mapping,
            swa_tables,
            num_tokens,
            num_seqs,
            num_cols,
            block_table.stride(0),
            page_size,
            ring_tokens,
            ring_pages,
            ATTN=attn,
            SWA=swa,
            BLOCK_COLS=block_cols(num_cols),
            BLOCK_RING=triton.next_power_of_2(max(1, ring_pages)),
        )
    return (slot_mapping, tables) if attn else None, (swa_slot_mapping, swa_tables) if swa else None
