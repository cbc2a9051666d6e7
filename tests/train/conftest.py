import pytest
import torch

from jetserve.checkpoint import make_checkpoint
from jetserve.model.loader import load_model


@pytest.fixture(scope="session")
def tiny_train_checkpoint(tmp_path_factory):
    """The `tiny` preset (all three layer kinds, SWA window 16) with random weights, fp32."""
    return make_checkpoint("tiny", tmp_path_factory.mktemp("tiny-train"), seed=1)


@pytest.fixture
def tiny_model(tiny_train_checkpoint):
    torch.manual_seed(0)
    return load_model(tiny_train_checkpoint, dtype="float32")
