"""`advance_decode_inputs` in one Triton launch, where the reference takes four kernels (a comparison, a copy, a
select and an add): the last op of every decode graph, replayed every plain step."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from jetserve.ops.decode_inputs.reference import check_advance_args

BLOCK = 128  # rows a program


@triton.jit(do_not_specialize=["num_rows"])
def _advance_kernel(tokens, positions, state_indices, input_ids, used_positions, num_rows, BLOCK: tl.constexpr):
    o_n = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m_n = o_n < num_rows
    b_pos = tl.load(positions + o_n, mask=m_n, other=0)
    is_real = tl.load(state_indices + o_n, mask=m_n, other=0) != 0
    b_tok = tl.load(tokens + o_n, mask=m_n, other=0)
    tl.store(used_positions + o_n, b_pos, mask=m_n)
    tl.store(input_ids + o_n, tl.where(is_real, b_tok, 0), mask=m_n)
    tl.store(positions + o_n, b_pos + is_real.to(tl.int64), mask=m_n)


def advance_decode_inputs(
    tokens: torch.Tensor,
    positions: torch.Tensor,
    state_indices: torch.Tensor,
    input_ids: torch.Tensor,
    used_positions: torch.Tensor,
) -> None:
    """See `reference.advance_decode_inputs`. Every tensor must be contiguous (the static buffers' slices are)."""
    check_advance_args(tokens, positions, state_indices, input_ids, used_positions)
    tensors = (tokens, positions, state_indices, input_ids, used_positions)
    if not all(t.is_contiguous() for t in tensors):
        raise ValueError("advance_decode_inputs: the Triton variant takes contiguous tensors")
    num_rows = positions.shape[0]
    if num_rows:
        _advance_kernel[(triton.cdiv(num_rows, BLOCK),)](*tensors, num_rows, BLOCK=BLOCK)
