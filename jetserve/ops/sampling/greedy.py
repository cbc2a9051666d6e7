"""The greedy token of each row (`argmax`), on the backend the logits' device picks."""

from __future__ import annotations

import torch

from jetserve.ops.backend import use_triton
from jetserve.ops.sampling import kernels, reference


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits [..., V] → [...] int64: the first maximum of each row (a NaN counts above every number), as
    `torch.argmax(dim=-1)`. See `reference.argmax`; the Triton variant splits each row across the GPU."""
    if use_triton(logits):
        return kernels.argmax(logits)
    return reference.argmax(logits)
