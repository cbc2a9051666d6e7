"""Triton SwiGLU MLP for decode-sized x: the gate|up projection, `silu(gate) * up` and the down projection in one
launch, then a second launch that sums the programs' partial outputs (with the residual add and the next RMSNorm).

Each program owns a run of the intermediate channels (runs of equal length, to a multiple of `align` channels, so
every SM streams the same bytes): it streams the run's gate and up weight rows against every row of x, forms
`silu(gate) * up` for the run in registers (rounded where `silu_and_mul` rounds), and multiplies it by the down weight's
columns of the run — the down projection split along its K by the same runs. No program waits for another, so the
down weight streams right behind the gate|up weight: one launch's ramp and drain for the whole MLP where two GEMMs had
one each. The partial outputs [P, M, D] fp32 are summed in a fixed order (deterministic, no atomics) by column
programs; with the next RMSNorm, the last of them to finish normalises the rows (`linear.kernels`' ticket epilogue).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from jetserve.ops.backend import sm_count
from jetserve.ops.linear.kernels import add_norm_epilogue, ticket_counter
from jetserve.ops.linear.reference import AddNorm, check_add_norm
from jetserve.ops.mlp import reference
from jetserve.ops.mlp.reference import check_swiglu_mlp
from jetserve.ops.pdl import pdl_enter, pdl_exit, pdl_launch

MAX_BLOCK_M = 16  # rows of x one launch holds (the partials grow with the rows); more run as several launches
SUM_TILE_ELEMENTS = 8192  # the sum launch loads [BLOCK_P, BLOCK_M, BLOCK_N] partials at a time, about this many


@dataclass(frozen=True)
class MlpTiling:
    """One MLP launch's shape: `programs_per_sm` programs an SM, each a run of the intermediate channels (a multiple of
    `align`); phase A steps over the hidden dim in `block_k` columns, phase B over the outputs in `block_n` rows; the
    sum launch takes `sum_block_n` output columns a program."""

    programs_per_sm: int
    block_k: int
    block_n: int
    use_dot: bool
    num_warps: int = 4
    num_stages: int = 3
    align: int = 16
    sum_block_n: int = 16


def choose_tiling(num_rows: int) -> MlpTiling:
    """The launch for num_rows (≤ MAX_BLOCK_M) rows of x: tensor-core tiles (rows padded to 16), one program an SM.
    Session 30's sweep (bench/mlp.py, H200, 2B, a chain of 28 layers, µs a layer at 1 / 7 rows): one program an SM
    with 128 x 128 steps 30.9 / 47.7, two 32.3 / 64.5, four 42.4 / 110.3; one-row FMA tiles 44.4 at best."""
    assert 0 < num_rows <= MAX_BLOCK_M
    return MlpTiling(programs_per_sm=1, block_k=128, block_n=128, use_dot=True, num_warps=4, num_stages=3)


@dataclass(frozen=True)
class MlpLaunch:
    """What a tiling comes to for a shape: `programs` runs over `num_units` units of `align` channels, the longest run
    fitting `block_i` channels."""

    programs: int
    num_units: int
    block_i: int


def plan_launch(t: MlpTiling, inter: int, num_sms: int) -> MlpLaunch:
    """Programs and the run tile for `inter` intermediate channels on `num_sms` SMs: at most one program per unit of
    `align` channels, runs differing by at most one unit."""
    num_units = triton.cdiv(inter, t.align)
    programs = max(1, min(num_units, t.programs_per_sm * num_sms))
    longest = triton.cdiv(num_units, programs) * t.align
    return MlpLaunch(programs, num_units, max(16, triton.next_power_of_2(longest)))


@triton.jit
def _mlp_partials_kernel(
    x,  # [M, D]
    w_gu,  # [≥ 2I, D]: rows [0, I) gate, [I, 2I) up
    w_d,  # [D, I], either layout: unit stride along I (nn.Linear's) or along D (the transposed weight's rows)
    partial,  # [P, M, D] fp32 out: program p's share of down(silu(gate) * up) over its run of channels
    M,
    D,
    I,
    num_units,  # runs are cut at multiples of ALIGN channels: cdiv(I, ALIGN) units over the programs
    up_offset,  # I * stride_gu: where the up rows start (an int64 argument when it needs one)
    stride_xm,
    stride_gu,
    stride_dn,
    stride_di,
    ALIGN: tl.constexpr,
    USE_DOT: tl.constexpr,
    EVEN_K: tl.constexpr,  # BLOCK_K divides D
    EVEN_N: tl.constexpr,  # BLOCK_N divides D
    INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_I: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PDL: tl.constexpr = False,
):
    i_p = tl.program_id(0)
    num_p = tl.num_programs(0)
    start = (i_p * num_units // num_p) * ALIGN
    end = tl.minimum(((i_p + 1) * num_units // num_p) * ALIGN, I)
    o_i = start + tl.arange(0, BLOCK_I)
    m_i = o_i < end  # channels past the run load nothing: their gate and up are 0, so silu(gate) * up is 0 too
    o_m = tl.arange(0, BLOCK_M)
    m_m = o_m < M
    o_k = tl.arange(0, BLOCK_K)
    p_g = w_gu + o_i.to(tl.int64)[:, None] * stride_gu + o_k[None, :]  # [BLOCK_I, BLOCK_K]
    p_u = p_g + up_offset
    p_x = x + o_m.to(tl.int64)[:, None] * stride_xm + o_k[None, :]  # [BLOCK_M, BLOCK_K]
    pdl_enter(PDL)  # x is the previous kernel's output
    if USE_DOT:  # gateᵀ, upᵀ: the weight tile is the MMA's wide operand
        acc_g = tl.zeros([BLOCK_I, BLOCK_M], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_I, BLOCK_M], dtype=tl.float32)
    else:  # one row: reduced over K once, after the loop
        acc_g = tl.zeros([BLOCK_I, BLOCK_K], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_I, BLOCK_K], dtype=tl.float32)
    for i in range(tl.cdiv(D, BLOCK_K)):
        if EVEN_K:
            m_w = m_i[:, None]
            m_x = m_m[:, None]
        else:
            m_k = (o_k + i * BLOCK_K) < D
            m_w = m_i[:, None] & m_k[None, :]
            m_x = m_m[:, None] & m_k[None, :]
        b_g = tl.load(p_g, mask=m_w, other=0.0)
        b_u = tl.load(p_u, mask=m_w, other=0.0)
        b_x = tl.load(p_x, mask=m_x, other=0.0)
        if USE_DOT:
            b_xt = tl.trans(b_x)  # [BLOCK_K, BLOCK_M]
            acc_g = tl.dot(b_g, b_xt, acc_g, input_precision=INPUT_PRECISION)
            acc_u = tl.dot(b_u, b_xt, acc_u, input_precision=INPUT_PRECISION)
        else:
            b_x32 = b_x.to(tl.float32)  # [1, BLOCK_K]
            acc_g += b_g.to(tl.float32) * b_x32
            acc_u += b_u.to(tl.float32) * b_x32
        p_g += BLOCK_K
        p_u += BLOCK_K
        p_x += BLOCK_K
    if USE_DOT:
        b_gate, b_up = acc_g, acc_u  # [BLOCK_I, BLOCK_M]
    else:
        b_gate, b_up = tl.sum(acc_g, axis=1)[:, None], tl.sum(acc_u, axis=1)[:, None]  # [BLOCK_I, 1]
    # gate and up rounded as the gate|up GEMM's output is; then silu_and_mul's fp32 math and its one rounding
    b_gate = b_gate.to(x.dtype.element_ty).to(tl.float32)
    b_up = b_up.to(x.dtype.element_ty).to(tl.float32)
    b_h = (b_gate * tl.sigmoid(b_gate) * b_up).to(x.dtype.element_ty)  # [BLOCK_I, BLOCK_M]
    o_n = tl.arange(0, BLOCK_N)
    p_d = w_d + o_n.to(tl.int64)[:, None] * stride_dn + o_i.to(tl.int64)[None, :] * stride_di  # [BLOCK_N, BLOCK_I]
    p_o = partial + i_p.to(tl.int64) * M * D + o_m.to(tl.int64)[None, :] * D + o_n[:, None]  # [BLOCK_N, BLOCK_M]
    for j in range(tl.cdiv(D, BLOCK_N)):
        if EVEN_N:
            m_d = m_i[None, :]
            m_o = m_m[None, :]
        else:
            m_n = (o_n + j * BLOCK_N) < D
            m_d = m_n[:, None] & m_i[None, :]
            m_o = m_n[:, None] & m_m[None, :]
        b_d = tl.load(p_d, mask=m_d, other=0.0)  # [BLOCK_N, BLOCK_I]
        if USE_DOT:
            b_o = tl.dot(b_d, b_h, input_precision=INPUT_PRECISION)  # [BLOCK_N, BLOCK_M]
        else:
            b_o = tl.sum(b_d.to(tl.float32) * tl.trans(b_h.to(tl.float32)), axis=1)[:, None]  # [BLOCK_N, 1]
        tl.store(p_o, b_o, mask=m_o)
        p_d += BLOCK_N * stride_dn
        p_o += BLOCK_N
    pdl_exit(PDL)  # the sum launch may start during this one's tail


@triton.jit
def _mlp_sum_kernel(
    partial,  # [P, M, D] fp32
    y,  # [M, D] out
    M,
    D,
    P,
    residual,  # ADD_NORM: [M, D], the residual stream added to the output
    stride_rm,
    h,  # ADD_NORM: [M, D] out, output + residual
    sumsq,  # ADD_NORM: [M, programs] fp32 scratch
    ticket,  # ADD_NORM: [1] int32, 0 between launches
    out_w,  # ADD_NORM: [D], the RMSNorm's weight
    out_eps,
    ADD_NORM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_ROW: tl.constexpr,  # ADD_NORM: next power of two ≥ D
    BLOCK_Q: tl.constexpr,  # ADD_NORM: next power of two ≥ the programs
    PDL: tl.constexpr = False,
):
    i_n = tl.program_id(0)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    o_m = tl.arange(0, BLOCK_M)
    o_p = tl.arange(0, BLOCK_P)
    m_m = o_m < M
    m_y = m_m[:, None] & (o_n < D)[None, :]
    o_y = o_m.to(tl.int64)[:, None] * D + o_n[None, :]  # [BLOCK_M, BLOCK_N]
    pdl_enter(PDL)
    b_y = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for p0 in range(0, P, BLOCK_P):  # a fixed order: the result does not depend on which program finished first
        r_p = p0 + o_p
        p_s = partial + r_p.to(tl.int64)[:, None, None] * M * D + o_y[None, :, :]  # [BLOCK_P, BLOCK_M, BLOCK_N]
        b_s = tl.load(p_s, mask=(r_p < P)[:, None, None] & m_y[None, :, :], other=0.0)
        b_y += tl.sum(b_s, axis=0)
    pdl_exit(PDL)
    if ADD_NORM:
        add_norm_epilogue(b_y, residual, stride_rm, h, sumsq, ticket, out_w, out_eps, y, o_m, o_n, m_m, m_y, M, D,
                           BLOCK_ROW, BLOCK_Q)  # fmt: skip
    else:
        tl.store(y + o_y, b_y.to(y.dtype.element_ty), mask=m_y)


def swiglu_mlp(
    x: torch.Tensor,
    gate_up_weight: torch.Tensor,
    down_weight: torch.Tensor,
    *,
    tiling: MlpTiling | None = None,
    add_norm: AddNorm | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`reference.swiglu_mlp` in two launches. x [M, D] (any leading dims; rows may be strided, unit stride along D or
    copied), gate_up_weight [≥ 2I, D] ([gate; up; zero padding]), down_weight [D, I] → [M, D] in x.dtype; with
    `add_norm` = (residual [M, D], norm_weight [D], eps) the pair (rms_norm(y + residual), y + residual). Meant for
    few rows (decode); more than MAX_BLOCK_M rows run as several launches. `tiling` overrides `choose_tiling`."""
    check_swiglu_mlp(x, gate_up_weight, down_weight)
    lead, d = x.shape[:-1], x.shape[-1]
    inter = down_weight.shape[1]
    num_rows = math.prod(lead)
    if add_norm is not None:
        check_add_norm(add_norm, tuple(x.shape), x.dtype)
    if num_rows == 0 or d == 0 or inter == 0:  # no kernel: the reference's composition
        return reference.swiglu_mlp(x, gate_up_weight, down_weight, add_norm=add_norm)
    x2 = x.reshape(num_rows, d)  # [M, D]
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    gate_up_weight = gate_up_weight if gate_up_weight.stride(-1) == 1 else gate_up_weight.contiguous()
    if 1 not in down_weight.stride():  # neither nn.Linear's layout nor its transpose's
        down_weight = down_weight.contiguous()
    y = torch.empty(num_rows, d, dtype=x.dtype, device=x.device)  # [M, D]
    h = None
    if add_norm is not None:
        residual, out_w, out_eps = add_norm
        residual = residual.reshape(num_rows, d)
        if residual.stride(-1) != 1:
            residual = residual.contiguous()
        h = torch.empty_like(y)  # [M, D]
    for start in range(0, num_rows, MAX_BLOCK_M):
        rows = slice(start, min(num_rows, start + MAX_BLOCK_M))
        add = None if h is None else (residual[rows], out_w, float(out_eps), h[rows])
        _launch(x2[rows], gate_up_weight, down_weight, y[rows], tiling, add)
    if h is None:
        return y.view(*lead, d)
    return y.view(*lead, d), h.view(*lead, d)


