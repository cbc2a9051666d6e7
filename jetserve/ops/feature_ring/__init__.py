"""The draft's catch-up ring of target features (`SpecDecoder.missed_features` [S, R, L, H]): `store_features` writes
a decode step's features, one launch in the Triton variant (`store.py`), the reference's scatters otherwise."""

from __future__ import annotations

import torch

from jetserve.ops.backend import use_triton
from jetserve.ops.feature_ring import reference, store


def store_features(
    ring: torch.Tensor, features: list[torch.Tensor], slots: torch.Tensor, positions: torch.Tensor
) -> None:
    """ring [S, R, L, H] (in place), features L × [N, H], slots [N], positions [N]: row i's layer-l feature to
    `ring[slots[i], positions[i] % R, l]`. See `reference.store_features`."""
    fn = store.store_features if use_triton(ring) else reference.store_features
    fn(ring, features, slots, positions)
