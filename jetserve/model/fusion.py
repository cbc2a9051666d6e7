"""Inference-time fusion of the projections that read the same input (q/k/v, the JetBlock's seven, gate/up): one weight
per group, of which the group's nn.Linear modules keep owning row views, so names, state_dict and sharding stay as they
are. `fuse_projections` is the last step of every inference construction path (after dtype, device and TP sharding)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TypeVar

import torch
from torch import nn

from jetserve.ops.linear import linear

logger = logging.getLogger(__name__)
ModuleT = TypeVar("ModuleT", bound=nn.Module)


# The fused output's row stride is padded to a multiple of this many columns (zero weight rows after the group's):
# the kernels reading its views (the JetBlock's q, k, h, u, a, b, gate) get a row stride Triton specializes as divisible
# by 16, so their row loads vectorise. The 2B JetBlock's 8856 columns → 8864: on an H200 (session 27, views of the
# projection's output, µs a call) the conv verify at 64 chains of 6 34.3 → 18.3, the conv decode at 256 rows 20.3 →
# 13.1, the delta rule's chain verify at 64 65.4 → 59.1.
OUTPUT_ROW_ALIGN = 16


@dataclass(frozen=True)
class FusedWeights:
    """A group's weights (and biases) as one tensor. `pointers` are the addresses each Linear's weight (and bias) had
    as a view of it: a parameter replaced since (`cast_model`, `.to`, `load_state_dict(assign=True)`) no longer
    matches, and the group then runs unfused (`InputProjections.project`) until `fuse_projections` runs again.
    Rows past `width` are zero padding (OUTPUT_ROW_ALIGN)."""

    weight: torch.Tensor  # [Σ out + pad, in]
    bias: torch.Tensor | None  # [Σ out + pad]
    pointers: tuple[int, ...]
    width: int  # Σ out

    def is_current(self, linears: tuple[nn.Linear, ...]) -> bool:
        return _pointers(linears) == self.pointers


class InputProjections:
    """Mixin of a module whose `input_projections()` all read the same x. `project(x)` is their outputs side by side
    in `input_projections()` order, as one GEMM: over the fused weight once `fuse_projections` has run, else over the
    weights concatenated on the fly (training, where autograd must reach each weight, or a model built directly).
    Both paths run the same GEMM on the same values."""

    fused_input: FusedWeights | None = None

    def input_projections(self) -> tuple[nn.Linear, ...]:
        raise NotImplementedError

    def project(self, x: torch.Tensor, silu_cols: int = 0) -> torch.Tensor:
        """x [T, in] → [T, Σ out], SiLU on output columns [0, silu_cols) (in the GEMM's epilogue on the Triton path).
        On either path the result is a view whose row stride is padded to a multiple of OUTPUT_ROW_ALIGN."""
        linears = self.input_projections()
        fused = self.fused_input
        if fused is not None and not fused.is_current(linears):
            logger.warning("%s: parameters replaced after fuse_projections; unfused until it runs again", _name(self))
            self.fused_input = fused = None  # drop the stale copy: its storage is no longer the parameters'
        if fused is not None and not (torch.is_grad_enabled() and any(li.weight.requires_grad for li in linears)):
            return linear(x, fused.weight, fused.bias, silu_cols=silu_cols)[:, : fused.width]  # [T, Σ out]
        weight, bias, width = _concatenated(linears, detach=False)  # [Σ out + pad, in], [Σ out + pad]
        return linear(x, weight, bias, silu_cols=silu_cols)[:, :width]  # [T, Σ out]

    def fuse_input_projections(self) -> None:
        """Concatenate the group's weights (and biases) into one tensor, zero rows after them up to a multiple of
        OUTPUT_ROW_ALIGN, and re-point each Linear's parameters at its rows. A no-op when already fused; skipped on
        the meta device."""
        linears = self.input_projections()
        if self.fused_input is not None and self.fused_input.is_current(linears):
            return
        self.fused_input = None
        weights = [li.weight for li in linears]
        if any(w.is_meta for w in weights):
            return
        assert len({(w.dtype, w.device) for w in weights}) == 1, f"{_name(self)}: projections differ in dtype/device"
        has_bias = linears[0].bias is not None
        assert all((li.bias is not None) == has_bias for li in linears), f"{_name(self)}: some projections lack a bias"
        with torch.no_grad():
            weight, bias, width = _concatenated(linears, detach=True)  # [Σ out + pad, in], [Σ out + pad]
            start = 0
            for li in linears:
                end = start + li.weight.shape[0]
                li.weight.data = weight[start:end]  # same Parameter object: names, requires_grad, optimizers kept
                if bias is not None:
                    li.bias.data = bias[start:end]
                start = end
        self.fused_input = FusedWeights(weight, bias, _pointers(linears), width)


def fuse_projections(model: ModuleT) -> ModuleT:
    """Fuse every `InputProjections` group of `model` (idempotent; cheap when already fused). Call it after anything
    that replaces parameters — dtype casts, device moves, TP sharding, `load_state_dict(assign=True)`: such a
    replacement after fusion is detected at the next forward, which then runs unfused (correct, slower)."""
    for module in model.modules():
        if isinstance(module, InputProjections):
            module.fuse_input_projections()
    return model


def _concatenated(linears: tuple[nn.Linear, ...], detach: bool) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """The group's weights (and biases) stacked, then zero rows up to a multiple of OUTPUT_ROW_ALIGN: the fused and
    the unfused path run the same GEMM. Returns (weight, bias, Σ out)."""
    weights = [li.weight.detach() if detach else li.weight for li in linears]
    width = sum(w.shape[0] for w in weights)
    pad = -width % OUTPUT_ROW_ALIGN
    weight = torch.cat([*weights, weights[0].new_zeros(pad, weights[0].shape[1])])
    if linears[0].bias is None:
        return weight, None, width
    biases = [li.bias.detach() if detach else li.bias for li in linears]
    return weight, torch.cat([*biases, biases[0].new_zeros(pad)]), width


def _pointers(linears: tuple[nn.Linear, ...]) -> tuple[int, ...]:
    return tuple(p.data_ptr() for li in linears for p in (li.weight, li.bias) if p is not None)


def _name(module: object) -> str:
    layer_id = getattr(module, "layer_id", None)
    return type(module).__name__ + ("" if layer_id is None else f" of layer {layer_id}")
