"""RMSNorm (plain and fused with the residual add), the JetBlock's per-head gated RMSNorm, EAGLE-3's draft-layer input
(an embedding row and a hidden state, each normalised, side by side) and silu_and_mul."""

from __future__ import annotations

import torch

from jetserve.ops.backend import use_triton
from jetserve.ops.norm import kernels, reference


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x [T, D], weight [D] → y [T, D]; with residual [T, D] → (y, h = x + residual). See `reference.rms_norm`."""
    if use_triton(x):
        return kernels.rms_norm(x, weight, eps, residual)
    return reference.rms_norm(x, weight, eps, residual)


def embed_norm_pair(
    ids: torch.Tensor, table: torch.Tensor, hidden: torch.Tensor, weights: tuple[torch.Tensor, torch.Tensor], eps: float
) -> torch.Tensor:
    """ids [T], table [V, H], hidden [T, H], weights a pair of [H] → `[rms_norm(table[ids]); rms_norm(hidden)]`
    [T, 2H]. See `reference.embed_norm_pair`."""
    if use_triton(hidden):
        return kernels.embed_norm_pair(ids, table, hidden, weights, eps)
    return reference.embed_norm_pair(ids, table, hidden, weights, eps)


def gated_rms_norm(o: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor, eps: float) -> torch.Tensor:
    """o [T, H, V], weight [V], gate [T, H, V] → [T, H, V]. See `reference.gated_rms_norm`."""
    if use_triton(o):
        return kernels.gated_rms_norm(o, weight, gate, eps)
    return reference.gated_rms_norm(o, weight, gate, eps)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] → silu(x[:, :I]) * x[:, I:] [T, I]. See `reference.silu_and_mul`."""
    if use_triton(x):
        return kernels.silu_and_mul(x)
    return reference.silu_and_mul(x)


__all__ = ["embed_norm_pair", "gated_rms_norm", "rms_norm", "silu_and_mul"]
