"""Building blocks shared by every decoder layer: RMSNorm and the SwiGLU MLP, on `jetserve.ops`."""

from __future__ import annotations

import torch
from torch import nn

from jetserve.model.fusion import InputProjections
from jetserve.ops.linear import gated_norm_linear, linear, swiglu_linear
from jetserve.ops.linear.reference import AddNorm
from jetserve.ops.norm import rms_norm

# A producer's output: its tensor, or with `add_norm` the next RMSNorm's pair (normed, output + residual).
Output = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


class Linear(nn.Linear):
    """nn.Linear through `ops.linear` (the Triton skinny GEMM for decode-sized inputs, cuBLAS otherwise); same
    parameters and state_dict names."""

    def forward(self, x: torch.Tensor, add_norm: AddNorm | None = None) -> Output:
        """`add_norm` = (residual, norm weight, eps): the next RMSNorm's pair instead (`ops.linear`). Under autocast
        (training: `jetserve.train`, bf16 on CUDA) nn.Linear's own forward, which autocast casts: `ops.linear`
        requires x and the weight in one dtype, and autocast hands it bf16 activations beside fp32 weights."""
        if add_norm is None and torch.is_autocast_enabled(x.device.type):
            return super().forward(x)
        return linear(x, self.weight, self.bias, add_norm=add_norm)

    def forward_gated_norm(
        self,
        o: torch.Tensor,
        gate: torch.Tensor,
        norm_weight: torch.Tensor,
        eps: float,
        add_norm: AddNorm | None = None,
    ) -> Output:
        """`self(gated_rms_norm(o, norm_weight, gate))` for o, gate [T, H·V] (heads of V = norm_weight's size), the
        norm fused into the GEMM."""
        assert self.bias is None, "the fused gated-norm GEMM has no bias"
        return gated_norm_linear(o, gate, norm_weight, eps, self.weight, add_norm=add_norm)

    def forward_swiglu(self, gate_up: torch.Tensor, add_norm: AddNorm | None = None) -> Output:
        """`self(silu(gate) * up)` for gate_up [T, 2 in] = [gate | up], the activation fused into the GEMM."""
        assert self.bias is None, "the fused SwiGLU GEMM has no bias"
        return swiglu_linear(gate_up, self.weight, add_norm=add_norm)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """`x` [T, D]; with `residual` [T, D] returns (norm(x + residual), x + residual)."""
        return rms_norm(x, self.weight, self.eps, residual)


class MLP(InputProjections, nn.Module):
    """SwiGLU: down(silu(gate x) * up x), no biases; gate and up are one GEMM (`InputProjections`)."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)

    def input_projections(self) -> tuple[nn.Linear, ...]:
        return self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor, add_norm: AddNorm | None = None) -> Output:
        gate_up = self.project(x)  # [T, 2I]
        return self.down_proj.forward_swiglu(gate_up, add_norm)  # [T, hidden]: down(silu(gate) * up)
