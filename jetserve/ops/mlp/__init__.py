"""The decoder layer's SwiGLU MLP, `down(silu(x W_gateᵀ) * (x W_upᵀ))`, from its normed input to its output (and the
next RMSNorm). `swiglu_mlp` runs the Triton kernels (`kernels.py`: the whole MLP in one launch, then the sum of its
programs' partial outputs with the residual add and the norm) when the backend allows it, x has 1 to
FUSED_MAX_ROWS rows, the dtype is fp16/bf16/fp32, autograd does not need the product and `JETSERVE_FUSED_MLP` is not
0; otherwise the gate|up GEMM then the SwiGLU down GEMM through `ops.linear` (each picking its own variant)."""

from __future__ import annotations

import torch

from jetserve import envs
from jetserve.ops.backend import use_triton
from jetserve.ops.linear import linear, swiglu_linear
from jetserve.ops.linear.reference import AddNorm
from jetserve.ops.mlp import reference
from jetserve.ops.mlp.reference import check_swiglu_mlp

FUSED_MAX_ROWS = 8  # the partial outputs grow with the rows ([P, M, D] fp32); past this, the two GEMMs
_TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def swiglu_mlp(
    x: torch.Tensor, gate_up_weight: torch.Tensor, down_weight: torch.Tensor, *, add_norm: AddNorm | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x [..., D], gate_up_weight [≥ 2I, D] (rows [0, I) gate, [I, 2I) up, any rows past 2I unused), down_weight
    [D, I] → [..., D] in x.dtype; with `add_norm` = (residual, norm_weight, eps) the next RMSNorm's pair (normed,
    y + residual). See `reference.swiglu_mlp`."""
    check_swiglu_mlp(x, gate_up_weight, down_weight)
    if _takes_triton(x, gate_up_weight, down_weight):
        from jetserve.ops.mlp import kernels

        return kernels.swiglu_mlp(x, gate_up_weight, down_weight, add_norm=add_norm)
    gate_up = linear(x, gate_up_weight)[..., : 2 * down_weight.shape[1]]  # [..., 2I]
    return swiglu_linear(gate_up, down_weight, add_norm=add_norm)


def _takes_triton(x: torch.Tensor, gate_up_weight: torch.Tensor, down_weight: torch.Tensor) -> bool:
    num_rows = x.numel() // x.shape[-1] if x.shape[-1] > 0 else 0
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (x, gate_up_weight, down_weight))
    return (
        envs.fused_mlp()
        and use_triton(x)
        and not needs_grad
        and 1 <= num_rows <= FUSED_MAX_ROWS
        and x.dtype in _TRITON_DTYPES
    )


__all__ = ["FUSED_MAX_ROWS", "reference", "swiglu_mlp"]
