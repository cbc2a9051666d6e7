"""Store a decode step's target features into the draft's catch-up ring in one Triton launch (the reference takes an
index, a remainder and one scatter per capture layer: five small kernels in every decode graph of a speculating
engine). Program (i, j) copies columns [j*BLOCK, (j+1)*BLOCK) of row i's features, every layer, to the ring row of
row i's slot and position."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from jetserve.ops.feature_ring.reference import check_store_args
from jetserve.ops.layout import dense

MAX_LAYERS = 4  # feature tensors one launch takes; more are stored in several launches
BLOCK = 1024


@triton.jit
def _store_kernel(
    ring,  # [S, R, L, H]
    f0,  # [N, H] each: the launch's layers, first ... last
    f1,
    f2,
    f3,
    slots,  # [N]
    positions,  # [N] int64
    first_layer,
    ring_len,
    hidden,
    stride_slot,
    stride_pos,
    stride_layer,
    stride_f0,
    stride_f1,
    stride_f2,
    stride_f3,
    NUM: tl.constexpr,  # feature tensors in this launch (1..MAX_LAYERS)
    BLOCK: tl.constexpr,
):
    i_n, i_h = tl.program_id(0), tl.program_id(1)
    slot = tl.load(slots + i_n).to(tl.int64)
    pos = tl.load(positions + i_n).to(tl.int64) % ring_len
    row = ring + slot * stride_slot + pos * stride_pos + first_layer * stride_layer
    o_h = i_h * BLOCK + tl.arange(0, BLOCK)
    m_h = o_h < hidden
    i_n64 = i_n.to(tl.int64)
    for layer in tl.static_range(NUM):
        if layer == 0:
            src = f0 + i_n64 * stride_f0
        elif layer == 1:
            src = f1 + i_n64 * stride_f1
        elif layer == 2:
            src = f2 + i_n64 * stride_f2
        else:
            src = f3 + i_n64 * stride_f3
        b_f = tl.load(src + o_h, mask=m_h, other=0.0)
        tl.store(row + layer * stride_layer + o_h, b_f.to(ring.dtype.element_ty), mask=m_h)


def store_features(
    ring: torch.Tensor, features: list[torch.Tensor], slots: torch.Tensor, positions: torch.Tensor
) -> None:
    """See `reference.store_features`; up to MAX_LAYERS layers per launch."""
    check_store_args(ring, features, slots, positions)
    assert ring.stride(3) == 1, "ring rows must be contiguous"
    num_rows, hidden = slots.shape[0], ring.shape[3]
    if num_rows == 0:
        return
    slots, positions = dense(slots, positions)
    features = [f if f.stride(-1) == 1 else f.contiguous() for f in features]
    block = min(BLOCK, triton.next_power_of_2(hidden))
    for first in range(0, len(features), MAX_LAYERS):
        group = features[first : first + MAX_LAYERS]
        padded = group + [group[0]] * (MAX_LAYERS - len(group))  # unused pointers (NUM says how many are read)
        _store_kernel[(num_rows, triton.cdiv(hidden, block))](
            ring,
            *padded,
            slots,
            positions,
            first,
            ring.shape[1],
            hidden,
            ring.stride(0),
            ring.stride(1),
            ring.stride(2),
            *(f.stride(0) for f in padded),
            NUM=len(group),
            BLOCK=block,
        )
