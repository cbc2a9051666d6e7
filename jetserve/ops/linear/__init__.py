"""Linear layers `y = x @ weightᵀ + bias`: a Triton skinny GEMM for decode-sized x, cuBLAS (`F.linear`) otherwise."""

from __future__ import annotations

import functools

import torch

from jetserve import envs
from jetserve.ops.backend import use_triton
from jetserve.ops.linear import reference
from jetserve.ops.linear.reference import AddNorm
from jetserve.ops.norm import gated_rms_norm, rms_norm, silu_and_mul

GEMV_MAX_ROWS = 16  # rows of x up to which the Triton kernel runs for any weight; past it, F.linear (cuBLAS)
WIDE_MAX_ROWS = 64  # ... and up to which it runs for a weight of at least WIDE_MIN_N output features
WIDE_MIN_N = 4096  # session 20's sweep (2B, weights from HBM): at 32 and 64 rows the Triton tiles beat cuBLAS for the
# fused JetBlock input (8856 x 1536) and gate|up (17920 x 1536) projections, and lose to it for N = 1536 (o_proj, down)
# in the fused modes (the gated-norm and SwiGLU prologues)
NARROW_MAX_ROWS = 32  # ... and up to which a narrower weight takes it in the plain mode (JETSERVE_NARROW_GEMM), a
# K split's sum launch taking the next RMSNorm: session 31's probe (H200, 2B, bf16, weights from HBM, the public op with
# the add-norm, µs, cuBLAS then the norm op → Triton) at 17 / 32 / 64 rows: o_proj 1536 x 3072 10.07 → 7.93, 9.75 →
# 8.06, 10.01 → 9.41; down 1536 x 8960 14.15 → 12.76, 14.27 → 12.94, 14.59 → 15.87 (slower past 32 rows); the
# attention's o 1536 x 1536 8.0 → 7.3 at every count; its q|k|v 2048 x 1536 without a norm 5.5 → 5.2-5.5 up to 32, 5.6
# → 6.3 at 48 and 64
_TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    silu_cols: int = 0,
    add_norm: AddNorm | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (any leading dims), weight [N, K], bias [N] or None → y [M, N] in x.dtype, SiLU on output columns
    [0, silu_cols) (past the Triton GEMM's rows, a Triton launch after cuBLAS where the backend allows it). With
    `add_norm` = (residual [M, N], norm_weight [N], eps) → `rms_norm(y, norm_weight, eps,
    residual)`'s pair (normed, y + residual): in the Triton launch's epilogue with JETSERVE_ADD_NORM_EPILOGUE=1, else
    the norm op after the GEMM. See `reference.linear`.

    Triton when the backend allows it, 1 ≤ M ≤ GEMV_MAX_ROWS (M = the product of x's leading dims; up to
    WIDE_MAX_ROWS for a weight of ≥ WIDE_MIN_N rows, NARROW_MAX_ROWS for a narrower one), the dtype is fp16/bf16/fp32
    and autograd does not need the product; else `F.linear` (then `rms_norm`). Past GEMV_MAX_ROWS a launch that
    splits K runs `add_norm` in its sum's launch (`_narrow_add_norm`).
    """
    if _takes_triton(x, weight, plain=True):
        from jetserve.ops.linear import kernels

        fused, after = _narrow_add_norm(x, weight, add_norm) or _split_add_norm(add_norm)
        return _then(kernels.linear(x, weight, bias, silu_cols=silu_cols, add_norm=fused), after)
    if add_norm is not None and not silu_cols and (splits := _batched_splits(x, weight)):
        from jetserve.ops.linear import kernels

        return kernels.batched_split_linear(x, weight, bias, add_norm, splits)
    if silu_cols and use_triton(x) and not _needs_grad(x, weight) and x.dtype in _TRITON_DTYPES:  # cuBLAS, then SiLU
        from jetserve.ops.linear import kernels

        return _then(kernels.silu_columns_(reference.linear(x, weight, bias), silu_cols), add_norm)
    return _then(reference.linear(x, weight, bias, silu_cols=silu_cols), add_norm)


def swiglu_linear(
    x: torch.Tensor, weight: torch.Tensor, *, add_norm: AddNorm | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x [M, 2K] = [gate | up] → `silu(gate) * up` times weight [N, K]ᵀ, [M, N] in x.dtype: one Triton launch under
    the same conditions as `linear`, else `silu_and_mul` then `F.linear`. `add_norm` as `linear`'s. See
    `reference.swiglu_linear`."""
    if _takes_triton(x, weight):
        from jetserve.ops.linear import kernels

        fused, after = _split_add_norm(add_norm)
        return _then(kernels.swiglu_linear(x, weight, add_norm=fused), after)
    return linear(silu_and_mul(x), weight, add_norm=add_norm)


def gated_norm_linear(
    o: torch.Tensor,
    gate: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    *,
    add_norm: AddNorm | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """o, gate [M, H·V] → `gated_rms_norm` over heads of V (norm_weight [V]) times weight [N, H·V]ᵀ, [M, N] in
    o.dtype: one Triton launch under the same conditions as `linear` (and V a power of two), else `gated_rms_norm`
    then `linear`. `add_norm` as `linear`'s. See `reference.gated_norm_linear`."""
    head = norm_weight.shape[0]
    if _takes_triton(o, weight) and o.dim() == 2 and head & (head - 1) == 0:
        from jetserve.ops.linear import kernels

        fused, after = _split_add_norm(add_norm)
        return _then(kernels.gated_norm_linear(o, gate, norm_weight, eps, weight, add_norm=fused), after)
    num_rows, width = o.shape
    shape = (num_rows, width // head, head)  # [M, H, V]
    y = gated_rms_norm(o.reshape(shape), norm_weight, gate.reshape(shape), eps)
    return linear(y.reshape(num_rows, width), weight, add_norm=add_norm)


def _split_add_norm(add_norm: AddNorm | None) -> tuple[AddNorm | None, AddNorm | None]:
    """(for the Triton launch's epilogue, for the norm op after it): the flag decides which takes `add_norm`."""
    if add_norm is None:
        return None, None
    return (add_norm, None) if envs.add_norm_epilogue() else (None, add_norm)


def _narrow_add_norm(x: torch.Tensor, weight: torch.Tensor, add_norm: AddNorm | None) -> tuple[AddNorm, None] | None:
    """(add_norm, None) where the Triton launch of a product past GEMV_MAX_ROWS rows splits K: its sum's launch holds
    whole rows and normalises them (the norm op's launch saved, as `batched_split_linear`'s); else None (the norm op
    after it: an unsplit launch's ticket epilogue would leave one program normalising every row)."""
    num_rows = x.numel() // x.shape[-1]
    if add_norm is None or num_rows <= GEMV_MAX_ROWS:
        return None
    from jetserve.ops.backend import sm_count
    from jetserve.ops.linear import kernels

    n, k = weight.shape
    return (add_norm, None) if kernels.choose_tiling(num_rows, n, k, sm_count(x.device)).num_splits > 1 else None


def _then(y, add_norm: AddNorm | None):
    """y as it is (a tensor, or the epilogue's pair), or `rms_norm`'s pair after it (the op on its own backend)."""
    return reference.with_add_norm(y, add_norm, rms_norm)


def _takes_triton(x: torch.Tensor, weight: torch.Tensor, plain: bool = False) -> bool:
    """The Triton kernel's conditions: the backend allows it, 1 ≤ M ≤ GEMV_MAX_ROWS rows (M = the product of x's
    leading dims; ≤ WIDE_MAX_ROWS for a weight of ≥ WIDE_MIN_N rows, and in the `plain` mode — no prologue — ≤
    NARROW_MAX_ROWS for a narrower one unless JETSERVE_NARROW_GEMM=0), a dtype it takes, and no autograd (the kernel
    has no backward)."""
    num_rows = x.numel() // x.shape[-1] if x.dim() >= 1 and x.shape[-1] > 0 else 0
    if weight.dim() == 2 and weight.shape[0] >= WIDE_MIN_N:
        max_rows = WIDE_MAX_ROWS
    else:
        max_rows = NARROW_MAX_ROWS if plain and envs.narrow_gemm() else GEMV_MAX_ROWS
    return use_triton(x) and not _needs_grad(x, weight) and 1 <= num_rows <= max_rows and x.dtype in _TRITON_DTYPES


def _batched_splits(x: torch.Tensor, weight: torch.Tensor) -> int:
    """K splits of `kernels.batched_split_linear` for a product past the Triton GEMM's rows whose next RMSNorm it
    takes (0: cuBLAS then the norm op): the Triton backend, JETSERVE_SPLIT_NORM on, a narrow weight (N < WIDE_MIN_N:
    o_proj, down — a whole output row in one program), and `kernels.batched_splits`' count."""
    if not envs.split_norm() or not use_triton(x) or _needs_grad(x, weight) or x.dtype not in _TRITON_DTYPES:
        return 0
    if weight.dim() != 2 or weight.shape[0] >= WIDE_MIN_N or x.dim() < 1 or x.shape[-1] == 0:
        return 0
    from jetserve.ops.linear import kernels

    return kernels.batched_splits(x.numel() // x.shape[-1], x.shape[-1])


def _needs_grad(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether autograd needs the product (the Triton kernels have no backward)."""
    return torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)


def logits_linear(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [N, K] against the lm_head weight [V, K] → logits [N, V] fp32, into `out` (contiguous [N, V] fp32) when
    given: a decode graph's static buffer, which a copy would cost a pass over (~74 µs at the 2B's batch 256). On
    CUDA with fp16/bf16 operands cuBLAS writes its fp32 accumulator directly (`torch.mm(..., out_dtype=float32)`):
    logits rounded to bf16 first tie at the top of a large vocabulary often enough to flip greedy tokens between two
    kernels that round differently (verify and decode), and they cost a second pass to widen. Elsewhere, and on a
    torch without that GEMM: `reference`."""
    if x.is_cuda and x.dtype in (torch.float16, torch.bfloat16) and x.dim() == 2 and _has_fp32_out_gemm(x.device):
        reference.check_logits_out(x, weight, out)
        if out is None:
            return torch.mm(x, weight.t(), out_dtype=torch.float32)
        if _has_fp32_out_gemm(x.device, into=True):
            return torch.mm(x, weight.t(), out_dtype=torch.float32, out=out)
        return out.copy_(torch.mm(x, weight.t(), out_dtype=torch.float32))
    return reference.logits_linear(x, weight, out)


@functools.cache
def _has_fp32_out_gemm(device: torch.device, into: bool = False) -> bool:
    """Whether this torch runs a half-precision GEMM with an fp32 output on `device` (`into`: into a given buffer;
    tried once, eagerly: the first logits come from a warm-up step, never from inside a graph capture)."""
    a = torch.ones(2, 8, dtype=torch.bfloat16, device=device)
    b = torch.ones(4, 8, dtype=torch.bfloat16, device=device).t()
    try:
        if into:
            out = torch.zeros(2, 4, dtype=torch.float32, device=device)
            torch.mm(a, b, out_dtype=torch.float32, out=out)
        else:
            out = torch.mm(a, b, out_dtype=torch.float32)
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    return out.dtype == torch.float32 and bool((out == 8).all())


__all__ = [
    "GEMV_MAX_ROWS",
    "NARROW_MAX_ROWS",
    "WIDE_MAX_ROWS",
    "WIDE_MIN_N",
    "gated_norm_linear",
    "linear",
    "logits_linear",
    "swiglu_linear",
]
