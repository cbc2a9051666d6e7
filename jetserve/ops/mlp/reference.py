"""The SwiGLU MLP `down(silu(x W_gateᵀ) * (x W_upᵀ))` as the composition of the linear references, and the argument
checks both variants use."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from jetserve.ops.linear import reference as linear_reference
from jetserve.ops.linear.reference import AddNorm


def check_swiglu_mlp(x: torch.Tensor, gate_up_weight: torch.Tensor, down_weight: torch.Tensor) -> None:
    """ValueError unless x [..., D], gate_up_weight [≥ 2I, D] and down_weight [D, I] fit and share x's dtype."""
    if x.dim() < 1:
        raise ValueError("x must have a last (hidden) dimension")
    hidden = x.shape[-1]
    if down_weight.dim() != 2 or down_weight.shape[0] != hidden:
        raise ValueError(f"down_weight must be [D, I] with D = {hidden}, got shape {tuple(down_weight.shape)}")
    width = 2 * down_weight.shape[1]
    if gate_up_weight.dim() != 2 or gate_up_weight.shape[1] != hidden or gate_up_weight.shape[0] < width:
        raise ValueError(
            f"gate_up_weight must be [>= 2I, D] = [>= {width}, {hidden}], got shape {tuple(gate_up_weight.shape)}"
        )
    if gate_up_weight.dtype != x.dtype or down_weight.dtype != x.dtype:
        raise ValueError(f"weights must be in x's dtype {x.dtype}, got {gate_up_weight.dtype} and {down_weight.dtype}")


def swiglu_mlp(
    x: torch.Tensor, gate_up_weight: torch.Tensor, down_weight: torch.Tensor, *, add_norm: AddNorm | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The decoder layer's MLP: x [..., D] → `gate_up = x gate_up_weight[:2I]ᵀ` rounded to x.dtype (rows [0, I) the
    gate, [I, 2I) the up projection; rows past 2I, a fused weight's zero padding, unused), `silu(gate) * up` in fp32
    rounded to x.dtype (`silu_and_mul`), times down_weight [D, I]ᵀ → [..., D] in x.dtype, fp32 accumulation. With
    `add_norm` = (residual, norm_weight, eps) → `rms_norm(y, norm_weight, eps, residual)`'s pair (normed, y + residual),
    as `ops.linear`'s."""
    check_swiglu_mlp(x, gate_up_weight, down_weight)
    gate_up = F.linear(x, gate_up_weight[: 2 * down_weight.shape[1]])  # [..., 2I]
    return linear_reference.swiglu_linear(gate_up, down_weight, add_norm=add_norm)
