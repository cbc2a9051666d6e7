"""The linear layer `y = x @ weightᵀ + bias` in pure PyTorch (`F.linear`), and the argument checks both variants use."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from jetserve.ops.norm.reference import gated_rms_norm, rms_norm, silu_and_mul

# (residual [..., N], norm_weight [N], eps): the output's residual add and RMSNorm, `rms_norm(y, norm_weight, eps,
# residual)`, returned as its pair (normed, y + residual) — the next layer's norm folded into a GEMM's epilogue
AddNorm = tuple[torch.Tensor, torch.Tensor, float]


def check_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, silu_cols: int = 0) -> None:
    """ValueError unless x [..., K], weight [N, K] and bias (None or [N]) fit together and share x's dtype, and
    0 ≤ silu_cols ≤ N."""
    if x.dim() < 1:
        raise ValueError("x must have a last (input feature) dimension")
    if weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
        raise ValueError(f"weight must be [N, K] with K = {x.shape[-1]}, got shape {tuple(weight.shape)}")
    if weight.dtype != x.dtype:
        raise ValueError(f"weight dtype {weight.dtype} differs from x dtype {x.dtype}")
    if not 0 <= silu_cols <= weight.shape[0]:
        raise ValueError(f"silu_cols must be in [0, {weight.shape[0]}], got {silu_cols}")
    if bias is not None and (bias.shape != (weight.shape[0],) or bias.dtype != x.dtype):
        raise ValueError(
            f"bias must be [N] = [{weight.shape[0]}] in {x.dtype}, got shape {tuple(bias.shape)}, {bias.dtype}"
        )


def check_add_norm(add_norm: AddNorm, out_shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """ValueError unless add_norm's residual has the output's shape and dtype and its norm weight is [N]."""
    residual, norm_weight, _ = add_norm
    if tuple(residual.shape) != tuple(out_shape) or residual.dtype != dtype:
        raise ValueError(
            f"add_norm: residual must be the output's {tuple(out_shape)} in {dtype}, got {tuple(residual.shape)}, "
            f"{residual.dtype}"
        )
    if norm_weight.shape != (out_shape[-1],):
        raise ValueError(f"add_norm: norm weight must be [N] = [{out_shape[-1]}], got {tuple(norm_weight.shape)}")


def with_add_norm(
    y: torch.Tensor, add_norm: AddNorm | None, norm: Callable = rms_norm
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """y, or with add_norm `norm(y, norm_weight, eps, residual)`'s pair (normed, y + residual): this module's pure
    PyTorch RMSNorm, or the op (`jetserve.ops.norm.rms_norm`) where the caller's backend picks."""
    if add_norm is None:
        return y
    check_add_norm(add_norm, tuple(y.shape), y.dtype)
    residual, norm_weight, eps = add_norm
    return norm(y, norm_weight, eps, residual)


def check_swiglu_linear(x: torch.Tensor, weight: torch.Tensor) -> None:
    """ValueError unless x [..., 2K] ([gate | up]) and weight [N, K] fit together and share x's dtype."""
    if x.dim() < 1 or x.shape[-1] % 2:
        raise ValueError(f"x must end in an even [gate | up] dimension, got shape {tuple(x.shape)}")
    if weight.dim() != 2 or 2 * weight.shape[1] != x.shape[-1]:
        raise ValueError(f"weight must be [N, K] with 2K = {x.shape[-1]}, got shape {tuple(weight.shape)}")
    if weight.dtype != x.dtype:
        raise ValueError(f"weight dtype {weight.dtype} differs from x dtype {x.dtype}")


def check_gated_norm_linear(
    o: torch.Tensor, gate: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor
) -> None:
    """ValueError unless o and gate [M, H·V] match, norm_weight is [V] with V a power of two dividing H·V, and weight
    [N, H·V] shares o's dtype."""
    if o.dim() != 2 or gate.shape != o.shape:
        raise ValueError(f"o and gate must be [M, H*V] alike, got {tuple(o.shape)} and {tuple(gate.shape)}")
    head = norm_weight.shape[0] if norm_weight.dim() == 1 else 0
    if head < 1 or head & (head - 1) or o.shape[1] % head:
        raise ValueError(
            f"norm_weight must be [V], V a power of two dividing {o.shape[1]}, got {tuple(norm_weight.shape)}"
        )
    check_linear(o, weight, None)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    silu_cols: int = 0,
    add_norm: AddNorm | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`F.linear`: x [M, K] (any leading dims), weight [N, K] (nn.Linear layout), bias [N] or None → y [M, N], x.dtype;
    then SiLU on output columns [0, silu_cols) (the JetBlock's q, k and kernel-generator columns of its fused input
    projection), in fp32, rounded to x.dtype.

    On a GPU this is cuBLAS (fp32 accumulation for fp16/bf16, one rounding at the end); the Triton variant matches it to
    rounding (it applies the SiLU before its one rounding). With `add_norm`, `with_add_norm`'s pair.
    """
    check_linear(x, weight, bias, silu_cols)
    y = F.linear(x, weight, bias)
    if not silu_cols:
        return with_add_norm(y, add_norm)
    if torch.is_grad_enabled() and y.requires_grad:  # autograd: out of place
        return with_add_norm(torch.cat([F.silu(y[..., :silu_cols]), y[..., silu_cols:]], dim=-1), add_norm)
    F.silu(y[..., :silu_cols], inplace=True)  # one launch, in place (torch's SiLU computes in fp32 and rounds once)
    return with_add_norm(y, add_norm)


def swiglu_linear(
    x: torch.Tensor, weight: torch.Tensor, *, add_norm: AddNorm | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The MLP's activation then its down projection: `silu(gate) * up` of x [..., 2K] = [gate | up] in fp32, rounded
    to x.dtype (as `ops.norm.silu_and_mul`), times weight [N, K]ᵀ → [..., N] in x.dtype (`add_norm` as `linear`'s)."""
    check_swiglu_linear(x, weight)
    return with_add_norm(F.linear(silu_and_mul(x), weight), add_norm)


def gated_norm_linear(
    o: torch.Tensor,
    gate: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    *,
    add_norm: AddNorm | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The JetBlock's output: `gated_rms_norm` of o over heads of V = norm_weight's size (fp32 inside, rounded to
    o.dtype), then times weight [N, H·V]ᵀ. o, gate [M, H·V] → [M, N] in o.dtype (`add_norm` as `linear`'s)."""
    check_gated_norm_linear(o, gate, norm_weight, weight)
    num_rows, width = o.shape
    head = norm_weight.shape[0]
    shape = (num_rows, width // head, head)  # [M, H, V]
    y = gated_rms_norm(o.reshape(shape), norm_weight, gate.reshape(shape), eps)
    return with_add_norm(F.linear(y.reshape(num_rows, width), weight), add_norm)


def logits_linear(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Logits: x [N, K] against the lm_head weight [V, K] → [N, V] fp32, here the product in x.dtype widened to fp32
    (the variant on CUDA writes the GEMM's fp32 accumulator directly); into `out` [N, V] fp32 when given."""
    check_logits_out(x, weight, out)
    logits = F.linear(x, weight).float()
    return logits if out is None else out.copy_(logits)


def check_logits_out(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None) -> None:
    check_linear(x, weight, None)
    if out is not None:
        expect = (*x.shape[:-1], weight.shape[0])
        if out.dtype != torch.float32 or tuple(out.shape) != expect or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous fp32 {list(expect)}, got {out.dtype} {list(out.shape)}")
