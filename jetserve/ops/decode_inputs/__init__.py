"""The next decode step's inputs, written by the step before (`advance_decode_inputs`): the last op of every decode
graph, so a step launched ahead for the same rows replays with no copy of its own (`GraphRunner.run_next`). One
Triton launch (`kernels.py`) when `use_triton(positions)` says so, else the reference."""

from __future__ import annotations

import torch

from jetserve.ops.backend import use_triton
from jetserve.ops.decode_inputs import kernels, reference


def advance_decode_inputs(
    tokens: torch.Tensor,
    positions: torch.Tensor,
    state_indices: torch.Tensor,
    input_ids: torch.Tensor,
    used_positions: torch.Tensor,
) -> None:
    """tokens [N] int64, positions [N] int64 (in place), state_indices [N], input_ids [N] int64 (out),
    used_positions [N] int64 (out). See `reference.advance_decode_inputs`."""
    fn = kernels.advance_decode_inputs if use_triton(positions) else reference.advance_decode_inputs
    fn(tokens, positions, state_indices, input_ids, used_positions)
