"""The collectives of a tensor-parallel decode step, measured: NCCL all-reduce bus bandwidth (large messages), and
per batch size the communication of one decode step (2 all-reduces per layer and one for the embedding of
[B, hidden], the logits all-gather of [B, vocab / ranks]) replayed as one CUDA graph, beside its bandwidth bound;
for each all-reduce kind asked for (`nccl`, `one-shot`: see `jetserve.envs.tp_all_reduce`), each checked for the
right sum first.

    python -m jetserve.distributed.bench_collectives --config 2b --tensor-parallel-size 2 --batch-sizes 1,8,64,256 \
        --all-reduce nccl,one-shot
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.multiprocessing as mp

from jetserve.checkpoint import preset_config
from jetserve.config import ModelConfig
from jetserve.distributed.group import TensorParallelGroup, free_port, init_tensor_parallel
from jetserve.distributed.sharding import vocab_rows_per_rank

BUS_BYTES = 256 << 20  # all-reduce message for the bus bandwidth (NCCL tests' "busbw")


def _timed(fn, iters: int) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters


def bus_bandwidth(group: TensorParallelGroup, dtype: torch.dtype) -> float:
    """NCCL's bus bandwidth of an all-reduce (bytes/s): 2 (n-1)/n of the message per rank over its time."""
    x = torch.ones(BUS_BYTES // dtype.itemsize, dtype=dtype, device=group.device)
    seconds = _timed(lambda: group.all_reduce(x), 20)
    n = group.world_size
    return 2 * (n - 1) / n * BUS_BYTES / seconds


def decode_step_collectives(group: TensorParallelGroup, config: ModelConfig, batch: int, dtype: torch.dtype) -> dict:
    """One decode step's collectives at batch `batch`, captured in a CUDA graph and replayed (as the engine's
    decode graph runs them): seconds per step, and the bytes each rank moves."""
    hidden = torch.ones(batch, config.hidden_size, dtype=dtype, device=group.device)  # [B, hidden]
    rows = vocab_rows_per_rank(config.vocab_size, group.world_size)
    logits = torch.ones(batch, rows, dtype=dtype, device=group.device)  # [B, V_local]
    num_all_reduce = 2 * config.num_hidden_layers + 1

    def step() -> None:
        for _ in range(num_all_reduce):
            group.all_reduce(hidden)
        group.all_gather(logits)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    seconds = _timed(graph.replay, 50)
    n = group.world_size
    hidden.fill_(1.0)  # one replay from ones: every element must be n ** num_all_reduce (exact in bf16 up to 2^127)
    graph.replay()
    if not torch.equal(hidden, torch.full_like(hidden, float(n) ** num_all_reduce)):
        raise AssertionError(f"graph-captured all-reduces at batch {batch}: wrong sums on rank {group.rank}")
    reduce_bytes = num_all_reduce * hidden.numel() * dtype.itemsize
    gather_bytes = logits.numel() * dtype.itemsize * n
    return {
        "batch_size": batch,
        "num_all_reduce": num_all_reduce,
        "all_reduce_bytes": reduce_bytes,
        "all_gather_bytes": gather_bytes,
        "step_collectives_us": round(seconds * 1e6, 2),
        "per_all_reduce_us": round(seconds * 1e6 / (num_all_reduce + 1), 2),
        # What the same bytes take at the bus bandwidth (filled in by the caller): the gap is latency, not bytes.
        "bus_bytes": 2 * (n - 1) / n * reduce_bytes + (n - 1) / n * gather_bytes,
    }


def check_sum(group: TensorParallelGroup, numel: int, dtype: torch.dtype) -> None:
    """Rank r contributes r + 1 + (index mod 7): every element must come back as the sum over the ranks."""
    n = group.world_size
    pattern = torch.arange(numel, device=group.device) % 7  # [numel]
    x = (pattern + group.rank + 1).to(dtype)
    group.all_reduce(x)
    want = (n * pattern + n * (n + 1) // 2).to(dtype)
    if not torch.equal(x, want):
        raise AssertionError(f"all-reduce of {numel} elements: wrong sum on rank {group.rank}")


def _rank(rank: int, args: argparse.Namespace, port: int) -> None:
    device = torch.device("cuda", rank)
    group = init_tensor_parallel(rank, args.tensor_parallel_size, port, device)
    config = ModelConfig.from_dict(preset_config(args.config))
    dtype = torch.bfloat16
    busbw = bus_bandwidth(group, dtype)
    rows = []
    buffer = group.one_shot_buffer
    for kind in args.all_reduce:
        if kind == "one-shot" and buffer is None:
            group.enable_one_shot()  # collective: every rank runs the same kinds in the same order
            buffer = group.one_shot_buffer
        group.one_shot_buffer = buffer if kind == "one-shot" else None
        for b in args.batch_sizes:
            check_sum(group, b * config.hidden_size, dtype)
            rows.append(decode_step_collectives(group, config, b, dtype) | {"all_reduce": kind})
    if group.is_first:
        for row in rows:
            row["bus_bandwidth_gb_s"] = round(busbw / 1e9, 1)
            row["bandwidth_bound_us"] = round(row.pop("bus_bytes") / busbw * 1e6, 2)
            row["config"] = args.config
            row["tensor_parallel_size"] = args.tensor_parallel_size
            print(json.dumps(row), flush=True)
    group.barrier()
    group.destroy()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="2b", help="tiny | 2b | 4b | config JSON (sizes only)")
    p.add_argument("--tensor-parallel-size", type=int, default=2)
    p.add_argument("--batch-sizes", default="1,8,64,256")
    p.add_argument("--all-reduce", default="nccl,one-shot", help="all-reduce kinds to measure: nccl, one-shot")
    args = p.parse_args(argv)
    args.batch_sizes = [int(x) for x in args.batch_sizes.split(",")]
    args.all_reduce = [x.strip() for x in args.all_reduce.split(",") if x.strip()]
    if not args.all_reduce or set(args.all_reduce) - {"nccl", "one-shot"}:
        raise SystemExit(f"--all-reduce: {','.join(args.all_reduce)!r} must list nccl and/or one-shot")
    if not torch.cuda.is_available() or torch.cuda.device_count() < args.tensor_parallel_size:
        raise SystemExit(f"needs {args.tensor_parallel_size} CUDA GPUs")
    mp.spawn(_rank, args=(args, free_port()), nprocs=args.tensor_parallel_size)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
