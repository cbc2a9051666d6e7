"""Triton variant of `sample`, sort-free and without host synchronisation: a split-row softmax, the keep threshold
from the top-C probabilities (an exact bisection for rows they do not settle), and one fused kernel that hashes the
noise, runs the exponential race over the survivors and reduces to the winner, so the [N, V] noise never exists.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from jetserve.ops.backend import sm_count
from jetserve.ops.layout import dense
from jetserve.ops.sampling.reference import check_argmax_input, check_sample_inputs, check_top_logprob_inputs

BLOCK_V = 1024
NUM_CANDIDATES = 1024  # the top-C probabilities that settle top-k/top-p for most rows without a full sort


@triton.jit
def _mix32(x):
    """The reference's `_mix32` on uint32 (multiplication wraps mod 2^32 natively)."""
    x = x ^ (x >> 16)
    x = x * tl.full((), 0x7FEB352D, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full((), 0x846CA68B, tl.uint32)
    return x ^ (x >> 16)


@triton.jit
def _row_keys(seeds, counters, i_n):
    """The reference's `row_keys` for row i_n, on uint32 (int64 → uint32 keeps the low 32 bits, like `& 2^32-1`)."""
    b_seed = tl.load(seeds + i_n)
    b_counter = tl.load(counters + i_n)
    key = _mix32(b_seed.to(tl.uint32) ^ tl.full((), 0x5851F42D, tl.uint32))
    key = _mix32(key ^ (b_seed >> 32).to(tl.uint32))
    key = _mix32(key ^ b_counter.to(tl.uint32))
    key = _mix32(key ^ (b_counter >> 32).to(tl.uint32))
    return key, _mix32(key ^ tl.full((), 0x2545F491, tl.uint32))


@triton.jit
def _race_kernel(
    probs,
    threshold,
    seeds,
    counters,
    best_score,
    best_index,
    V,
    stride_p,
    SPLIT_V: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """Program (row n, split s) races tokens [s*SPLIT_V, (s+1)*SPLIT_V) of row n; writes its best (score, index)."""
    i_n = tl.program_id(0).to(tl.int64)
    i_s = tl.program_id(1)
    num_splits = tl.num_programs(1)
    b_thr = tl.load(threshold + i_n)
    b_ka, b_kb = _row_keys(seeds, counters, i_n)
    b_best = tl.full((BLOCK_V,), -2.0, tl.float32)  # below every score (filtered tokens score -1)
    b_arg = tl.zeros((BLOCK_V,), tl.int32)
    for i_v in range(i_s * SPLIT_V, (i_s + 1) * SPLIT_V, BLOCK_V):
        o_v = i_v + tl.arange(0, BLOCK_V)
        m_v = o_v < V
        b_p = tl.load(probs + i_n * stride_p + o_v, mask=m_v, other=0.0)
        bits = _mix32(_mix32(b_ka ^ o_v.to(tl.uint32)) ^ b_kb)
        b_u = ((bits >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07  # 2^-23
        b_score = tl.where(m_v & (b_p >= b_thr), b_p / -tl.log(b_u), -1.0)
        # strict '>' keeps, per lane, the earliest block's index among equal scores
        is_better = b_score > b_best
        b_best = tl.where(is_better, b_score, b_best)
        b_arg = tl.where(is_better, o_v, b_arg)
    m_best = tl.max(b_best, axis=0)
    i_best = tl.min(tl.where(b_best == m_best, b_arg, 2147483647), axis=0)  # lowest index among the ties
    tl.store(best_score + i_n * num_splits + i_s, m_best)
    tl.store(best_index + i_n * num_splits + i_s, i_best)


@triton.jit
def _softmax_partials_kernel(
    logits, temperature, part_max, part_sum, V, stride_l, SPLIT_V: tl.constexpr, BLOCK_V: tl.constexpr
):
    """Program (row n, split s): max and Σ exp(z - max) of z = logits / T over its slice (online, per lane)."""
    i_n = tl.program_id(0).to(tl.int64)
    i_s = tl.program_id(1)
    num_splits = tl.num_programs(1)
    b_t = tl.load(temperature + i_n).to(tl.float32)
    b_t = tl.where(b_t <= 0.0, 1.0, b_t)
    b_m = tl.full((BLOCK_V,), float("-inf"), tl.float32)
    b_acc = tl.zeros((BLOCK_V,), tl.float32)
    for i_v in range(i_s * SPLIT_V, (i_s + 1) * SPLIT_V, BLOCK_V):
        o_v = i_v + tl.arange(0, BLOCK_V)
        b_z = tl.load(logits + i_n * stride_l + o_v, mask=o_v < V, other=float("-inf")).to(tl.float32) / b_t
        b_m_new = tl.maximum(b_m, b_z)
        b_safe = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)  # lanes that saw only padding stay at 0
        b_acc = b_acc * tl.exp(b_m - b_safe) + tl.exp(b_z - b_safe)
        b_m = b_m_new
    m = tl.max(b_m, axis=0)  # finite: every split holds at least one token
    tl.store(part_max + i_n * num_splits + i_s, m)
    tl.store(part_sum + i_n * num_splits + i_s, tl.sum(b_acc * tl.exp(b_m - m), axis=0))


@triton.jit
def _softmax_normalize_kernel(
    logits,
    temperature,
    part_max,
    part_sum,
    probs,
    part_mass,
    V,
    stride_l,
    NUM_SPLITS: tl.constexpr,
    SPLIT_V: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """Program (row n, split s): combines the row's partials, writes p = exp(z - max) / Σ and its slice's Σ p."""
    i_n = tl.program_id(0).to(tl.int64)
    i_s = tl.program_id(1)
    o_s = tl.arange(0, NUM_SPLITS)
    b_pm = tl.load(part_max + i_n * tl.num_programs(1) + o_s, mask=o_s < tl.num_programs(1), other=float("-inf"))
    b_ps = tl.load(part_sum + i_n * tl.num_programs(1) + o_s, mask=o_s < tl.num_programs(1), other=0.0)
    m = tl.max(b_pm, axis=0)
    denom = tl.sum(b_ps * tl.exp(b_pm - m), axis=0)
    b_t = tl.load(temperature + i_n).to(tl.float32)
    b_t = tl.where(b_t <= 0.0, 1.0, b_t)
    b_mass = tl.zeros((BLOCK_V,), tl.float32)
    for i_v in range(i_s * SPLIT_V, (i_s + 1) * SPLIT_V, BLOCK_V):
        o_v = i_v + tl.arange(0, BLOCK_V)
        m_v = o_v < V
        b_z = tl.load(logits + i_n * stride_l + o_v, mask=m_v, other=float("-inf")).to(tl.float32) / b_t
        b_p = tl.exp(b_z - m) / denom
        tl.store(probs + i_n * V + o_v, b_p, mask=m_v)
        b_mass += tl.where(m_v, b_p, 0.0)
    tl.store(part_mass + i_n * tl.num_programs(1) + i_s, tl.sum(b_mass, axis=0))


@triton.jit
def _bisect_threshold(p_row, b_k, b_top_p, p_max, V, BLOCK_V: tl.constexpr):
    """`reference.keep_threshold` before min-p, for one row, by bisection on the bit patterns of the probabilities
    (for p ≥ 0, float order is integer order); each step is one pass over the row."""
    hi = p_max.to(tl.int32, bitcast=True) + 1  # count(key ≥ hi) == 0
    # top-k: the largest key t with count(p ≥ t) ≥ k is the k-th largest p (ties included)
    lo = tl.zeros((), tl.int32)
    if (b_k > 0) & (b_k < V):
        k_hi = hi
        for _ in range(32):
            mid = lo + (k_hi - lo) // 2
            b_count = tl.zeros((BLOCK_V,), tl.int32)
            for i_v in range(0, V, BLOCK_V):
                o_v = i_v + tl.arange(0, BLOCK_V)
                b_key = tl.load(p_row + o_v, mask=o_v < V, other=0.0).to(tl.int32, bitcast=True)
                b_count += ((b_key >= mid) & (o_v < V)).to(tl.int32)
            is_open = k_hi - lo > 1
            is_enough = tl.sum(b_count, axis=0) >= b_k
            lo = tl.where(is_open & is_enough, mid, lo)
            k_hi = tl.where(is_open & ~is_enough, mid, k_hi)
    # top-p on the top-k survivors: the largest key t ≥ lo with mass(p ≥ t) ≥ top_p · mass(p ≥ lo)
    if b_top_p < 1.0:
        b_mass = tl.zeros((BLOCK_V,), tl.float32)
        for i_v in range(0, V, BLOCK_V):
            o_v = i_v + tl.arange(0, BLOCK_V)
            b_p = tl.load(p_row + o_v, mask=o_v < V, other=0.0)
            b_mass += tl.where(b_p.to(tl.int32, bitcast=True) >= lo, b_p, 0.0)
        target = b_top_p * tl.sum(b_mass, axis=0)
        for _ in range(32):
            mid = lo + (hi - lo) // 2
            b_mass = tl.zeros((BLOCK_V,), tl.float32)
            for i_v in range(0, V, BLOCK_V):
                o_v = i_v + tl.arange(0, BLOCK_V)
                b_p = tl.load(p_row + o_v, mask=o_v < V, other=0.0)
                b_mass += tl.where(b_p.to(tl.int32, bitcast=True) >= mid, b_p, 0.0)
            is_open = hi - lo > 1
            is_enough = tl.sum(b_mass, axis=0) >= target
            lo = tl.where(is_open & is_enough, mid, lo)
            hi = tl.where(is_open & ~is_enough, mid, hi)
    return lo.to(tl.float32, bitcast=True)


@triton.jit
def _threshold_kernel(
    probs,
    top,
    row_mass,
    top_k,
    top_p,
    min_p,
    threshold,
    V,
    C,
    BLOCK_C: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """Program n: row n's keep threshold from its top-C probabilities `top` [N, C] (largest first), as the reference
    computes it from the full sort; a row they do not settle falls back to `_bisect_threshold` over the whole row."""
    i_n = tl.program_id(0).to(tl.int64)
    o_c = tl.arange(0, BLOCK_C)
    b_top = tl.load(top + i_n * C + o_c, mask=o_c < C, other=0.0)
    p_max = tl.load(top + i_n * C)
    p_last = tl.load(top + i_n * C + C - 1)
    b_k = tl.load(top_k + i_n)
    b_top_p = tl.load(top_p + i_n).to(tl.float32)
    is_k_on = (b_k > 0) & (b_k < V)
    is_p_on = b_top_p < 1.0
    thr_k = tl.where(is_k_on, tl.load(top + i_n * C + tl.minimum(tl.maximum(b_k, 1), C) - 1), 0.0)
    b_after_k = tl.where(b_top >= thr_k, b_top, 0.0)
    b_cum = tl.cumsum(b_after_k, axis=0)
    mass_c = tl.max(b_cum, axis=0)  # the last prefix sum (they never decrease)
    target = b_top_p * tl.where(is_k_on, mass_c, tl.load(row_mass + i_n))
    cut = tl.minimum(tl.sum(((b_cum < target) & (o_c < C)).to(tl.int32), axis=0), C - 1)
    thr_p = tl.where(is_p_on, tl.load(top + i_n * C + cut), 0.0)
    b_thr = tl.maximum(thr_k, thr_p)
    # the top-k tie group may run past C (then the mass misses part of it), and the top-p prefix may not end in C
    is_k_settled = ~is_k_on | ((b_k <= C) & (~is_p_on | (p_last < thr_k)))
    is_p_settled = ~is_p_on | (mass_c >= target)
    if (C < V) & ~(is_k_settled & is_p_settled):
        b_thr = _bisect_threshold(probs + i_n * V, b_k, b_top_p, p_max, V, BLOCK_V)
    b_thr = tl.maximum(b_thr, tl.load(min_p + i_n).to(tl.float32) * p_max)
    tl.store(threshold + i_n, tl.minimum(b_thr, p_max))


def _splits(num_rows: int, vocab_size: int, device: torch.device) -> tuple[int, int]:
    """(number of splits, tokens per split) so that N × splits programs fill the GPU; every split holds a token."""
    num_blocks = triton.cdiv(vocab_size, BLOCK_V)
    num_splits = max(1, min(num_blocks, triton.cdiv(_num_programs_wanted(device), max(num_rows, 1))))
    split_v = triton.cdiv(num_blocks, num_splits) * BLOCK_V
    return triton.cdiv(vocab_size, split_v), split_v


def tempered_probs(logits: torch.Tensor, temperature: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(logits / T) with T ≤ 0 read as 1, split along the row: logits [N, V] → (probs [N, V] fp32, row mass
    Σ p [N] fp32, summed as the kernels see it)."""
    num_rows, vocab_size = logits.shape
    num_splits, split_v = _splits(num_rows, vocab_size, logits.device)
    (temperature,) = dense(temperature)
    part_max = torch.empty(num_rows, num_splits, dtype=torch.float32, device=logits.device)  # [N, splits]
    part_sum = torch.empty_like(part_max)  # [N, splits]
    part_mass = torch.empty_like(part_max)  # [N, splits]
    probs = torch.empty(num_rows, vocab_size, dtype=torch.float32, device=logits.device)  # [N, V]
    if num_rows > 0:
        grid = (num_rows, num_splits)
        _softmax_partials_kernel[grid](
            logits, temperature, part_max, part_sum, vocab_size, logits.stride(0), SPLIT_V=split_v, BLOCK_V=BLOCK_V
        )
        _softmax_normalize_kernel[grid](
            logits,
            temperature,
            part_max,
            part_sum,
            probs,
            part_mass,
            vocab_size,
            logits.stride(0),
            NUM_SPLITS=triton.next_power_of_2(num_splits),
            SPLIT_V=split_v,
            BLOCK_V=BLOCK_V,
        )
    return probs, part_mass.sum(dim=1)


def keep_threshold(
    probs: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    row_mass: torch.Tensor | None = None,
) -> torch.Tensor:
    """`reference.keep_threshold` without a full sort: probs [N, V] (row_mass [N] = Σ p, computed when None) → [N, 1].

    `torch.topk` gives the C largest probabilities; they settle a row when its k ≤ C and, with top-p on, the top-k set
    ends inside them and they hold the top-p mass; other rows are solved exactly by bisection over the whole row.
    Masses are summed in another order than the reference's cumsum, so a row whose cumulative mass lands within
    rounding of top_p may cut one tie group differently.
    """
    num_rows, vocab_size = probs.shape
    num_candidates = min(vocab_size, NUM_CANDIDATES)
    top = probs.topk(num_candidates, dim=-1).values.contiguous()  # [N, C], largest first
    if row_mass is None:
        row_mass = probs.sum(dim=-1)  # [N]
    row_mass, top_k, top_p, min_p = dense(row_mass, top_k, top_p, min_p)
    threshold = torch.empty(num_rows, 1, dtype=torch.float32, device=probs.device)  # [N, 1]
    if num_rows > 0:
        _threshold_kernel[(num_rows,)](
            probs,
            top,
            row_mass,
            top_k,
            top_p,
            min_p,
            threshold,
            vocab_size,
            num_candidates,
            BLOCK_C=triton.next_power_of_2(num_candidates),
            BLOCK_V=BLOCK_V,
        )
    return threshold


@functools.cache
def _num_programs_wanted(device: torch.device) -> int:
    """Two programs per SM: enough splits of the vocabulary that a small batch still fills the GPU."""
    if device.type != "cuda":
        return 4
    return 2 * torch.cuda.get_device_properties(device).multi_processor_count


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    seeds: torch.Tensor,
    counters: torch.Tensor,
    *,
    is_filtered: bool = True,
    has_greedy: bool = True,
) -> torch.Tensor:
    """Same contract, promises and draws as `reference.sample`, up to last-ulp rounding (softmax, log, the order of
    mass sums), which can only change a token at a near-tie: logits [N, V], per-row
    temperature/top_k/top_p/min_p/seeds/counters [N] → [N] int64. No host synchronisation; a row draws the same token
    whichever kernels its batch takes. `is_filtered=False` skips the keep threshold — the top-C `torch.topk`, one
    block per row, most of a small batch's time — whose value for an unfiltered row is exactly 0."""
    check_sample_inputs(logits, temperature, top_k, top_p, min_p, seeds, counters)
    num_rows, vocab_size = logits.shape
    probs, row_mass = tempered_probs(logits, temperature)  # [N, V], [N]
    if is_filtered:
        threshold = keep_threshold(probs, top_k, top_p, min_p, row_mass)  # [N, 1]
    else:  # `_threshold_kernel`'s value for a row with every filter off
        threshold = torch.zeros(num_rows, 1, dtype=torch.float32, device=logits.device)  # [N, 1]
    num_splits, split_v = _splits(num_rows, vocab_size, logits.device)
    seeds, counters = dense(seeds, counters)
    best_score = torch.empty(num_rows, num_splits, dtype=torch.float32, device=logits.device)  # [N, splits]
    best_index = torch.empty(num_rows, num_splits, dtype=torch.int32, device=logits.device)  # [N, splits]
    if num_rows > 0:
        _race_kernel[(num_rows, num_splits)](
            probs,
            threshold,
            seeds,
            counters,
            best_score,
            best_index,
            vocab_size,
            probs.stride(0),
            SPLIT_V=split_v,
            BLOCK_V=BLOCK_V,
        )
    # splits cover increasing index ranges, so argmax's first maximum is also the lowest index among ties
    winner = best_index.gather(1, best_score.argmax(dim=1, keepdim=True)).squeeze(1).long()  # [N]
    if not has_greedy:
        return winner
    return torch.where(temperature <= 0, argmax(logits), winner)


# The argmax's launch (session 28's sweep on an H200, 2B vocabulary, fp32, µs at N = 1 / 7 / 64 / 256 rows; torch
# 8.8 / 10.7 / 22.3 / 54.4): blocks of 1024 logits, 4 warps, ~8 programs an SM 3.5 / 4.5 / 12.2 / 43.7; blocks of
# 4096 with 8 warps 3.8 / 4.9 / 12.7 / 66.6; 2 programs an SM (the sampler's split) 3.6 / 4.5 / 19.6 / 74.7
ARGMAX_BLOCK_V = 1024  # logits a program of the argmax loads at once
ARGMAX_WARPS = 4
ARGMAX_PROGRAMS_PER_SM = 8  # the argmax splits rows until about this many programs an SM exist
ARGMAX_NONE = tl.constexpr(2**31 - 1)  # "no index": above every token index (a constexpr: kernels read it)


@triton.jit
def _argmax_split_kernel(
    logits, part_value, part_index, part_nan, V, stride_l, SPLIT_V: tl.constexpr, BLOCK_V: tl.constexpr
):
    """Program (row n, split s): over its slice, the largest non-NaN value with its first index, and the first NaN's
    index (ARGMAX_NONE when none)."""
    i_n = tl.program_id(0).to(tl.int64)
    i_s = tl.program_id(1)
    num_splits = tl.num_programs(1)
    b_best = tl.full((BLOCK_V,), float("-inf"), tl.float32)
    b_arg = tl.full((BLOCK_V,), ARGMAX_NONE, tl.int32)
    b_nan = tl.full((BLOCK_V,), ARGMAX_NONE, tl.int32)
    for i_v in range(i_s * SPLIT_V, (i_s + 1) * SPLIT_V, BLOCK_V):
        o_v = i_v + tl.arange(0, BLOCK_V)
        m_v = o_v < V
        b_x = tl.load(logits + i_n * stride_l + o_v, mask=m_v, other=float("-inf")).to(tl.float32)
        is_nan = b_x != b_x
        b_nan = tl.minimum(b_nan, tl.where(is_nan & m_v, o_v, ARGMAX_NONE))
        # per lane, a later block replaces only a strictly larger value: the lane keeps its earliest index on ties
        is_better = m_v & ~is_nan & ((b_x > b_best) | (b_arg == ARGMAX_NONE))
        b_best = tl.where(is_better, b_x, b_best)
        b_arg = tl.where(is_better, o_v, b_arg)
    m_best = tl.max(b_best, axis=0)
    tl.store(part_value + i_n * num_splits + i_s, m_best)
    tl.store(part_index + i_n * num_splits + i_s, tl.min(tl.where(b_best == m_best, b_arg, ARGMAX_NONE), axis=0))
    tl.store(part_nan + i_n * num_splits + i_s, tl.min(b_nan, axis=0))


@triton.jit
def _argmax_merge_kernel(part_value, part_index, part_nan, out, num_splits, BLOCK_S: tl.constexpr):
    """Row n: the first NaN if the row has one (torch's argmax counts NaN above every number), else the largest value's
    first index over the splits (in index order, so ties keep the lowest)."""
    i_n = tl.program_id(0).to(tl.int64)
    o_s = tl.arange(0, BLOCK_S)
    m_s = o_s < num_splits
    b_value = tl.load(part_value + i_n * num_splits + o_s, mask=m_s, other=float("-inf"))
    b_index = tl.load(part_index + i_n * num_splits + o_s, mask=m_s, other=ARGMAX_NONE)
    b_nan = tl.min(tl.load(part_nan + i_n * num_splits + o_s, mask=m_s, other=ARGMAX_NONE), axis=0)
    m_best = tl.max(b_value, axis=0)
    b_first = tl.min(tl.where(b_value == m_best, b_index, ARGMAX_NONE), axis=0)
    tl.store(out + i_n, tl.where(b_nan < ARGMAX_NONE, b_nan, b_first).to(tl.int64))


def _argmax_splits(num_rows: int, vocab_size: int, device: torch.device) -> tuple[int, int]:
    """(number of splits, tokens per split) of the argmax: N × splits ≈ ARGMAX_PROGRAMS_PER_SM programs an SM (the
    loads in flight that a read at the copy bandwidth needs), every split at least one block."""
    num_blocks = triton.cdiv(vocab_size, ARGMAX_BLOCK_V)
    wanted = ARGMAX_PROGRAMS_PER_SM * sm_count(device)
    num_splits = max(1, min(num_blocks, triton.cdiv(wanted, max(num_rows, 1))))
    split_v = triton.cdiv(num_blocks, num_splits) * ARGMAX_BLOCK_V
    return triton.cdiv(vocab_size, split_v), split_v


def argmax(logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """`logits.argmax(dim=-1)` for logits [..., V] (fp32/fp16/bf16, rows may be strided) → [...] int64: the first
    maximum; a NaN counts above every number, as in torch. Into `out` [...] int64 (contiguous) when given. The row
    is split so N × splits programs fill the GPU (torch's reduction takes a small batch's row in one block), then one
    program per row merges the splits."""
    check_argmax_input(logits, out)
    lead, vocab_size = logits.shape[:-1], logits.shape[-1]
    rows = logits.reshape(-1, vocab_size)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    num_rows = rows.shape[0]
    out = torch.empty(num_rows, dtype=torch.int64, device=logits.device) if out is None else out.view(num_rows)
    if num_rows == 0:
        return out.view(lead)
    num_splits, split_v = _argmax_splits(num_rows, vocab_size, logits.device)
    part_value = torch.empty(num_rows, num_splits, dtype=torch.float32, device=logits.device)  # [N, splits]
    part_index = torch.empty(num_rows, num_splits, dtype=torch.int32, device=logits.device)  # [N, splits]
    part_nan = torch.empty_like(part_index)  # [N, splits]
    _argmax_split_kernel[(num_rows, num_splits)](
        rows, part_value, part_index, part_nan, vocab_size, rows.stride(0), SPLIT_V=split_v, BLOCK_V=ARGMAX_BLOCK_V,
        num_warps=ARGMAX_WARPS,
    )  # fmt: skip
    _argmax_merge_kernel[(num_rows,)](
        part_value, part_index, part_nan, out, num_splits, BLOCK_S=triton.next_power_of_2(num_splits)
    )
    return out.view(lead)


@triton.jit
def _top_logprob_split_kernel(
    logits, part_max, part_sum, part_index, part_bad, V, stride_l, SPLIT_V: tl.constexpr, BLOCK_V: tl.constexpr
):
    """Program (row n, split s): over its slice, the largest value and its first index, the sum of exp(x − that
    largest value), and whether the slice holds a NaN or +inf. Each lane keeps a running maximum and rescales its sum
    when the maximum grows (a lane that has seen only -inf keeps a sum of 0)."""
    i_n = tl.program_id(0).to(tl.int64)
    i_s = tl.program_id(1)
    num_splits = tl.num_programs(1)
    b_max = tl.full((BLOCK_V,), float("-inf"), tl.float32)
    b_sum = tl.zeros((BLOCK_V,), tl.float32)
    b_arg = tl.full((BLOCK_V,), ARGMAX_NONE, tl.int32)
    b_bad = tl.zeros((BLOCK_V,), tl.int32)
    for i_v in range(i_s * SPLIT_V, (i_s + 1) * SPLIT_V, BLOCK_V):
        o_v = i_v + tl.arange(0, BLOCK_V)
        m_v = o_v < V
        b_x = tl.load(logits + i_n * stride_l + o_v, mask=m_v, other=float("-inf")).to(tl.float32)
        b_bad = tl.where((b_x != b_x) | (b_x == float("inf")), 1, b_bad)
        # a later block replaces only a strictly larger value: the lane keeps its earliest index on ties
        is_better = m_v & ((b_x > b_max) | (b_arg == ARGMAX_NONE))
        b_arg = tl.where(is_better, o_v, b_arg)
        b_new = tl.where(b_x > b_max, b_x, b_max)
        is_finite = b_new > float("-inf")
        b_sum = tl.where(is_finite, b_sum * tl.exp(b_max - b_new) + tl.exp(b_x - b_new), 0.0)
        b_max = b_new
    m_max = tl.max(b_max, axis=0)
    b_scaled = tl.where(b_max > float("-inf"), b_sum * tl.exp(b_max - m_max), 0.0)
    o_p = i_n * num_splits + i_s
    tl.store(part_max + o_p, m_max)
    tl.store(part_sum + o_p, tl.sum(b_scaled, axis=0))
    tl.store(part_index + o_p, tl.min(tl.where(b_max == m_max, b_arg, ARGMAX_NONE), axis=0))
    tl.store(part_bad + o_p, tl.max(b_bad, axis=0))


@triton.jit
def _top_logprob_merge_kernel(
    part_max, part_sum, part_index, part_bad, offsets, out_logprob, out_index, num_splits, stride_logprob, stride_index,
    HAS_OFFSETS: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    """Row n: −log(Σ_s sum_s · exp(max_s − max)) and the first index of the maximum over the splits (in index order,
    so ties keep the lowest); (NaN, 0) for a row with a NaN or +inf or no finite value; the index shifted by
    offsets[index] when given."""
    i_n = tl.program_id(0).to(tl.int64)
    o_s = tl.arange(0, BLOCK_S)
    m_s = o_s < num_splits
    b_max = tl.load(part_max + i_n * num_splits + o_s, mask=m_s, other=float("-inf"))
    b_sum = tl.load(part_sum + i_n * num_splits + o_s, mask=m_s, other=0.0)
    b_index = tl.load(part_index + i_n * num_splits + o_s, mask=m_s, other=ARGMAX_NONE)
    is_bad = tl.max(tl.load(part_bad + i_n * num_splits + o_s, mask=m_s, other=0), axis=0) > 0
    m_max = tl.max(b_max, axis=0)
    is_bad = is_bad | (m_max == float("-inf"))
    total = tl.sum(tl.where(b_max > float("-inf"), b_sum * tl.exp(b_max - m_max), 0.0), axis=0)
    index = tl.where(is_bad, 0, tl.min(tl.where(b_max == m_max, b_index, ARGMAX_NONE), axis=0)).to(tl.int64)
    if HAS_OFFSETS:
        index += tl.load(offsets + index).to(tl.int64)
    tl.store(out_logprob + i_n * stride_logprob, tl.where(is_bad, float("nan"), -tl.log(tl.where(is_bad, 1.0, total))))
    tl.store(out_index + i_n * stride_index, index)


def top_logprob(
    logits: torch.Tensor, offsets: torch.Tensor | None = None, out: tuple[torch.Tensor, torch.Tensor] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference.top_logprob` (the first maximum of each row of logits [N, V] and its log-prob, the index shifted by
    offsets[index] when given; into `out`, any stride, when given) in two launches: the argmax's split of each row,
    each slice's maximum, first index and sum of exponentials, then one program per row merging them — where
    `log_softmax` then `max` read the row in one block each (an EAGLE-3 draft's top-1 at every level)."""
    check_top_logprob_inputs(logits, offsets, out)
    num_rows, vocab_size = logits.shape
    rows = logits if logits.stride(-1) == 1 else logits.contiguous()
    (offsets,) = dense(offsets)
    device = logits.device
    if out is None:
        out = (torch.empty(num_rows, dtype=torch.float32, device=device),  # [N]
               torch.empty(num_rows, dtype=torch.int64, device=device))  # [N]  # fmt: skip
    out_logprob, out_index = out
    if num_rows == 0:
        return out_logprob, out_index
    num_splits, split_v = _argmax_splits(num_rows, vocab_size, device)
    part_max = torch.empty(num_rows, num_splits, dtype=torch.float32, device=device)  # [N, splits]
    part_sum = torch.empty_like(part_max)  # [N, splits]
    part_index = torch.empty(num_rows, num_splits, dtype=torch.int32, device=device)  # [N, splits]
    part_bad = torch.empty_like(part_index)  # [N, splits]
    _top_logprob_split_kernel[(num_rows, num_splits)](
        rows, part_max, part_sum, part_index, part_bad, vocab_size, rows.stride(0), SPLIT_V=split_v,
        BLOCK_V=ARGMAX_BLOCK_V, num_warps=ARGMAX_WARPS,
    )  # fmt: skip
    _top_logprob_merge_kernel[(num_rows,)](
        part_max, part_sum, part_index, part_bad, offsets if offsets is not None else out_index, out_logprob,
        out_index, num_splits, out_logprob.stride(0), out_index.stride(0), HAS_OFFSETS=offsets is not None,
        BLOCK_S=triton.next_power_of_2(num_splits),
    )  # fmt: skip
    return out_logprob, out_index
