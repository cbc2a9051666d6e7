"""The greedy token of each row (`argmax`), and with its log-prob (`top_logprob`), on the backend the logits'
device picks."""

from __future__ import annotations

import torch

from jetserve.ops.backend import use_triton
from jetserve.ops.sampling import kernels, reference


def argmax(logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """logits [..., V] → [...] int64: the first maximum of each row (a NaN counts above every number), as
    `torch.argmax(dim=-1)`; into `out` (contiguous, int64) when given. See `reference.argmax`; the Triton variant
    splits each row across the GPU."""
    if use_triton(logits):
        return kernels.argmax(logits, out)
    return reference.argmax(logits, out)


def top_logprob(
    logits: torch.Tensor, offsets: torch.Tensor | None = None, out: tuple[torch.Tensor, torch.Tensor] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, V] → (log-prob [N] fp32, index [N] int64): `log_softmax(logits).max(dim=-1)`, the index shifted by
    offsets[index] when offsets [V] is given (a draft's `d2t`); into `out` (the pair, any stride) when given. See
    `reference.top_logprob`; the Triton variant splits each row across the GPU as `argmax` does."""
    if use_triton(logits):
        return kernels.top_logprob(logits, offsets, out)
    return reference.top_logprob(logits, offsets, out)
