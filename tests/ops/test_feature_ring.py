"""The draft's catch-up ring: the Triton store (one launch for up to four capture layers) against the reference's
scatters, and the reference against its definition."""

from __future__ import annotations

import pytest
import torch

from jetserve import envs
from jetserve.ops.feature_ring import reference as ref
from jetserve.ops.feature_ring import store

SENTINEL = 1234.5  # ring rows nothing should write

needs_interpreter = pytest.mark.skipif(
    not envs.triton_interpret(), reason="Triton variants run here in the interpreter"
)


def make_case(num_layers: int, hidden: int, dtype: torch.dtype, seed: int):
    """A ring of 6 slots × 5 positions, 4 rows: slots as a strided view (a 9 between them), one padding row on slot 0,
    positions past the ring's length (they wrap) — and the features, one [4, hidden] per layer."""
    gen = torch.Generator().manual_seed(seed)
    ring = torch.full((6, 5, num_layers, hidden), SENTINEL, dtype=dtype)
    slots = torch.tensor([[3, 9], [0, 9], [5, 9], [1, 9]], dtype=torch.int32)[:, 0]
    positions = torch.tensor([7, 0, 4, 12], dtype=torch.int64)
    features = [torch.randn(4, hidden, generator=gen).to(dtype) for _ in range(num_layers)]
    return ring, features, slots, positions


def test_reference_stores_each_layer_at_its_slot_and_wrapped_position() -> None:
    ring, features, slots, positions = make_case(3, 8, torch.float32, 0)
    before = ring.clone()
    ref.store_features(ring, features, slots, positions)
    written = torch.zeros(ring.shape[:2], dtype=torch.bool)
    for i, (slot, pos) in enumerate(zip(slots.tolist(), positions.tolist(), strict=True)):
        for layer in range(3):
            assert torch.equal(ring[slot, pos % 5, layer], features[layer][i])
        written[slot, pos % 5] = True
    assert torch.equal(ring[~written], before[~written])


@needs_interpreter
@pytest.mark.parametrize(("num_layers", "hidden", "dtype"), [(3, 40, torch.float32), (5, 24, torch.float16),
                                                             (1, 8, torch.float32)])  # fmt: skip
def test_triton_store_equals_the_reference(num_layers: int, hidden: int, dtype: torch.dtype) -> None:
    """3 layers (the EAGLE-3 default), 5 (two launches), 1; hidden sizes that leave a block's tail masked."""
    ring, features, slots, positions = make_case(num_layers, hidden, dtype, num_layers)
    want = ring.clone()
    ref.store_features(want, features, slots, positions)
    store.store_features(ring, features, slots, positions)
    assert torch.equal(ring, want)


def test_bad_arguments_are_refused() -> None:
    ring, features, slots, positions = make_case(3, 8, torch.float32, 1)
    with pytest.raises(ValueError, match="3 layers"):
        ref.store_features(ring, features[:2], slots, positions)
    with pytest.raises(ValueError, match="must be \\[N\\]"):
        ref.store_features(ring, features, slots, positions[:3])
    with pytest.raises(ValueError, match="must be \\[4, 8\\]"):
        ref.store_features(ring, [f.double() for f in features], slots, positions)
