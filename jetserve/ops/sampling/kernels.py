"""Triton variant of `sample`: the filter threshold from the reference's torch ops, then one fused kernel that hashes
the noise, runs the exponential race over the survivors and reduces to the winner, so the [N, V] noise never exists.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from jetserve.ops.sampling.reference import check_sample_inputs, tempered_probs

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
def _exact_threshold_kernel(
    probs,
    top_k,
    top_p,
    min_p,
    threshold,
    is_settled,
    V,
    stride_p,
    BLOCK_V: tl.constexpr,
):
    """For a row the top-C candidates did not settle: `reference.keep_threshold` by bisection on the bit patterns of
    the probabilities (for p ≥ 0, float order is integer order), each step one pass over the row. Other rows return."""
    i_n = tl.program_id(0).to(tl.int64)
    if tl.load(is_settled + i_n) == 0:
        p_row = probs + i_n * stride_p
        b_k = tl.load(top_k + i_n)
        b_top_p = tl.load(top_p + i_n)
        # the row's max, as a key: count(key ≥ hi) == 0
        b_max = tl.zeros((BLOCK_V,), tl.float32)
        for i_v in range(0, V, BLOCK_V):
            o_v = i_v + tl.arange(0, BLOCK_V)
            b_max = tl.maximum(b_max, tl.load(p_row + o_v, mask=o_v < V, other=0.0))
        p_max = tl.max(b_max, axis=0)
        hi = p_max.to(tl.int32, bitcast=True) + 1
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
        b_thr = tl.maximum(lo.to(tl.float32, bitcast=True), tl.load(min_p + i_n) * p_max)
        tl.store(threshold + i_n, tl.minimum(b_thr, p_max))


def keep_threshold(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """`reference.keep_threshold` without a full sort: probs [N, V] → [N, 1].

    The top C probabilities (`torch.topk`) settle a row when its k ≤ C and, with top-p on, the top-k set ends inside
    them and they hold the top-p mass; an unsettled row is solved exactly by `_exact_threshold_kernel`, which every
    other row leaves at once. Masses are summed in a different order from the reference's cumsum, so a row whose
    cumulative mass lands within rounding of top_p may cut one tie group differently.
    """
    num_rows, vocab_size = probs.shape
    num_candidates = min(vocab_size, NUM_CANDIDATES)
    top = probs.topk(num_candidates, dim=-1).values  # [N, C], largest first
    is_k_on = (top_k > 0) & (top_k < vocab_size)  # [N]
    k_index = torch.where(is_k_on, top_k.long() - 1, num_candidates - 1).clamp(max=num_candidates - 1)[:, None]
    threshold_k = torch.where(is_k_on[:, None], top.gather(1, k_index), 0.0)  # [N, 1]
    after_k = torch.where(top >= threshold_k, top, 0.0)  # [N, C]
    mass = after_k.cumsum(dim=-1)  # [N, C]
    total = torch.where(is_k_on[:, None], mass[:, -1:], probs.sum(dim=-1, keepdim=True))  # [N, 1]
    target = top_p.float()[:, None] * total  # [N, 1]
    cut_index = (mass < target).sum(dim=-1, keepdim=True).clamp(max=num_candidates - 1)  # [N, 1]
    is_p_on = top_p[:, None] < 1.0  # [N, 1]
    threshold_p = torch.where(is_p_on, top.gather(1, cut_index), 0.0)  # [N, 1]
    threshold_m = min_p.float()[:, None] * top[:, :1]  # [N, 1]
    threshold = torch.minimum(torch.maximum(torch.maximum(threshold_k, threshold_p), threshold_m), top[:, :1])
    if num_candidates == vocab_size or num_rows == 0:
        return threshold
    # the top-k tie group may run past C (then `total` misses part of it), and the top-p prefix may not end in C
    is_k_settled = ~is_k_on | ((top_k <= num_candidates) & (~is_p_on[:, 0] | (top[:, -1] < threshold_k[:, 0])))
    is_p_settled = ~is_p_on[:, 0] | (mass[:, -1] >= target[:, 0])
    is_settled = (is_k_settled & is_p_settled).to(torch.int8)  # [N]
    threshold = threshold.contiguous()
    _exact_threshold_kernel[(num_rows,)](
        probs, top_k, top_p.float(), min_p.float(), threshold, is_settled, vocab_size, probs.stride(0), BLOCK_V=BLOCK_V
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
) -> torch.Tensor:
    """Same contract and draws as `reference.sample` (up to the last-ulp rounding of the log): logits [N, V], per-row
    temperature/top_k/top_p/min_p/seeds/counters [N] → [N] int64. No host synchronisation."""
    check_sample_inputs(logits, temperature, top_k, top_p, min_p, seeds, counters)
    num_rows, vocab_size = logits.shape
    probs, is_greedy = tempered_probs(logits, temperature)  # [N, V], [N]
    threshold = keep_threshold(probs, top_k, top_p, min_p)  # [N, 1]
    num_blocks = triton.cdiv(vocab_size, BLOCK_V)
    num_splits = max(1, min(num_blocks, triton.cdiv(_num_programs_wanted(logits.device), max(num_rows, 1))))
    split_v = triton.cdiv(num_blocks, num_splits) * BLOCK_V
    num_splits = triton.cdiv(vocab_size, split_v)
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
    return torch.where(is_greedy, logits.argmax(dim=-1), winner)
