"""RMSNorm (plain and fused with the residual add), the JetBlock's per-head gated RMSNorm, and silu_and_mul."""

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


__all__ = ["gated_rms_norm", "rms_norm", "silu_and_mul"]
