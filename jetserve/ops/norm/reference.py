"""RMSNorm (plain, fused with the residual add, per-head gated) and SwiGLU's silu-and-mul in pure PyTorch, fp32 math."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def check_rms_norm(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> None:
    """ValueError unless x [..., D], weight [D] and residual (None, or x's shape and dtype) fit together."""
    if x.dim() < 1:
        raise ValueError("x must have a last (channel) dimension")
    if weight.shape != (x.shape[-1],):
        raise ValueError(f"weight must be [D] = [{x.shape[-1]}], got shape {tuple(weight.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(
            f"residual must match x ({tuple(x.shape)}, {x.dtype}), got {tuple(residual.shape)}, {residual.dtype}"
        )


def _normalize(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()  # [..., D]
    variance = x32.pow(2).mean(dim=-1, keepdim=True)  # [..., 1]
    return (weight.float() * (x32 * torch.rsqrt(variance + eps))).to(x.dtype)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Jet-Nemotron's RMSNorm over the last dim: `(weight.float() * (x32 * rsqrt(mean(x32²) + eps))).to(x.dtype)`.

    x32 = x.float(): the variance and the scaling are fp32, and the weight is applied before the single cast back
    (DESIGN.md §1; not Qwen2's `weight * normed.to(dtype)`, which rounds twice).

    x [T, D] (any leading dims), weight [D]. Returns y [T, D] in x.dtype. With `residual` [T, D] (x's dtype), first
    `h = x + residual` in x.dtype and returns `(rms_norm(h), h)`: h is the new residual stream.
    """
    check_rms_norm(x, weight, residual)
    if residual is None:
        return _normalize(x, weight, eps)
    h = x + residual  # [T, D] in x.dtype, rounded once like the model's `h += mixer(...)`
    return _normalize(h, weight, eps), h


def check_embed_norm_pair(
    ids: torch.Tensor, table: torch.Tensor, hidden: torch.Tensor, weights: tuple[torch.Tensor, torch.Tensor]
) -> None:
    """ValueError unless ids [T] (integers), table [V, H], hidden [T, H] (table's dtype) and a pair of weights [H]
    fit."""
    if ids.dim() != 1 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise ValueError(f"ids must be [T] integers, got shape {tuple(ids.shape)} {ids.dtype}")
    if table.dim() != 2:
        raise ValueError(f"table must be [V, H], got shape {tuple(table.shape)}")
    width = table.shape[1]
    if hidden.shape != (ids.shape[0], width) or hidden.dtype != table.dtype:
        raise ValueError(
            f"hidden must be [T, H] = [{ids.shape[0]}, {width}] in {table.dtype}, got {tuple(hidden.shape)} "
            f"{hidden.dtype}"
        )
    if len(weights) != 2:
        raise ValueError(f"weights must be a pair (the embedding's norm weight, the hidden's), got {len(weights)}")
    for name, w in zip(("embed", "hidden"), weights, strict=True):
        if w.shape != (width,):
            raise ValueError(f"weights: the {name} norm's must be [H] = [{width}], got shape {tuple(w.shape)}")


def embed_norm_pair(
    ids: torch.Tensor, table: torch.Tensor, hidden: torch.Tensor, weights: tuple[torch.Tensor, torch.Tensor], eps: float
) -> torch.Tensor:
    """EAGLE-3's draft-layer input: `[rms_norm(table[ids], weights[0]); rms_norm(hidden, weights[1])]`, each half
    `rms_norm`'s math and single rounding. ids [T], table [V, H], hidden [T, H], weights a pair of [H] → [T, 2H] in
    table.dtype."""
    check_embed_norm_pair(ids, table, hidden, weights)
    embeds = table[ids.long()]  # [T, H]
    return torch.cat([_normalize(embeds, weights[0], eps), _normalize(hidden, weights[1], eps)], dim=-1)


def check_gated_rms_norm(o: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor) -> None:
    """ValueError unless o [T, H, V], weight [V] and gate [T, H, V] fit together."""
    if o.dim() != 3:
        raise ValueError(f"o must be [T, H, V], got shape {tuple(o.shape)}")
    if weight.shape != (o.shape[-1],):
        raise ValueError(f"weight must be [V] = [{o.shape[-1]}], got shape {tuple(weight.shape)}")
    if gate.shape != o.shape:
        raise ValueError(f"gate must match o {tuple(o.shape)}, got shape {tuple(gate.shape)}")


def gated_rms_norm(o: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor, eps: float) -> torch.Tensor:
    """JetBlock output norm: per-head RMSNorm over V, times weight, times silu(gate); fp32 inside.

    o [T, H, V], weight [V], gate [T, H, V]. Returns [T, H, V] in o.dtype (one rounding at the end).
    """
    check_gated_rms_norm(o, weight, gate)
    o32 = o.float()  # [T, H, V]
    variance = o32.pow(2).mean(dim=-1, keepdim=True)  # [T, H, 1]
    y = o32 * torch.rsqrt(variance + eps) * weight.float()  # [T, H, V]
    return (y * F.silu(gate.float())).to(o.dtype)


def check_silu_and_mul(x: torch.Tensor) -> None:
    """ValueError unless x is [T, 2I]."""
    if x.dim() < 1 or x.shape[-1] % 2 != 0:
        raise ValueError(f"x must be [T, 2I] with an even last dim, got shape {tuple(x.shape)}")


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU activation: x [T, 2I] = [gate | up] → `silu(gate) * up` [T, I], fp32 math, one rounding to x.dtype."""
    check_silu_and_mul(x)
    gate, up = x.float().chunk(2, dim=-1)  # [T, I] each
    return (F.silu(gate) * up).to(x.dtype)
