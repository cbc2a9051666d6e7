"""Which decode buckets an engine captures (`cuda_graph.capture_batch_sizes`) and the flag that names them; the
captures themselves run on a GPU only (tests/engine/test_engine_gpu.py)."""

from __future__ import annotations

import argparse

import pytest

from jetserve.engine.bench_offline import _engine_kwargs, add_offline_bench_arguments
from jetserve.engine.config import EngineConfig
from jetserve.engine.cuda_graph import capture_batch_sizes, default_batch_sizes


def test_default_buckets_up_to_max_num_seqs_or_the_graph_limit():
    assert default_batch_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    assert capture_batch_sizes(EngineConfig(max_num_seqs=40), num_slots=100) == [1, 2, 4, 8, 16, 32, 40]
    assert capture_batch_sizes(EngineConfig(max_num_seqs=40, cuda_graph_max_batch_size=4), 100) == [1, 2, 4]
    assert capture_batch_sizes(EngineConfig(max_num_seqs=40), num_slots=21) == [1, 2, 4, 8, 16, 20]  # slot 0: padding


def test_named_buckets_sorted_without_repeats_and_within_the_slots():
    config = EngineConfig(max_num_seqs=64, cuda_graph_batch_sizes="32, 1,8,8")
    assert config.graph_batch_sizes == (1, 8, 32)
    assert capture_batch_sizes(config, num_slots=100) == [1, 8, 32]
    assert capture_batch_sizes(config, num_slots=13) == [1, 8, 12]  # the plan found 12 usable slots
    assert capture_batch_sizes(config, num_slots=6) == [1, 5]
    assert EngineConfig().graph_batch_sizes is None
    assert EngineConfig(cuda_graph_batch_sizes=[4, 1]).graph_batch_sizes == (1, 4)  # LLM(..., [4, 1]) from Python


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"cuda_graph_batch_sizes": ""}, "positive integers"),
        ({"cuda_graph_batch_sizes": "1,0"}, "positive integers"),
        ({"cuda_graph_batch_sizes": "1,two"}, "positive integers"),
        ({"cuda_graph_batch_sizes": [1, None]}, "positive integers"),
        ({"cuda_graph_batch_sizes": "1,64", "max_num_seqs": 32}, "past max_num_seqs"),
        ({"cuda_graph_batch_sizes": "1,8", "cuda_graph_max_batch_size": 8}, "give one of them"),
    ],
)
def test_bad_buckets_name_the_field(fields, message):
    with pytest.raises(ValueError, match=message) as error:
        EngineConfig(**fields)
    assert str(error.value).startswith("cuda_graph_batch_sizes:")


def test_bench_offline_passes_the_buckets_to_the_engine():
    parser = argparse.ArgumentParser()
    add_offline_bench_arguments(parser)
    args = parser.parse_args(["--config", "2b", "--batch-sizes", "1,64,256", "--cuda-graph-batch-sizes", "1,64,256"])
    kwargs = _engine_kwargs(args, [1, 64, 256])
    assert kwargs["cuda_graph_batch_sizes"] == "1,64,256"
    assert EngineConfig(**kwargs).graph_batch_sizes == (1, 64, 256)
    args = parser.parse_args(["--config", "2b"])
    assert _engine_kwargs(args, [1, 8])["cuda_graph_batch_sizes"] is None
