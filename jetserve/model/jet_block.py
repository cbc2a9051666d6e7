"""The `jet` mixer: gated delta rule linear attention whose values pass through a dynamic convolution."""

from __future__ import annotations

import torch
from torch import nn

from jetserve.config import ModelConfig
from jetserve.model.forward_batch import ForwardBatch, Phase
from jetserve.model.fusion import InputProjections
from jetserve.model.layers import Linear, Output
from jetserve.ops.dynamic_conv import (
    dynamic_conv_decode,
    dynamic_conv_prefill,
    dynamic_conv_verify,
)
from jetserve.ops.gated_delta_rule import (
    decode_takes_norm,
    gated_delta_rule_decode_norm,
    gated_delta_rule_prefill,
    gated_delta_rule_verify,
)
from jetserve.ops.jet_mixer import jet_mixer_commit, jet_mixer_decode
from jetserve.ops.linear import GEMV_MAX_ROWS
from jetserve.ops.linear.reference import AddNorm


class KernelGenerator(nn.Module):
    """κ_t = w2(silu(w1 x_t)) + w2.bias; the ops take silu(w1 x) and fuse w2 with the convolution."""

    def __init__(self, hidden_size: int, generator_dim: int, value_dim: int, conv_size: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(hidden_size, generator_dim, bias=False)
        self.w2 = nn.Linear(generator_dim, value_dim * conv_size, bias=True)


class DynamicConv(nn.Module):
    def __init__(self, hidden_size: int, generator_dim: int, value_dim: int, conv_size: int) -> None:
        super().__init__()
        self.kernel_generator = KernelGenerator(hidden_size, generator_dim, value_dim, conv_size)


class JetBlock(InputProjections, nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        jet = config.jet
        assert jet is not None
        self.layer_id = layer_id
        self.num_heads = jet.num_heads
        self.head_k_dim = jet.head_dim
        self.head_v_dim = jet.head_v_dim
        self.key_dim = jet.key_dim
        self.value_dim = jet.value_dim
        self.norm_eps = jet.norm_eps
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, self.key_dim, bias=False)
        self.k_proj = nn.Linear(hidden, self.key_dim, bias=False)
        self.v_proj = nn.Linear(hidden, self.value_dim, bias=False)
        self.a_proj = nn.Linear(hidden, self.num_heads, bias=False)
        self.b_proj = nn.Linear(hidden, self.num_heads, bias=False)
        self.g_proj = nn.Linear(hidden, self.value_dim, bias=False)
        self.o_proj = Linear(self.value_dim, hidden, bias=False)
        # Kept in fp32 whatever the model dtype (the loader and `cast_model` honour `FP32_PARAMETERS`).
        self.A_log = nn.Parameter(torch.zeros(self.num_heads, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.zeros(self.num_heads, dtype=torch.float32))
        self.dynamic_conv1d = DynamicConv(hidden, jet.generator_dim, self.value_dim, jet.conv_size)
        self.o_norm = nn.Module()
        self.o_norm.weight = nn.Parameter(torch.ones(self.head_v_dim))
        self.conv_state: torch.Tensor | None = None  # [S, W-1, D_v]
        self.recurrent_state: torch.Tensor | None = None  # [S, H, K, V] fp32
        # The last VERIFY step's per-node inputs (u [T, D_v], k [T, H, K], v [T, H, V], a, b [T, H]): all that
        # `commit` needs to advance the committed state along the accepted path, instead of a state per node.
        self.verify_inputs: tuple[torch.Tensor, ...] | None = None

    def bind_state(self, conv_state: torch.Tensor, recurrent_state: torch.Tensor) -> None:
        self.conv_state, self.recurrent_state = conv_state, recurrent_state

    def input_projections(self) -> tuple[nn.Linear, ...]:
        # The three that pass through SiLU first: `project(x, silu_cols=...)` applies it to their leading columns.
        return (self.q_proj, self.k_proj, self.dynamic_conv1d.kernel_generator.w1,
                self.v_proj, self.a_proj, self.b_proj, self.g_proj)  # fmt: skip

    def forward(self, x: torch.Tensor, fb: ForwardBatch, add_norm: AddNorm | None = None) -> Output:
        """[T, hidden], or with `add_norm` the next RMSNorm's pair (`layers.Linear`)."""
        assert self.conv_state is not None, f"layer {self.layer_id}: no JetBlock state bound"
        T, H, K, V = x.shape[0], self.num_heads, self.head_k_dim, self.head_v_dim
        generator = self.dynamic_conv1d.kernel_generator
        D_k, D_v, D_g = self.key_dim, self.value_dim, generator.w1.out_features
        # [T, 2 D_k + D_g + 2 D_v + 2 H] in input_projections' order, SiLU already on q, k and the generator's h
        projected = self.project(x, silu_cols=2 * D_k + D_g)
        # Views, rows strided: the ops take them as they are.
        q, k, h, u, a, b, gate = projected.split([D_k, D_k, D_g, D_v, H, H, D_v], dim=-1)  # [T, D_k] x2, [T, D_g]
        q = q.view(T, H, K)  # [T, H, K]
        k = k.view(T, H, K)  # [T, H, K]
        # u [T, D_v] is raw: what the conv convolves and its window stores; a, b [T, H]; gate [T, D_v]
        conv_args = (generator.w2.weight, generator.w2.bias, self.conv_state)
        gate_args = (self.A_log, self.dt_bias, self.recurrent_state)
        if fb.phase is Phase.PREFILL:
            seq_args = (fb.cu_seqlens, fb.state_indices, fb.has_initial_state)
            v = dynamic_conv_prefill(u, h, *conv_args, *seq_args)  # [T, D_v]
            v = v.view(T, H, V)  # [T, H, V]
            o = gated_delta_rule_prefill(q, k, v, a, b, *gate_args, *seq_args, chunks=fb.delta_chunks)  # [T, H, V]
        elif fb.phase is Phase.DECODE and T > GEMV_MAX_ROWS and decode_takes_norm(T, H, x):
            # Past the rows whose o_proj takes the norm in its prologue, the norm runs in the delta rule's launch.
            v = dynamic_conv_decode(u, h, *conv_args, fb.state_indices).view(T, H, V)  # [T, H, V]
            gate = gate.view(T, H, V)  # [T, H, V], rows strided
            y = gated_delta_rule_decode_norm(q, k, v, a, b, *gate_args, fb.state_indices, gate, self.o_norm.weight,
                                             self.norm_eps)  # fmt: skip
            return self.o_proj(y.view(T, D_v), add_norm)  # [T, hidden]
        elif fb.phase is Phase.DECODE:
            o = jet_mixer_decode(u, h, *conv_args, q, k, a, b, *gate_args, fb.state_indices)  # [T, H, V]
        else:
            v = dynamic_conv_verify(u, h, *conv_args, fb.state_indices, fb.tree_parents).view(T, H, V)
            o = gated_delta_rule_verify(
                q, k, v, a, b, *gate_args, fb.state_indices, fb.tree_parents, is_chain=fb.tree_is_chain
            )
            self.verify_inputs = (u, k, v, a, b)
        # o_proj(gated_rms_norm(o, o_norm.weight, gate)): the per-head norm runs in the GEMM's prologue
        out = o.reshape(T, D_v)
        return self.o_proj.forward_gated_norm(out, gate, self.o_norm.weight, self.norm_eps, add_norm)  # [T, hidden]

    def commit(self, state_indices: torch.Tensor, accepted_nodes: torch.Tensor, num_accepted: torch.Tensor) -> None:
        """Advance the committed conv window and recurrent state along each sequence's accepted path of the last
        VERIFY step (`accepted_nodes` [N, T_d] root first, `num_accepted` [N]); no-op rows have num_accepted 0."""
        assert self.verify_inputs is not None, f"layer {self.layer_id}: commit without a VERIFY step"
        u, k, v, a, b = self.verify_inputs
        jet_mixer_commit(u, self.conv_state, k, v, a, b, self.A_log, self.dt_bias, self.recurrent_state, state_indices,
                         accepted_nodes, num_accepted)  # fmt: skip
