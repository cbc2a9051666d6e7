"""Distributed test fixtures: the tiny checkpoint (fp32, all three layer kinds), made once per session."""

from __future__ import annotations

import pytest
import torch

from jetserve.checkpoint import make_checkpoint
from jetserve.ops.backend import set_backend


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    return make_checkpoint("tiny", tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.fixture(scope="module", autouse=True)
def _cpu_test_environment(request):
    """CPU modules: reference ops on one torch thread (spawned ranks inherit neither, so they set their own)."""
    if request.node.get_closest_marker("gpu") is not None:
        yield
        return
    threads = torch.get_num_threads()
    set_backend("reference")
    torch.set_num_threads(1)
    yield
    set_backend(None)
    torch.set_num_threads(threads)
