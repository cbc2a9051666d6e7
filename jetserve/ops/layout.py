"""How the Triton kernels read their per-row and index vectors (slots, positions, cu_seqlens, lengths, seeds...):
element i at offset i. A caller may hand a view with another stride — an expanded vector has stride 0, a column of a
matrix the matrix's row stride — and a kernel indexing it as dense would read past it (on the GPU an illegal address
or silently wrong rows), so every launch passes such vectors through `dense` first."""

from __future__ import annotations

import torch


def dense(*vectors: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """Each tensor contiguous (itself when it already is, so the common case costs nothing); None stays None."""
    return tuple(v if v is None or v.is_contiguous() else v.contiguous() for v in vectors)
