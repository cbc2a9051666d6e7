"""Sampling on the device: greedy/temperature/top-k/top-p/min-p draws reproducible per request, log-probs, and EAGLE-3
tree acceptance."""

from __future__ import annotations

import torch

from jetserve.ops.backend import use_triton
from jetserve.ops.sampling import kernels, reference
from jetserve.ops.sampling.greedy import argmax, top_logprob
from jetserve.ops.sampling.reference import compute_logprobs, top_logprobs
from jetserve.ops.sampling.tree_acceptance import (
    tree_accept,
    tree_accept_greedy,
    tree_accept_loop,
)


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
    """logits [N, V], temperature [N], top_k [N] int32, top_p [N], min_p [N], seeds [N] int64, counters [N] int64
    → tokens [N] int64. See `reference.sample` (and its two promises, `is_filtered` and `has_greedy`)."""
    hints = dict(is_filtered=is_filtered, has_greedy=has_greedy)
    if use_triton(logits):
        return kernels.sample(logits, temperature, top_k, top_p, min_p, seeds, counters, **hints)
    return reference.sample(logits, temperature, top_k, top_p, min_p, seeds, counters, **hints)


__all__ = [
    "argmax",
    "compute_logprobs",
    "sample",
    "top_logprob",
    "top_logprobs",
    "tree_accept",
    "tree_accept_greedy",
    "tree_accept_loop",
]
