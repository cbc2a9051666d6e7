"""`ModelRunner.upload`: one copy of a [C, n] host array; every row comes back with its values and 16-byte aligned,
whatever n's parity (Triton specializes kernels on pointer alignment)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from jetserve.engine.model_runner import ModelRunner
from jetserve.engine.staging import UploadRing


@pytest.mark.parametrize("n", [1, 2, 7, 64, 1001])
def test_rows_keep_values_and_alignment(n: int) -> None:
    runner = SimpleNamespace(uploads=UploadRing(torch.device("cpu")))
    runner.upload_block = lambda rows: ModelRunner.upload_block(runner, rows)
    host = np.arange(5 * n, dtype=np.int64).reshape(5, n)
    block = runner.upload_block(host)
    assert block.shape == (5, n) and block.tolist() == host.tolist()
    rows = ModelRunner.upload(runner, host)
    assert len(rows) == 5
    for i, row in enumerate(rows):
        assert row.dtype == torch.int64 and row.shape == (n,)
        assert row.tolist() == host[i].tolist()
        assert row.data_ptr() % 16 == 0
