"""Triton building blocks shared by the decode, verify and commit kernels: load one token's normalised q/k, its gates,
and advance a `[BK, BV]` fp32 state tile by one token."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def unit(b_x, EPS: tl.constexpr):
    """An fp32 `[BK]` vector divided by sqrt(|x|² + EPS)."""
    return b_x * tl.rsqrt(tl.sum(b_x * b_x) + EPS)


@triton.jit
def load_unit(ptr, o_k, m_k, EPS: tl.constexpr):
    """A `[BK]` vector (masked lanes 0) divided by sqrt(|x|² + EPS), in fp32."""
    return unit(tl.load(ptr + o_k, mask=m_k, other=0.0).to(tl.float32), EPS)


@triton.jit
def gates(b_a, b_b, A_log_h, dt_bias_h):
    """`g = -exp(A_log) * softplus(a + dt_bias)` and `beta = sigmoid(b)` from raw fp32 a, b (scalars or vectors)."""
    b_x = b_a + dt_bias_h
    # torch's softplus returns x itself above 20; the minimum keeps exp finite on the untaken side
    b_softplus = tl.where(b_x > 20.0, b_x, tl.log(1.0 + tl.exp(tl.minimum(b_x, 20.0))))
    return -tl.exp(A_log_h) * b_softplus, tl.sigmoid(b_b)


@triton.jit
def load_gates(a_ptr, b_ptr, A_log_h, dt_bias_h):
    """The gates of one (token, head), fp32 scalars."""
    return gates(tl.load(a_ptr).to(tl.float32), tl.load(b_ptr).to(tl.float32), A_log_h, dt_bias_h)


@triton.jit
def delta_step(b_s, b_k, b_v, b_g, b_beta):
    """`S ← exp(g)·S; e = β (v − Sᵀk); S ← S + k eᵀ` on a tile: b_s `[BK, BV]`, b_k `[BK]`, b_v `[BV]` (fp32)."""
    b_s = b_s * tl.exp(b_g)
    b_e = b_beta * (b_v - tl.sum(b_s * b_k[:, None], axis=0))
    return b_s + b_k[:, None] * b_e[None, :]


def block_sizes(K: int, V: int, block_v: int | None) -> tuple[int, int]:
    """BK covers all of K (the l2 norm needs the whole vector); BV tiles V."""
    BK = triton.next_power_of_2(K)
    BV = min(triton.next_power_of_2(V), 32) if block_v is None else block_v
    assert BV & (BV - 1) == 0, f"block_v {BV} must be a power of two"
    return BK, BV


def unit_last_stride(x: torch.Tensor) -> torch.Tensor:
    """The kernels index rows by stride and the last dim densely."""
    return x if x.stride(-1) == 1 else x.contiguous()


def check_state_layout(state: torch.Tensor) -> None:
    if state.stride(3) != 1 or state.stride(2) != state.shape[3] or state.stride(1) != state.shape[2] * state.shape[3]:
        raise ValueError(f"gated_delta_rule: state {tuple(state.shape)} must be contiguous within each slot")
