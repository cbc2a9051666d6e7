import pytest

from jetserve.checkpoint import make_checkpoint
from jetserve.model.loader import load_model


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    return make_checkpoint("tiny", tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    """The tiny model in fp32 (each test module binds its own caches)."""
    return load_model(tiny_checkpoint, dtype="float32")
