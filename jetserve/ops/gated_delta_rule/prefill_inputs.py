"""The chunked prefill's inputs in one launch: q and k l2-normalised into dense `[T, H, K]` rows (the projections hand
over strided views), and the gates g, β in fp32. In torch these were two copies, two norms and eight elementwise
launches a JetBlock layer, each paying the host's launch cost on a short prompt (session 49)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from jetserve.ops.gated_delta_rule.reference import L2NORM_EPS, check_gate_params, check_heads
from jetserve.ops.gated_delta_rule.step import gates

BLOCK_TOKENS = 32  # tokens a program normalises (per head)


@triton.jit
def _unit_rows(x, out, rows, o_k, m, stride_t, stride_h, i_h, H: tl.constexpr, K: tl.constexpr, EPS: tl.constexpr):
    """Rows `[BT, BK]` of head i_h of a strided `[T, H, K]` tensor, each over sqrt(|x|² + EPS), into dense `out`."""
    b_x = tl.load(x + rows[:, None] * stride_t + i_h * stride_h + o_k[None, :], mask=m, other=0.0).to(tl.float32)
    b_x = b_x * tl.rsqrt(tl.sum(b_x * b_x, axis=1) + EPS)[:, None]
    tl.store(out + (rows[:, None] * H + i_h) * K + o_k[None, :], b_x.to(out.dtype.element_ty), mask=m)


@triton.jit
def _prefill_inputs_kernel(
    q,
    k,
    a,
    b,
    A_log,
    dt_bias,
    qn,
    kn,
    g,
    beta,
    T,
    stride_q_t,
    stride_q_h,
    stride_k_t,
    stride_k_h,
    stride_a_t,
    stride_b_t,
    H: tl.constexpr,
    K: tl.constexpr,
    BK: tl.constexpr,
    BT: tl.constexpr,
    EPS: tl.constexpr,
):
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    rows = (i_t * BT + tl.arange(0, BT)).to(tl.int64)  # [BT]
    o_k = tl.arange(0, BK)
    m_t = rows < T
    m = m_t[:, None] & (o_k < K)[None, :]
    _unit_rows(q, qn, rows, o_k, m, stride_q_t, stride_q_h, i_h, H, K, EPS)
    _unit_rows(k, kn, rows, o_k, m, stride_k_t, stride_k_h, i_h, H, K, EPS)
    b_a = tl.load(a + rows * stride_a_t + i_h, mask=m_t, other=0.0).to(tl.float32)
    b_b = tl.load(b + rows * stride_b_t + i_h, mask=m_t, other=0.0).to(tl.float32)
    b_g, b_beta = gates(b_a, b_b, tl.load(A_log + i_h), tl.load(dt_bias + i_h))
    tl.store(g + rows * H + i_h, b_g, mask=m_t)
    tl.store(beta + rows * H + i_h, b_beta, mask=m_t)


def prefill_inputs(
    q: torch.Tensor, k: torch.Tensor, a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k `[T, H, K]` and a, b `[T, H]` (rows may be strided; the last dim dense), A_log, dt_bias `[H]` fp32 →
    q/|q|, k/|k| dense `[T, H, K]` in their dtype, and g, β dense `[T, H]` fp32. See `reference.prefill_inputs`."""
    check_heads(q, k, k, a, b)
    check_gate_params(A_log, dt_bias, k)
    T, H, K = k.shape
    for name, x in (("q", q), ("k", k), ("a", a), ("b", b)):
        if x.stride(-1) != 1:
            raise ValueError(f"prefill_inputs: {name}'s last dim must be dense (stride {x.stride(-1)})")
    qn = torch.empty((T, H, K), dtype=q.dtype, device=q.device)
    kn = torch.empty((T, H, K), dtype=k.dtype, device=k.device)
    g = torch.empty((T, H), dtype=torch.float32, device=a.device)
    beta = torch.empty((T, H), dtype=torch.float32, device=b.device)
    if T == 0:
        return qn, kn, g, beta
    grid = (triton.cdiv(T, BLOCK_TOKENS), H)
    _prefill_inputs_kernel[grid](
        q, k, a, b, A_log, dt_bias, qn, kn, g, beta, T,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), a.stride(0), b.stride(0),
        H=H, K=K, BK=triton.next_power_of_2(K), BT=BLOCK_TOKENS, EPS=L2NORM_EPS,
    )  # fmt: skip
    return qn, kn, g, beta
