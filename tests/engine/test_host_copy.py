"""`start_host_copy`: a device tensor's copy to the host, queued, read later; on a GPU through a ring of pinned
buffers and events reused in turn, where a copy read after the ring came round raises instead of returning another
copy's values."""

from __future__ import annotations

import pytest
import torch

from jetserve.engine.host_copy import RING, start_host_copy


def test_a_cpu_copy_is_made_at_once_and_owns_its_values():
    source = torch.arange(6).view(2, 3)
    copy = start_host_copy(source)
    source.zero_()  # a static buffer the next step overwrites
    assert copy.event is None and copy.read() == [[0, 1, 2], [3, 4, 5]]
    assert copy.wait().shape == (2, 3)


@pytest.mark.gpu
def test_gpu_copies_of_every_size_read_back_until_the_ring_comes_round():
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    device = torch.device("cuda")
    copies = []
    for i in range(3 * RING):
        n = 1 + (7 * i) % 40  # sizes that grow and shrink through the same buffers
        source = torch.arange(n, device=device, dtype=torch.int64) + 1000 * i
        copies.append((start_host_copy(source.view(1, n)), i, n))
        source.fill_(-1)  # queued after the copy: not what it reads
        if len(copies) > RING // 2:
            copy, j, m = copies.pop(0)
            assert copy.read() == [[1000 * j + k for k in range(m)]]
    stale = start_host_copy(torch.ones(3, device=device))
    for _ in range(RING):
        start_host_copy(torch.zeros(5, device=device))
    with pytest.raises(RuntimeError, match="reused its buffer"):
        stale.read()
