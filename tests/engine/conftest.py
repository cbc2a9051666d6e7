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
    set_backend("reference")
    yield load_model(tiny_checkpoint, dtype="float32", device="cpu")
    set_backend(None)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_checkpoint):
    return load_tokenizer(tiny_checkpoint)


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    """The tiny model's ops are far too small to share across threads; on a loaded machine, threads spin-wait and make
    a step ~40x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
