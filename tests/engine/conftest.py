"""Engine test fixtures: one tiny random checkpoint (all three layer kinds, fp32) per session, loaded once."""

from __future__ import annotations

import pytest
import torch

from jetserve.checkpoint import make_checkpoint
from jetserve.model.loader import load_model
from jetserve.ops.backend import set_backend
from jetserve.tokenizer import load_tokenizer


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    return make_checkpoint("tiny", tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.fixture(scope="session")
def tiny_model(tiny_checkpoint):
    return load_model(tiny_checkpoint, dtype="float32", device="cpu")


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_checkpoint):
    return load_tokenizer(tiny_checkpoint)


@pytest.fixture(scope="module", autouse=True)
def _engine_test_environment(request):
    """CPU modules run the reference ops on one torch thread (the tiny model's ops are far too small to share across
    threads; on a loaded machine threads spin-wait and a step gets ~40x slower); `gpu` modules run the Triton ops."""
    is_gpu = request.node.get_closest_marker("gpu") is not None
    threads = torch.get_num_threads()
    set_backend("triton" if is_gpu else "reference")
    if not is_gpu:
        torch.set_num_threads(1)
    yield
    set_backend(None)
    torch.set_num_threads(threads)
