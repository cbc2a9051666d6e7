"""The JetBlock mixer's decode core in one Triton launch: for one sequence, one head and BV value channels, the kernel
generator's κ for those channels (w2 rows streamed once per sequence, FMAs over G), the dynamic conv over the window
(shifted in place), and the gated delta rule step of the state tile [K, BV] on the conv's output. Channel c of the conv
is value column c % V of head c // V, so a program's conv channels are exactly the V columns its state tile updates:
nothing crosses programs, and the conv's output never leaves registers.

For few sequences only (`jetserve.ops.jet_mixer.FUSED_MAX_ROWS`): w2 is read once per sequence, where the separate conv
kernel reads it once per step for up to 16.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from jetserve.ops.dynamic_conv.checks import check_decode_args
from jetserve.ops.gated_delta_rule.reference import L2NORM_EPS, check_gate_params, check_heads, check_state
from jetserve.ops.gated_delta_rule.step import check_state_layout, delta_step, load_gates, load_unit, unit_last_stride
from jetserve.ops.jet_mixer.reference import check_mixer_args
from jetserve.ops.layout import dense
from jetserve.ops.pdl import pdl_enter, pdl_exit, pdl_launch


@triton.jit
def _jet_mixer_decode_kernel(
    u,  # [N, H*V]
    h,  # [N, G]
    w2_weight,  # [H*V*W, G]
    w2_bias,  # [H*V*W]
    conv_state,  # [S, W-1, H*V]
    q,  # [N, H, K]
    k,  # [N, H, K]
    a,  # [N, H]
    b,  # [N, H]
    A_log,  # [H] fp32
    dt_bias,  # [H] fp32
    state,  # [S, H, K, V] fp32
    state_indices,  # [N] int32
    o,  # [N, H, V]
    num_g,
    stride_u,
    stride_h,
    stride_slot,
    stride_row,
    stride_q_n,
    stride_q_h,
    stride_k_n,
    stride_k_h,
    stride_a_n,
    stride_b_n,
    stride_s,
    scale,
    H: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    W: tl.constexpr,
    WT: tl.constexpr,  # next power of two >= W
    WP: tl.constexpr,  # next power of two >= W-1
    BK: tl.constexpr,
    BV: tl.constexpr,
    BG: tl.constexpr,
    EPS: tl.constexpr,
    PDL: tl.constexpr = False,  # programmatic dependent launch (`jetserve.ops.pdl`)
):
    pdl_enter(PDL)
    i_n, i_h, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n64 = i_n.to(tl.int64)
    slot = tl.load(state_indices + i_n).to(tl.int64)
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    o_c = i_h * V + o_v  # [BV] conv channels = this tile's value columns
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    m_s = m_k[:, None] & m_v[None, :]

    # The recurrent state tile and the token's q, k and gates do not depend on the conv: loaded first, in flight
    # while w2 streams.
    p_s = state + slot * stride_s + i_h * (K * V) + o_k[:, None] * V + o_v[None, :]
    b_s = tl.load(p_s, mask=m_s, other=0.0)  # [BK, BV] fp32
    b_q = load_unit(q + i_n64 * stride_q_n + i_h * stride_q_h, o_k, m_k, EPS) * scale
    b_k = load_unit(k + i_n64 * stride_k_n + i_h * stride_k_h, o_k, m_k, EPS)
    b_g, b_beta = load_gates(
        a + i_n64 * stride_a_n + i_h, b + i_n64 * stride_b_n + i_h, tl.load(A_log + i_h), tl.load(dt_bias + i_h)
    )

    # κ [BV, WT] in fp32: w2 row c*W + j times h, over G in BG steps (taps j >= W are 0); offsets from the tile's
    # first row fit 32 bits, and each step is reduced at once (a [BV, WT, BG] accumulator cost ~230 registers)
    o_j = tl.arange(0, WT)
    m_cj = m_v[:, None] & (o_j < W)[None, :]
    p_w2 = w2_weight + (i_h * V + i_v * BV).to(tl.int64) * W * num_g  # row c*W of the tile's first channel
    o_w = (tl.arange(0, BV)[:, None] * W + o_j[None, :]) * num_g  # [BV, WT]
    kappa = tl.zeros((BV, WT), dtype=tl.float32)
    for g0 in range(0, num_g, BG):
        o_g = g0 + tl.arange(0, BG)
        m_g = o_g < num_g
        b_h = tl.load(h + i_n64 * stride_h + o_g, mask=m_g, other=0.0).to(tl.float32)  # [BG]
        m_w = m_cj[:, :, None] & m_g[None, None, :]
        b_w = tl.load(p_w2 + o_w[:, :, None] + o_g[None, None, :], mask=m_w, other=0.0)  # [BV, WT, BG]
        kappa += tl.sum(b_w.to(tl.float32) * b_h[None, None, :], axis=2)  # [BV, WT]
    w_rows = (o_c[:, None] * W + o_j[None, :]).to(tl.int64)  # [BV, WT]
    kappa += tl.load(w2_bias + w_rows, mask=m_cj, other=0.0).to(tl.float32)

    # The conv over (window rows 0..W-2, u); its output rounded to u's dtype, as the conv op returns it.
    p_win = conv_state + slot * stride_slot + o_c  # [BV]: row 0 of the window
    x_w = tl.load(p_win[:, None] + o_j[None, :] * stride_row, mask=m_v[:, None] & (o_j < W - 1)[None, :], other=0.0)
    b_u = tl.load(u + i_n64 * stride_u + o_c, mask=m_v, other=0.0)  # [BV]
    x = tl.where((o_j == W - 1)[None, :], b_u.to(tl.float32)[:, None], x_w.to(tl.float32))  # [BV, WT]
    v_hat = tl.sum(kappa * x, axis=1)  # [BV]
    b_v = (v_hat * tl.sigmoid(v_hat)).to(u.dtype.element_ty).to(tl.float32)

    # Shift the window: new row r is old row r+1, the last new row is u. Every load of it precedes every store.
    o_r = tl.arange(0, WP)
    m_r = m_v[:, None] & (o_r < W - 1)[None, :]
    from_u = (o_r == W - 2)[None, :]
    p_rows = p_win[:, None] + o_r[None, :] * stride_row  # [BV, WP]
    shifted = tl.load(p_rows + stride_row, mask=m_r & ~from_u, other=0.0)
    new = tl.where(from_u, b_u.to(conv_state.dtype.element_ty)[:, None], shifted)

    b_s = delta_step(b_s, b_k, b_v, b_g, b_beta)
    b_o = tl.sum(b_s * b_q[:, None], axis=0)  # [BV]
    tl.debug_barrier()
    tl.store(p_rows, new, mask=m_r)
    tl.store(p_s, b_s, mask=m_s)
    tl.store(o + (i_n64 * H + i_h) * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)
    pdl_exit(PDL)


def block_sizes_for(x: torch.Tensor, head_k: int, head_v: int) -> tuple[int, int, int]:
    """(BK, BV, BG): all of K (the l2 norm needs it); 8 value columns (the conv decode's channels per program up to
    16 rows; 384 programs per sequence at the 2B shape) and 128-wide G steps on the GPU; small tiles in the
    interpreter, so tests cross tile edges. With the launch's 4 warps these were the best of 76 tilings on an H200
    (session 22, 2B shape, w2 from HBM): 6.54 µs a layer against 7.69 for the two kernels; the first version's 2 warps
    took 15.3."""
    block_k = triton.next_power_of_2(head_k)
    if not x.is_cuda:
        return block_k, min(4, triton.next_power_of_2(head_v)), 16
    return block_k, min(8, triton.next_power_of_2(head_v)), 128


def jet_mixer_decode(
    u: torch.Tensor,
    h: torch.Tensor,
    w2_weight: torch.Tensor,
    w2_bias: torch.Tensor,
    conv_state: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    state_indices: torch.Tensor,
    scale: float | None = None,
    *,
    block_sizes: tuple[int, int, int] | None = None,
    num_warps: int = 4,
) -> torch.Tensor:
    """See `reference.jet_mixer_decode`; `block_sizes` (BK, BV, BG) and `num_warps` override the launch, for tests and
    tuning.
    Grid (N, H, V / BV); padded rows point at slot 0, which they may clobber."""
    width = check_decode_args(u, h, w2_weight, w2_bias, conv_state, state_indices)
    num_heads, head_v = check_mixer_args(u, q, k, state)
    if h.dtype != w2_weight.dtype:
        raise ValueError(f"h ({h.dtype}) and w2_weight ({w2_weight.dtype}) must share a dtype")
    check_heads(q, k, u.view(u.shape[0], num_heads, head_v), a, b)
    check_state(state, k, u.view(u.shape[0], num_heads, head_v))
    check_gate_params(A_log, dt_bias, k)
    check_state_layout(state)
    assert conv_state.stride(2) == 1, "conv_state rows must be contiguous"
    num_rows, head_k = q.shape[0], q.shape[2]
    scale = head_k**-0.5 if scale is None else scale
    u = u if u.stride(-1) == 1 else u.contiguous()
    h = h if h.stride(-1) == 1 else h.contiguous()
    w2_weight = w2_weight.contiguous()
    q, k, a, b = (unit_last_stride(x) for x in (q, k, a, b))
    (state_indices,) = dense(state_indices)
    o = torch.empty(num_rows, num_heads, head_v, dtype=u.dtype, device=u.device)  # [N, H, V]
    if num_rows == 0:
        return o
    BK, BV, BG = block_sizes or block_sizes_for(u, head_k, head_v)
    _jet_mixer_decode_kernel[(num_rows, num_heads, triton.cdiv(head_v, BV))](
        u,
        h,
        w2_weight,
        w2_bias,
        conv_state,
        q,
        k,
        a,
        b,
        A_log,
        dt_bias,
        state,
        state_indices,
        o,
        h.shape[1],
        u.stride(0),
        h.stride(0),
        conv_state.stride(0),
        conv_state.stride(1),
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        a.stride(0),
        b.stride(0),
        state.stride(0),
        scale,
        H=num_heads,
        K=head_k,
        V=head_v,
        W=width,
        WT=triton.next_power_of_2(width),
        WP=triton.next_power_of_2(width - 1),
        BK=BK,
        BV=BV,
        BG=BG,
        EPS=L2NORM_EPS,
        num_warps=num_warps,
        **pdl_launch(u),
    )
    return o
