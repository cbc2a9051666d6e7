"""The chunk table of a varlen chunked delta-rule prefill: which (sequence, chunk) each chunk of the packed tokens is.

Built once a PREFILL step, on the host, and shared by every JetBlock layer (`chunk.chunk_gated_delta_rule_prefill`
takes it; the reference needs none). No fla import here: the engine builds it on any backend.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

CHUNK_SIZE = 64  # fla's chunk length (tokens per chunk of the WY form)


@dataclass(frozen=True)
class DeltaRuleChunks:
    """One PREFILL step's chunk table, shared by every JetBlock layer of the step.

    `cu_seqlens` is the step's own [N+1] int64 tensor: fla memoises its per-step tables (chunk offsets) by tensor
    identity, so one object a step computes them once, and a new object each step never finds a stale entry."""

    cu_seqlens: torch.Tensor  # [N+1] int64
    chunk_indices: torch.Tensor  # [NT, 2] int64: (sequence, chunk within it) of each chunk
    # No sequence of the step starts from a stored state (every has_initial_state false, as the host knows it): the
    # chunked kernels then start from zeros without gathering the slots' states (three launches a layer fewer).
    fresh: bool = False

    @staticmethod
    def host_rows(lens: np.ndarray) -> np.ndarray:
        """[2, NT] int64: the chunk table of sequences of `lens` new tokens, built on the host (no device read)."""
        counts = -(-lens // CHUNK_SIZE)  # [N] chunks per sequence
        seq = np.repeat(np.arange(len(lens), dtype=np.int64), counts)  # [NT]
        first = np.cumsum(counts) - counts  # [N] index of each sequence's first chunk
        return np.stack([seq, np.arange(seq.shape[0], dtype=np.int64) - first[seq]])

    @classmethod
    def from_cu_seqlens(cls, cu_seqlens: torch.Tensor) -> DeltaRuleChunks:
        """Built from a device cu_seqlens (reads it back: for callers outside an engine step); not `fresh`, since
        has_initial_state stays on the device."""
        lens = np.diff(cu_seqlens.cpu().numpy()).astype(np.int64)
        rows = torch.from_numpy(cls.host_rows(lens)).to(cu_seqlens.device)  # [2, NT]
        return cls(cu_seqlens.to(torch.int64, copy=True), rows.t().contiguous())