def _launch(
    x: torch.Tensor,
    gate_up_weight: torch.Tensor,
    down_weight: torch.Tensor,
    y: torch.Tensor,
    tiling: MlpTiling | None,
    add: tuple[torch.Tensor, torch.Tensor, float, torch.Tensor] | None,  # (residual, out_w, out_eps, h)
) -> None:
    num_rows, d = x.shape
    inter = down_weight.shape[1]
    t = tiling or choose_tiling(num_rows)
    block_m = max(16, triton.next_power_of_2(num_rows)) if t.use_dot else 1
    if block_m < num_rows:
        raise ValueError(f"tiling: FMA tiles hold one row of x, got {num_rows}")
    plan = plan_launch(t, inter, sm_count(x.device))
    partial = torch.empty(plan.programs, num_rows, d, dtype=torch.float32, device=x.device)  # [P, M, D]
    pdl = pdl_launch(x)
    _mlp_partials_kernel[(plan.programs,)](
        x, gate_up_weight, down_weight, partial, num_rows, d, inter, plan.num_units,
        inter * gate_up_weight.stride(0), x.stride(0),
        gate_up_weight.stride(0), *down_weight.stride(),
        ALIGN=t.align, USE_DOT=t.use_dot, EVEN_K=d % t.block_k == 0, EVEN_N=d % t.block_n == 0,
        INPUT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", BLOCK_M=block_m, BLOCK_I=plan.block_i,
        BLOCK_K=t.block_k, BLOCK_N=t.block_n, num_warps=t.num_warps, num_stages=t.num_stages, **pdl,
    )  # fmt: skip
    sum_m = triton.next_power_of_2(num_rows)
    block_n = min(t.sum_block_n, triton.next_power_of_2(d))
    block_p = min(triton.next_power_of_2(plan.programs), max(1, SUM_TILE_ELEMENTS // (sum_m * block_n)))
    programs_n = triton.cdiv(d, block_n)
    if add is None:
        residual, out_w, out_eps, h, sumsq, ticket = y, y, 0.0, y, partial, y
    else:
        residual, out_w, out_eps, h = add
        sumsq = torch.empty(num_rows, programs_n, dtype=torch.float32, device=x.device)  # [M, programs]
        ticket = ticket_counter(x.device)
    _mlp_sum_kernel[(programs_n,)](
        partial, y, num_rows, d, plan.programs, residual, residual.stride(0), h, sumsq, ticket, out_w, out_eps,
        ADD_NORM=add is not None, BLOCK_M=sum_m, BLOCK_N=block_n, BLOCK_P=block_p,
        BLOCK_ROW=triton.next_power_of_2(d) if add is not None else 1,
        BLOCK_Q=triton.next_power_of_2(programs_n) if add is not None else 1, **pdl,
    )  # fmt: skip
