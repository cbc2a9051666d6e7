"""Greedy acceptance of draft chains with the verify step's result rows (`chain_accept_emit`): one Triton launch
(`kernels.py`) when `use_triton(tokens)` says so, else the reference."""

from __future__ import annotations

import torch

from jetserve.ops.backend import use_triton
from jetserve.ops.chain_accept import kernels, reference
from jetserve.ops.chain_accept.reference import Accepted, Forced


def chain_accept_emit(
    target: torch.Tensor, tokens: torch.Tensor, slots: torch.Tensor, forced: Forced = None
) -> Accepted:
    """target, tokens [N, T_d], slots [N] (0: a padded row), forced (num_accepted, bonus) or None → (accepted [N, T_d]
    int32, num_accepted [N] int32, bonus [N] int64, result [N, T_d + 2] int64). See `reference.chain_accept_emit`."""
    fn = kernels.chain_accept_emit if use_triton(tokens) else reference.chain_accept_emit
    return fn(target, tokens, slots, forced)


__all__ = ["chain_accept_emit"]
