"""Storing a decode step's target features into the draft's catch-up ring (`SpecDecoder.missed_features`): the
contract of `store_features`, in plain PyTorch."""

from __future__ import annotations

import torch


def check_store_args(
    ring: torch.Tensor, features: list[torch.Tensor], slots: torch.Tensor, positions: torch.Tensor
) -> None:
    if ring.dim() != 4:
        raise ValueError(f"feature ring: ring {tuple(ring.shape)} must be [S, R, L, H]")
    num_slots, ring_len, num_layers, hidden = ring.shape
    num_rows = slots.shape[0] if slots.dim() == 1 else -1
    if num_rows < 0 or positions.shape != (num_rows,):
        raise ValueError(f"feature ring: slots {tuple(slots.shape)} and positions {tuple(positions.shape)} must be [N]")
    if len(features) != num_layers:
        raise ValueError(f"feature ring: {len(features)} feature tensors for a ring of {num_layers} layers")
    for f in features:
        if f.shape != (num_rows, hidden) or f.dtype != ring.dtype:
            raise ValueError(f"feature ring: a feature {tuple(f.shape)} {f.dtype} must be [{num_rows}, {hidden}] "
                             f"{ring.dtype}")  # fmt: skip


def store_features(
    ring: torch.Tensor, features: list[torch.Tensor], slots: torch.Tensor, positions: torch.Tensor
) -> None:
    """ring [S, R, L, H] (in place), features L tensors [N, H] (capture layer l's feature of row i), slots [N],
    positions [N] int64: `ring[slots[i], positions[i] % R, l] = features[l][i]`. Padding rows point at slot 0."""
    check_store_args(ring, features, slots, positions)
    index = (slots.long(), positions.long() % ring.shape[1])
    for layer, f in enumerate(features):
        ring[index[0], index[1], layer] = f
