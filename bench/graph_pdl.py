"""Whether capturing a second CUDA graph changes the first one's replay, on a minimal chain: N PDL-launched Triton
RMSNorm kernels (`jetserve.ops.norm`, one 2B row) in graph A, replayed back to back; then graph B (the same chain on 2
rows) captured, A again; B dropped, A again; a third graph captured, A again. Run it with JETSERVE_PDL=1 and =0.

Why (docs/performance.md, session 30): the 2B's batch-1 decode graph replays in 1.524-1.530 ms when it is the only
graph captured and 1.584-1.590 ms once any second decode graph is (PDL off: 1.651-1.656 either way). This chain did
not show it with PDL on (A 1.060 µs a kernel before and after B); with PDL off A went 1.327 → 1.505 µs a kernel
(measured with one warm-up before each capture; the script captures through the engine's `_capture`, which since
session 32 also warms up once, on the current stream).
Usage: python bench/graph_pdl.py [--kernels 200] [--hidden 1536]
"""

from __future__ import annotations

import argparse
import gc
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from jetserve.engine.bench_offline import measure_copy_bandwidth  # noqa: E402
from jetserve.engine.cuda_graph import _capture  # noqa: E402
from jetserve.ops.backend import set_backend  # noqa: E402
from jetserve.ops.norm import rms_norm  # noqa: E402


def capture(rows: int, hidden: int, weight: torch.Tensor, num_kernels: int) -> torch.cuda.CUDAGraph:
    """The chain on `rows` rows, warmed up and captured as the engine captures (in a memory pool of its own)."""
    x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)

    def chain() -> None:
        y = x
        for _ in range(num_kernels):
            y = rms_norm(y, weight, 1e-6)

    graphs: dict[str, torch.cuda.CUDAGraph] = {}
    _capture("chain", graphs, None, chain)  # as the engine captures its decode graphs
    return graphs["chain"]


def replay_us(graph: torch.cuda.CUDAGraph, num_kernels: int, reps: int = 200) -> str:
    """Three timings of `reps` back-to-back replays: µs a kernel, each."""
    graph.replay()
    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(3):
        begin.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end) * 1e3 / reps / num_kernels)
    return " ".join(f"{t:.3f}" for t in times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kernels", type=int, default=200)
    p.add_argument("--hidden", type=int, default=1536)
    args = p.parse_args()
    set_backend("triton")
    n = args.kernels
    weight = torch.randn(args.hidden, device="cuda", dtype=torch.bfloat16)
    copy_bw = measure_copy_bandwidth(torch.device("cuda"))
    kernel_bytes = 3 * args.hidden * 2  # a row of x and the weight read, a row of y written (bf16)
    print(f"JETSERVE_PDL={os.environ.get('JETSERVE_PDL', '1')}, {n} kernels a graph; roofline "
          f"{kernel_bytes / copy_bw * 1e6:.4f} µs a kernel ({kernel_bytes} B at the {copy_bw / 1e9:.0f} GB/s copy "
          "bandwidth measured here: the times below are launch latency, not bytes)")  # fmt: skip
    a = capture(1, args.hidden, weight, n)
    print(f"A alone:          {replay_us(a, n)} µs a kernel")
    b = capture(2, args.hidden, weight, n)
    print(f"A after B:        {replay_us(a, n)} µs a kernel (B: {replay_us(b, n)})")
    del b
    gc.collect()
    torch.cuda.synchronize()
    print(f"A, B dropped:     {replay_us(a, n)} µs a kernel")
    c = capture(1, args.hidden, weight, n)
    print(f"a third graph C:  {replay_us(c, n)} µs a kernel; A {replay_us(a, n)}")


if __name__ == "__main__":
    main()
