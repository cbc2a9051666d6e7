"""The positions, K/V slots, last valid offsets and context lengths of a draft catch-up's rows (`Drafter.extend_rows`):
`draft_rows` runs one Triton launch (`kernels.py`) when `use_triton(start_positions)` says so, else the reference."""

from __future__ import annotations

import torch

from jetserve.ops.backend import use_triton
from jetserve.ops.draft_rows import kernels, reference


def draft_rows(
    start_positions: torch.Tensor, num_valid: torch.Tensor, block_tables: torch.Tensor, width: int, page_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """start_positions, num_valid [N], block_tables [N, P] int32 → (positions [N, C] int64, slots [N, C] int64 (-1:
    not stored), last [N] int64, context_lens [N] int32). See `reference.draft_rows`."""
    fn = kernels.draft_rows if use_triton(start_positions) else reference.draft_rows
    return fn(start_positions, num_valid, block_tables, width, page_size)
