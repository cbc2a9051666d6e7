"""`chain_accept_emit` in one Triton launch: program i settles row i — its leading run of matching drafts, the bonus,
the accepted nodes and the result row — where the reference takes ~25 small kernels (a chain verify step's graph
replays them every step)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from jetserve.ops.accept_rows import empty_outputs, store_row
from jetserve.ops.chain_accept.reference import Accepted, Forced, check_chain_args
from jetserve.ops.layout import dense


@triton.jit
def _chain_accept_emit_kernel(
    target,  # [N, T_d] int64
    tokens,  # [N, T_d]
    slots,  # [N]
    forced_count,  # [N] (FORCED)
    forced_bonus,  # [N] (FORCED)
    accepted,  # [N, T_d] int32 out
    num_accepted,  # [N] int32 out
    bonus,  # [N] int64 out
    result,  # [N, T_d + 2] int64 out
    num_nodes,
    FORCED: tl.constexpr,
    BLOCK: tl.constexpr,  # ≥ T_d + 2: a result row
):
    i = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK)
    m_j = j < num_nodes
    has_next = j + 1 < num_nodes
    b_next = tl.load(tokens + i * num_nodes + j + 1, mask=has_next, other=0).to(tl.int64)  # draft j + 1 at j
    if FORCED:
        count = tl.load(forced_count + i).to(tl.int64)
        b_bonus = tl.load(forced_bonus + i).to(tl.int64)
    else:
        b_target = tl.load(target + i * num_nodes + j, mask=m_j, other=0).to(tl.int64)
        is_miss = (b_next != b_target) | ~has_next  # the last node has no draft after it: the run stops there
        drafts = tl.min(tl.where(is_miss, j, BLOCK), axis=0)  # the first miss: the leading run's length
        count = drafts.to(tl.int64) + 1
        b_bonus = tl.load(target + i * num_nodes + drafts).to(tl.int64)
    b_accepted = tl.where(j < count, j, -1)
    store_row(accepted, num_accepted, bonus, result, slots, i, j, b_accepted, count, b_bonus, b_next, num_nodes - 1,
              num_nodes)  # fmt: skip


def chain_accept_emit(
    target: torch.Tensor, tokens: torch.Tensor, slots: torch.Tensor, forced: Forced = None
) -> Accepted:
    """See `reference.chain_accept_emit`."""
    check_chain_args(target, tokens, slots, forced)
    num_seqs, num_nodes = tokens.shape
    device = tokens.device
    target, tokens, slots = dense(target, tokens, slots)
    forced_count, forced_bonus = dense(*forced) if forced is not None else (slots, slots)
    accepted, num_accepted, bonus, result = empty_outputs(num_seqs, num_nodes, device)
    if num_seqs:
        _chain_accept_emit_kernel[(num_seqs,)](
            target,
            tokens,
            slots,
            forced_count,
            forced_bonus,
            accepted,
            num_accepted,
            bonus,
            result,
            num_nodes,
            FORCED=forced is not None,
            BLOCK=triton.next_power_of_2(num_nodes + 2),
        )
    return accepted, num_accepted, bonus, result
