"""Timing shared by the benchmark scripts (no jetserve import, so a script may set TRITON_INTERPRET first)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import torch


def time_ms(fn: Callable[[], object], device: str) -> float:
    """Median milliseconds per call: CUDA-graph replay where the op captures, else events around each call; off the
    GPU one timed call after a warm-up."""
    if device != "cuda":
        fn()
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    import triton.testing

    fn()
    torch.cuda.synchronize()
    try:
        return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")
    except Exception:  # an op that syncs or allocates on the host cannot be captured: time it launch by launch
        torch.cuda.synchronize()
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def warm_clocks(device: str, *work: Callable[[], object]) -> None:
    """A second of `work` on the GPU before measuring: an idle GPU's clocks gave 2.7 instead of 4.2 TB/s (H200)."""
    if device != "cuda":
        return
    start = time.perf_counter()
    while time.perf_counter() - start < 1.0:
        for _ in range(20):
            for fn in work:
                fn()
        torch.cuda.synchronize()


def copy_bandwidth(device: str) -> float:
    """Bytes per second (read + written) of a large device-to-device copy, timed as back-to-back launches by
    `jetserve bench offline`'s own measure (imported here, after a smoke run has set TRITON_INTERPRET) — not inside a
    CUDA graph: captured, the copy becomes a memcpy node and measured 2.71 TB/s on an H200 where launched it measured
    4.24 (session 18, one GPU, back to back)."""
    from jetserve.engine.bench_offline import measure_copy_bandwidth

    return measure_copy_bandwidth(torch.device(device))


def smoke_or_gpu(smoke: bool) -> tuple[str, torch.dtype]:
    """(device, dtype) of a benchmark run: the CPU and the Triton interpreter in fp32 for a smoke run (it sets
    TRITON_INTERPRET, so call it before any kernel module is imported), else CUDA in bf16."""
    if smoke:
        os.environ["TRITON_INTERPRET"] = "1"
        return "cpu", torch.float32
    return "cuda", torch.bfloat16
