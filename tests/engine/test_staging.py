"""`UploadRing`: every upload through the pinned ring comes back with its own values after the ring has wrapped over
its stretch many times (on a GPU: while the device is still busy with work queued before the copies), each stretch
starts 16-byte aligned, and an upload larger than a segment goes around the ring."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from jetserve.engine.staging import UploadRing


def _arrays(count: int, seed: int) -> list[np.ndarray]:
    """Arrays of awkward shapes and sizes 1..9 elements (some over a 6-element segment), distinct values."""
    rng = np.random.default_rng(seed)
    shapes = [(1,), (3,), (2, 2), (1, 5), (7,), (3, 3), (2,), (1, 1)]
    return [rng.integers(-(2**40), 2**40, size=shapes[i % len(shapes)], dtype=np.int64) for i in range(count)]


def test_uploads_survive_the_ring_wrapping() -> None:
    ring = UploadRing(torch.device("cpu"), num_elements=24, num_segments=4)  # segments of 6
    arrays = _arrays(200, seed=0)
    uploaded = [ring.upload(a) for a in arrays]
    for a, t in zip(arrays, uploaded, strict=True):
        assert t.dtype == torch.int64 and t.shape == a.shape and t.numpy().tolist() == a.tolist()
    assert ring.num_unstaged == sum(a.size > 6 for a in arrays) > 0


def test_copy_into_and_alignment() -> None:
    ring = UploadRing(torch.device("cpu"), num_elements=32, num_segments=2)
    dst = torch.full((3, 5), -1, dtype=torch.int64)
    for k in range(40):
        rows = np.arange(k, k + 15, dtype=np.int64).reshape(3, 5)
        ring.copy_into(dst, rows)
        assert dst.tolist() == rows.tolist()
        staged = ring._stage(np.arange(k % 5 + 1, dtype=np.int64))
        assert staged.data_ptr() % 16 == 0


def test_rows_of_another_integer_type_are_widened() -> None:
    ring = UploadRing(torch.device("cpu"), num_elements=16, num_segments=2)
    rows = np.array([[1, -2, 3]], dtype=np.int32)
    assert ring.upload(rows).tolist() == [[1, -2, 3]]
    assert ring.upload(np.arange(12, dtype=np.int32)).tolist() == list(range(12))  # over a segment: pinned apart
    for floats in (np.array([1.5]), np.arange(12, dtype=np.float64)):
        with pytest.raises(TypeError):
            ring.upload(floats)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_uploads_survive_the_ring_wrapping_behind_a_busy_gpu() -> None:
    """The copies queue behind ~50 ms of device work: a ring that reused a stretch before its copy ran (no fence)
    would hand the device another upload's values."""
    device = torch.device("cuda")
    ring = UploadRing(device, num_elements=24, num_segments=4)
    for seed in range(3):
        torch.cuda._sleep(50_000_000)  # ~50 ms of one kernel, queued before every copy
        arrays = _arrays(300, seed)
        uploaded = [ring.upload(a) for a in arrays]
        dst = torch.zeros(3, 3, dtype=torch.int64, device=device)
        ring.copy_into(dst, arrays[5])
        torch.cuda.synchronize()
        assert dst.cpu().numpy().tolist() == arrays[5].tolist()
        for a, t in zip(arrays, uploaded, strict=True):
            assert t.cpu().numpy().tolist() == a.tolist()
