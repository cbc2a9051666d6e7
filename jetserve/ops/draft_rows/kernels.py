"""`draft_rows` in one Triton launch, where the reference takes about fourteen small kernels (a verify graph replays
them every step for the draft's catch-up). Program n writes row n: its positions, slots, last valid offset and
context length."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from jetserve.ops.draft_rows.reference import check_draft_rows_args


@triton.jit
def _draft_rows_kernel(
    start_positions,  # [N] (strided)
    num_valid,  # [N] (strided)
    block_tables,  # [N, P] int32 (row stride)
    positions,  # [N, C] int64 out
    slots,  # [N, C] int64 out
    last,  # [N] int64 out
    context_lens,  # [N] int32 out
    width,
    page_size,
    stride_start,
    stride_valid,
    stride_bt,
    BLOCK_C: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    start = tl.load(start_positions + n * stride_start).to(tl.int64)
    valid = tl.load(num_valid + n * stride_valid).to(tl.int64)
    row_last = tl.maximum(valid - 1, 0)
    o_c = tl.arange(0, BLOCK_C).to(tl.int64)
    m_c = o_c < width
    pos = start + tl.minimum(o_c, row_last)  # [BLOCK_C]
    page = tl.load(block_tables + n * stride_bt + pos // page_size, mask=m_c, other=0).to(tl.int64)
    slot = tl.where(o_c < valid, page * page_size + pos % page_size, -1)
    tl.store(positions + n * width + o_c, pos, mask=m_c)
    tl.store(slots + n * width + o_c, slot, mask=m_c)
    tl.store(last + n, row_last)
    tl.store(context_lens + n, (start + width).to(tl.int32))


def draft_rows(
    start_positions: torch.Tensor, num_valid: torch.Tensor, block_tables: torch.Tensor, width: int, page_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """See `reference.draft_rows`. The vectors may be strided views (a column of the tree's positions); the block
    tables' rows must be contiguous."""
    check_draft_rows_args(start_positions, num_valid, block_tables, width, page_size)
    assert block_tables.stride(1) == 1, "block_tables rows must be contiguous"
    num_rows, device = start_positions.shape[0], start_positions.device
    positions = torch.empty(num_rows, width, dtype=torch.int64, device=device)
    slots = torch.empty(num_rows, width, dtype=torch.int64, device=device)
    last = torch.empty(num_rows, dtype=torch.int64, device=device)
    context_lens = torch.empty(num_rows, dtype=torch.int32, device=device)
    if num_rows:
        _draft_rows_kernel[(num_rows,)](
            start_positions, num_valid, block_tables, positions, slots, last, context_lens, width, page_size,
            start_positions.stride(0), num_valid.stride(0), block_tables.stride(0),
            BLOCK_C=triton.next_power_of_2(width),
        )  # fmt: skip
    return positions, slots, last, context_lens
