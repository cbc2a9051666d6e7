"""The layers tensor parallelism swaps into a built model: row-parallel linear (partial sums, one all-reduce),
vocab-parallel embedding, and the vocab-parallel logits (each rank's rows of the tied lm_head, all-gathered)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from jetserve.distributed.group import TensorParallelGroup
from jetserve.ops.linear import gated_norm_linear, linear, swiglu_linear
from jetserve.ops.linear.reference import AddNorm, with_add_norm
from jetserve.ops.norm import rms_norm


class RowParallelLinear(nn.Module):
    """`y = all_reduce(x_local W_localᵀ)`: the rank holds the input columns of its heads (or MLP channels), so its
    product is a partial sum of the full output. No bias (o_proj and down_proj have none). With `add_norm` the next
    RMSNorm runs after the all-reduce (its residual add needs the whole sum), as its own op."""

    def __init__(self, in_features: int, out_features: int, group: TensorParallelGroup) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))  # [out, in_local]
        self.group = group

    def forward(self, x: torch.Tensor, add_norm: AddNorm | None = None) -> torch.Tensor | tuple[torch.Tensor, ...]:
        y = self.group.all_reduce(linear(x, self.weight))  # [T, out], summed over the ranks
        return with_add_norm(y, add_norm, rms_norm)

    def forward_gated_norm(
        self,
        o: torch.Tensor,
        gate: torch.Tensor,
        norm_weight: torch.Tensor,
        eps: float,
        add_norm: AddNorm | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """`self(gated_rms_norm(o, norm_weight, gate))` for this rank's heads, the norm fused into the GEMM."""
        y = self.group.all_reduce(gated_norm_linear(o, gate, norm_weight, eps, self.weight))  # [T, out]
        return with_add_norm(y, add_norm, rms_norm)

    def forward_swiglu(
        self, gate_up: torch.Tensor, add_norm: AddNorm | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """`self(silu(gate) * up)` for this rank's [gate | up] channels, the activation fused into the GEMM."""
        y = self.group.all_reduce(swiglu_linear(gate_up, self.weight))  # [T, out]
        return with_add_norm(y, add_norm, rms_norm)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features} (local), out_features={self.out_features}"


class VocabParallelEmbedding(nn.Module):
    """Rank r holds rows `[vocab_start, vocab_start + rows_per_rank)` of the table (zero rows past the vocabulary
    pad the last rank); a token outside its range contributes zeros, and the all-reduce fills in the one row."""

    def __init__(self, vocab_size: int, embedding_dim: int, rows_per_rank: int, group: TensorParallelGroup) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.rows_per_rank = rows_per_rank
        self.vocab_start = group.rank * rows_per_rank
        self.weight = nn.Parameter(torch.empty(rows_per_rank, embedding_dim))  # [V_local, hidden]
        self.group = group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.vocab_start  # [T]
        is_here = (local >= 0) & (local < self.rows_per_rank)  # [T]
        out = F.embedding(torch.where(is_here, local, 0), self.weight)  # [T, hidden]
        out = out.masked_fill_(~is_here[:, None], 0)
        return self.group.all_reduce(out)

    def extra_repr(self) -> str:
        return f"rows {self.vocab_start}..{self.vocab_start + self.rows_per_rank} of {self.vocab_size}"


def vocab_parallel_logits(
    hidden: torch.Tensor, weight: torch.Tensor, vocab_size: int, group: TensorParallelGroup
) -> torch.Tensor:
    """`hidden` [N, hidden] against this rank's lm_head rows `weight` [V_local, hidden] → logits [N, vocab] fp32,
    the same on every rank (gathered in the model dtype, then cast)."""
    local = F.linear(hidden, weight)  # [N, V_local]
    gathered = group.all_gather(local)  # [ranks, N, V_local]
    num_rows = hidden.shape[0]
    logits = gathered.permute(1, 0, 2).reshape(num_rows, -1)  # [N, ranks * V_local]
    return logits[:, :vocab_size].float().contiguous()
