"""`start_host_copy`: a device tensor's copy to the host, queued, read later — after work queued behind it has
overwritten the device tensor."""

from __future__ import annotations

import pytest
import torch

from jetserve.engine.host_copy import start_host_copy


def test_a_cpu_copy_is_made_at_once_and_owns_its_values():
    source = torch.arange(6).view(2, 3)
    copy = start_host_copy(source)
    source.zero_()  # a static buffer the next step overwrites
    assert copy.event is None and copy.read() == [[0, 1, 2], [3, 4, 5]]
    assert copy.wait().shape == (2, 3)


@pytest.mark.gpu
def test_gpu_copies_read_their_own_values_after_the_source_is_overwritten():
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    device = torch.device("cuda")
    copies = []
    for i in range(40):
        n = 1 + (7 * i) % 40
        source = torch.arange(n, device=device, dtype=torch.int64) + 1000 * i
        copies.append((start_host_copy(source.view(1, n)), i, n))
        source.fill_(-1)  # queued after the copy: not what it reads
    for copy, i, n in copies:
        assert copy.read() == [[1000 * i + k for k in range(n)]]
