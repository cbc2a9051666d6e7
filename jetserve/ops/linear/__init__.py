"""Linear layers `y = x @ weightᵀ + bias`: a Triton skinny GEMM for decode-sized x, cuBLAS (`F.linear`) otherwise."""

from __future__ import annotations

import torch

from jetserve.ops.backend import use_triton
from jetserve.ops.linear import reference

GEMV_MAX_ROWS = 16  # rows of x up to which the Triton kernel runs; past it, F.linear (cuBLAS)
_TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (any leading dims), weight [N, K], bias [N] or None → y [M, N] in x.dtype. See `reference.linear`.

    Triton when the backend allows it, 1 ≤ M ≤ GEMV_MAX_ROWS (M = the product of x's leading dims) and the dtype is
    fp16/bf16/fp32; else `F.linear`.
    """
    num_rows = x.numel() // x.shape[-1] if x.dim() >= 1 and x.shape[-1] > 0 else 0
    if use_triton(x) and 1 <= num_rows <= GEMV_MAX_ROWS and x.dtype in _TRITON_DTYPES:
        from jetserve.ops.linear import kernels

        return kernels.linear(x, weight, bias)
    return reference.linear(x, weight, bias)


__all__ = ["GEMV_MAX_ROWS", "linear"]
