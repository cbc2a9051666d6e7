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


@dataclass(frozen=True)
class FusedWeights:
    """A group's weights (and biases) as one tensor. `pointers` are the addresses each Linear's weight (and bias) had
    as a view of it: a parameter replaced since (`cast_model`, `.to`, `load_state_dict(assign=True)`) no longer
    matches, and the group then runs unfused (`InputProjections.project`) until `fuse_projections` runs again."""

    weight: torch.Tensor  # [Σ out, in]
    bias: torch.Tensor | None  # [Σ out]
    pointers: tuple[int, ...]

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
        """x [T, in] → [T, Σ out], SiLU on output columns [0, silu_cols) (in the GEMM's epilogue on the Triton path)."""
        linears = self.input_projections()
        fused = self.fused_input
        if fused is not None and not fused.is_current(linears):
            logger.warning("%s: parameters replaced after fuse_projections; unfused until it runs again", _name(self))
            self.fused_input = fused = None  # drop the stale copy: its storage is no longer the parameters'
        if fused is not None and not (torch.is_grad_enabled() and any(li.weight.requires_grad for li in linears)):
            return linear(x, fused.weight, fused.bias, silu_cols=silu_cols)
        weight = torch.cat([li.weight for li in linears])  # [Σ out, in]
        bias = None if linears[0].bias is None else torch.cat([li.bias for li in linears])  # [Σ out]
        return linear(x, weight, bias, silu_cols=silu_cols)

    def fuse_input_projections(self) -> None:
        """Concatenate the group's weights (and biases) into one tensor and re-point each Linear's parameters at its
        rows. A no-op when already fused; skipped on the meta device."""
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
            weight = torch.cat([w.detach() for w in weights])  # [Σ out, in]
            bias = torch.cat([li.bias.detach() for li in linears]) if has_bias else None  # [Σ out]
            start = 0
            for li in linears:
                end = start + li.weight.shape[0]
                li.weight.data = weight[start:end]  # same Parameter object: names, requires_grad, optimizers kept
                if bias is not None:
                    li.bias.data = bias[start:end]
                start = end
        self.fused_input = FusedWeights(weight, bias, _pointers(linears))


def fuse_projections(model: ModuleT) -> ModuleT:
    """Fuse every `InputProjections` group of `model` (idempotent; cheap when already fused). Call it after anything
    that replaces parameters — dtype casts, device moves, TP sharding, `load_state_dict(assign=True)`: such a
    replacement after fusion is detected at the next forward, which then runs unfused (correct, slower)."""
    for module in model.modules():
        if isinstance(module, InputProjections):
            module.fuse_input_projections()
    return model


def _pointers(linears: tuple[nn.Linear, ...]) -> tuple[int, ...]:
    return tuple(p.data_ptr() for li in linears for p in (li.weight, li.bias) if p is not None)


def _name(module: object) -> str:
    layer_id = getattr(module, "layer_id", None)
    return type(module).__name__ + ("" if layer_id is None else f" of layer {layer_id}")
