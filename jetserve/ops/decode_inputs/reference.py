"""The contract of `advance_decode_inputs`, in plain PyTorch."""

from __future__ import annotations

import torch


def check_advance_args(
    tokens: torch.Tensor,
    positions: torch.Tensor,
    state_indices: torch.Tensor,
    input_ids: torch.Tensor,
    used_positions: torch.Tensor,
) -> None:
    shape = positions.shape
    if positions.dim() != 1 or any(t.shape != shape for t in (tokens, state_indices, input_ids, used_positions)):
        raise ValueError(f"advance_decode_inputs: tokens {tuple(tokens.shape)}, positions {tuple(shape)}, "
                         f"state_indices {tuple(state_indices.shape)}, input_ids {tuple(input_ids.shape)} and "
                         f"used_positions {tuple(used_positions.shape)} must all be [N]")  # fmt: skip
    if any(t.dtype != torch.int64 for t in (tokens, positions, input_ids, used_positions)):
        raise ValueError("advance_decode_inputs: tokens, positions, input_ids and used_positions must be int64")
    if input_ids.data_ptr() == tokens.data_ptr() or used_positions.data_ptr() == positions.data_ptr():
        raise ValueError("advance_decode_inputs: input_ids must not be tokens, nor used_positions positions")


def advance_decode_inputs(
    tokens: torch.Tensor,  # [N] int64: each row's token just sampled
    positions: torch.Tensor,  # [N] int64, in place: the position each row cached this step
    state_indices: torch.Tensor,  # [N]: each row's state slot (0: padding)
    input_ids: torch.Tensor,  # [N] int64 out: the next step's token ids
    used_positions: torch.Tensor,  # [N] int64 out: this step's positions, as `positions` held them
) -> None:
    """Turn a decode step's inputs into the next step's for the same rows: `used_positions` takes `positions` as the
    step used them, then a real row (slot ≠ 0) moves one position on and takes its sampled token as its input; a
    padding row stays padding (token 0, position unchanged)."""
    check_advance_args(tokens, positions, state_indices, input_ids, used_positions)
    is_real = state_indices != 0  # [N]
    used_positions.copy_(positions)
    input_ids.copy_(torch.where(is_real, tokens, 0))
    positions.add_(is_real.to(torch.int64))
