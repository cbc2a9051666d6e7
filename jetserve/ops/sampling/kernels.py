"""Triton variant of `sample`: the filter threshold from the reference's torch ops, then one fused kernel that hashes
the noise, runs the exponential race over the survivors and reduces to the winner, so the [N, V] noise never exists.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from jetserve.ops.sampling.reference import check_sample_inputs, filtered_distribution

BLOCK_V = 1024


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
    probs, threshold, is_greedy = filtered_distribution(logits, temperature, top_k, top_p, min_p)  # [N, V], [N, 1]
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
