"""Where the tokens of a draft catch-up sit and write their K/V: N rows of C tokens, each row's first `num_valid`
valid (a verify step's accepted path, or the positions plain decode steps left to the draft), the rest padding. The
contract of `draft_rows`, in plain PyTorch."""

from __future__ import annotations

import torch


def check_draft_rows_args(
    start_positions: torch.Tensor, num_valid: torch.Tensor, block_tables: torch.Tensor, width: int, page_size: int
) -> None:
    num_rows = start_positions.shape[0] if start_positions.dim() == 1 else -1
    if num_rows < 0 or num_valid.shape != (num_rows,):
        raise ValueError(f"draft_rows: start_positions {tuple(start_positions.shape)} and num_valid "
                         f"{tuple(num_valid.shape)} must be [N]")  # fmt: skip
    if block_tables.dim() != 2 or block_tables.shape[0] != num_rows or block_tables.dtype != torch.int32:
        raise ValueError(f"draft_rows: block_tables {tuple(block_tables.shape)} {block_tables.dtype} must be "
                         f"[N={num_rows}, P] int32")  # fmt: skip
    if width < 1 or page_size < 1:
        raise ValueError(f"draft_rows: width ({width}) and page_size ({page_size}) must be ≥ 1")


def draft_rows(
    start_positions: torch.Tensor,  # [N] int: the draft position of each row's first token
    num_valid: torch.Tensor,  # [N] int: each row's valid tokens (0..C); the rest are padding
    block_tables: torch.Tensor,  # [N, P] int32: each row's logical → physical page
    width: int,  # C: tokens per row
    page_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(positions [N, C] int64, slots [N, C] int64, last [N] int64, context_lens [N] int32).

    Row n's token c sits at start + min(c, last), where last = max(num_valid - 1, 0) is the row's last valid offset:
    a padding token takes the last valid position, so its RoPE and page lookups stay inside what the sequence holds.
    Its slot is the physical slot (page * page_size + offset in the page) of that position where c < num_valid, else
    -1 (writes nothing). context_lens = start + C: the rows are causal among themselves, so what each row attends to
    ends there."""
    check_draft_rows_args(start_positions, num_valid, block_tables, width, page_size)
    device = start_positions.device
    offset = torch.arange(width, device=device)  # [C]
    valid = num_valid.long()  # [N]
    last = (valid - 1).clamp(min=0)  # [N]
    starts = start_positions.long()  # [N]
    positions = starts[:, None] + torch.minimum(offset[None, :], last[:, None])  # [N, C]
    pages = block_tables.long().gather(1, positions // page_size)  # [N, C]
    slots = torch.where(offset[None, :] < valid[:, None], pages * page_size + positions % page_size, -1)  # [N, C]
    return positions, slots, last, (starts + width).to(torch.int32)
