"""`jetserve bench offline --tensor-parallel-size 2` on the CPU (gloo): random per-rank shards, one JSON row per
batch size with the per-rank roofline beside the measurement."""

from __future__ import annotations

import json

from jetserve.cli import main


def test_bench_offline_tensor_parallel(capsys):
    argv = ["bench", "offline", "--config", "tiny", "--tensor-parallel-size", "2", "--device", "cpu", "--dtype",
            "float32", "--batch-sizes", "2", "--input-len", "6", "--output-len", "3", "--json"]  # fmt: skip
    assert main(argv) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [r["batch_size"] for r in rows] == [2]
    assert rows[0]["decode_tok_s"] > 0 and rows[0]["decode_step_bytes"] > 0
