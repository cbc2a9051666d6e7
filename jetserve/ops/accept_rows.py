"""What the greedy acceptance kernels (`chain_accept`, `tree_accept`) share: their four outputs, and the Triton tail
that stores one row's accepted nodes, count, bonus and the verify step's result row."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def empty_outputs(num_seqs: int, num_nodes: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """(accepted [N, T_d] int32, num_accepted [N] int32, bonus [N] int64, result [N, T_d + 2] int64), unwritten."""
    return (
        torch.empty(num_seqs, num_nodes, dtype=torch.int32, device=device),
        torch.empty(num_seqs, dtype=torch.int32, device=device),
        torch.empty(num_seqs, dtype=torch.int64, device=device),
        torch.empty(num_seqs, num_nodes + 2, dtype=torch.int64, device=device),
    )


@triton.jit
def store_row(
    accepted,  # [N, T_d] int32 out
    num_accepted,  # [N] int32 out
    bonus,  # [N] int64 out
    result,  # [N, T_d + 2] int64 out
    slots,  # [N]: 0 for a padded row
    i,  # the row
    j,  # [BLOCK] lanes, BLOCK ≥ T_d + 2
    b_accepted,  # [BLOCK]: the path's node at each depth, -1 past it
    count,  # the path's length, root included
    b_bonus,
    b_next,  # [BLOCK]: the path's draft after each depth
    tree_depth,
    num_nodes,
):
    tl.store(accepted + i * num_nodes + j, b_accepted.to(tl.int32), mask=j < num_nodes)
    count = tl.where(tl.load(slots + i) > 0, count, 0)  # a padded row commits nothing
    tl.store(num_accepted + i, count.to(tl.int32))
    tl.store(bonus + i, b_bonus)
    b_row = tl.where(j == count - 1, b_bonus, b_next)
    b_row = tl.where(j < count, b_row, -1)  # the emitted tokens at j < T_d
    b_row = tl.where(j == num_nodes, count, tl.where(j == num_nodes + 1, tree_depth, b_row))  # count, depth
    tl.store(result + i * (num_nodes + 2) + j, b_row, mask=j < num_nodes + 2)
