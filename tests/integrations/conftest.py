"""Integration test fixtures: the tiny checkpoint (fp32, all three layer kinds), made once per session."""

from __future__ import annotations

import pytest

from jetserve.checkpoint import make_checkpoint


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    return make_checkpoint("tiny", tmp_path_factory.mktemp("tiny"), seed=0)
