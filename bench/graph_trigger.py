"""Which second CUDA graph slows the 2B's batch-1 decode graph (docs/performance.md, sessions 30-33): an engine that
captures bucket 1 alone (its graph buffers sized for `--max-num-seqs`) decodes a 1K-token prompt; its graph A is
replayed back to back (5 x 50 replays), then the variant's graph is captured in the same process and A is replayed
again; `LLMEngine.step` is timed after that. A variant per process (its state is the process's): run the script once
per variant. Beside the times, the step's roofline (its bytes over the copy bandwidth measured here).

How a graph is captured, HOW: `engine` (the engine's `_capture`, one stream capture per graph: since session 32 one
warm-up on the current stream, then the capture in the global mode; before, two warm-ups on a new side stream,
`side:2:global` here) or `STREAM:WARMUPS:MODE`: STREAM `side` (a new side stream) or `current`, WARMUPS 0-2 runs there
before the capture, MODE `global`, `relaxed` or `thread_local`. `--engine-capture HOW` sets how the engine's buckets are
captured, `--buckets` the buckets it captures at start (`--order`: largest first, as the engine does, or smallest first;
`--own-pools`: a memory pool per graph), `--batch` the sequences decoding (A: their bucket's graph). `--one-capture`:
the buckets as the engine captures them since session 33, all in one stream capture split per bucket
(`cuda_graph._capture_all`).
The second graph, VARIANT: `none`, or `KERNEL` (captured by `_capture`, a capture of its own) or `KERNEL:HOW`. KERNEL:
`add` (one torch kernel), `norm-pdl` / `norm-no-pdl` (one Triton RMSNorm launched with / without PDL), `cublas` (one
GEMM), `decode-N` (the N-row decode step, N up to --max-num-seqs; decode-1 is A's step a second time). `--drop` resets
graphs of the engine's before the second graph is captured.
Sessions 31-32 (H200, A from ~1.52 to ~1.58 ms): a second graph warmed up twice on a new side stream (add, norm-no-pdl,
cublas, decode-1) or a decode graph warmed up once there; with warm-ups on the current stream, a fourth graph of any
size, from then on (resetting graphs does not undo it). Capture order, memory pools, memory headroom,
CUDA_SCALE_LAUNCH_QUEUES and CUDA_DEVICE_MAX_CONNECTIONS did not change it. Session 33: the fourth stream capture is
the trigger (four captures of which one was instantiated, yes; one capture instantiated five times, no).
Usage: python bench/graph_trigger.py VARIANT [--engine-capture HOW] [--buckets 1,2,4] [--order smallest] [--batch 1]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from profile_decode import graph_replay_ms  # noqa: E402

from jetserve.engine import cuda_graph  # noqa: E402
from jetserve.engine.bench_offline import decode_step_bytes, measure_copy_bandwidth, random_model  # noqa: E402
from jetserve.engine.config import EngineConfig  # noqa: E402
from jetserve.engine.engine import LLMEngine  # noqa: E402
from jetserve.sampling_params import SamplingParams  # noqa: E402

KERNELS = ("add", "norm-pdl", "norm-no-pdl", "cublas")
STREAMS = ("side", "current")
MODES = ("global", "relaxed", "thread_local")
PROMPT = 1024
ENGINE_CAPTURE = cuda_graph._capture


def parse_how(text: str) -> tuple[str, int, str] | None:
    """`engine` -> None (the engine's `_capture`); `STREAM:WARMUPS:MODE` -> (STREAM, WARMUPS, MODE)."""
    if text == "engine":
        return None
    parts = text.split(":")
    if len(parts) != 3 or parts[0] not in STREAMS or parts[1] not in ("0", "1", "2") or parts[2] not in MODES:
        raise argparse.ArgumentTypeError(f"{text!r}: want engine or STREAM:WARMUPS:MODE, STREAM in {STREAMS}, "
                                         f"WARMUPS 0-2, MODE in {MODES}")  # fmt: skip
    return parts[0], int(parts[1]), parts[2]


def parse_variant(text: str) -> tuple[str, tuple[str, int, str] | None]:
    """`none` / `KERNEL` / `KERNEL:HOW` -> (KERNEL, HOW as `parse_how` returns it)."""
    kernel, _, how = text.partition(":")
    decode = kernel.startswith("decode-") and kernel.removeprefix("decode-").isdigit()
    if kernel != "none" and kernel not in KERNELS and not decode:
        raise argparse.ArgumentTypeError(f"unknown kernel {kernel!r}: none, {', '.join(KERNELS)} or decode-N")
    if kernel == "none" and how:
        raise argparse.ArgumentTypeError("none takes no capture")
    return kernel, parse_how(how or "engine")


def capture_with(how: tuple[str, int, str] | None):
    """A function of `_capture`'s signature capturing as HOW says (None: `_capture` itself)."""
    if how is None:
        return ENGINE_CAPTURE
    stream_kind, warmups, mode = how

    def capture(graph_key: object, graphs: dict, pool: object, step) -> object:
        stream = torch.cuda.Stream() if stream_kind == "side" else torch.cuda.current_stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(warmups):
                step()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, capture_error_mode=mode):
            step()
        graphs[graph_key] = graph
        return graph.pool() if pool is None else pool

    return capture


def second_graph(kernel: str, how: tuple[str, int, str] | None, engine: LLMEngine, device: torch.device) -> dict:
    """Capture the variant's graph; returns the graphs (kept alive while A is timed again)."""
    from jetserve.ops.norm import kernels as norm_kernels
    from jetserve.ops.norm import rms_norm

    graphs: dict = {}
    if kernel == "none":
        return graphs
    if kernel == "add":
        t = torch.zeros(1024, device=device)
        step = lambda: t.add_(1.0)  # noqa: E731
    elif kernel in ("norm-pdl", "norm-no-pdl"):
        x = torch.randn(1, 1536, device=device, dtype=torch.bfloat16)
        w = torch.randn(1536, device=device, dtype=torch.bfloat16)
        step = lambda: rms_norm(x, w, 1e-6)  # noqa: E731
    elif kernel == "cublas":
        x = torch.randn(64, 1536, device=device, dtype=torch.bfloat16)
        w = torch.randn(1536, 1536, device=device, dtype=torch.bfloat16)
        step = lambda: F.linear(x, w)  # noqa: E731
    else:
        runner = engine.runner.graph_runner
        rows = int(kernel.removeprefix("decode-"))
        if rows > runner.max_batch_size:
            raise SystemExit(f"{kernel}: the graph buffers hold {runner.max_batch_size} rows (--max-num-seqs)")
        step = lambda: runner._step(rows)  # noqa: E731
    saved = norm_kernels.pdl_launch
    if kernel == "norm-no-pdl":
        norm_kernels.pdl_launch = lambda x: {}
    try:
        capture_with(how)("x", graphs, None, step)
    finally:
        norm_kernels.pdl_launch = saved
    torch.cuda.synchronize()
    return graphs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("variant", help="none, KERNEL or KERNEL:HOW (see above)")
    p.add_argument("--engine-capture", default="engine", help="HOW the engine captures its graphs")
    p.add_argument("--buckets", default="1", help="the buckets the engine captures at start")
    p.add_argument("--order", choices=("largest", "smallest"), default="largest", help="which bucket is captured first")
    p.add_argument("--own-pools", action="store_true", help="a memory pool per graph (the engine shares one)")
    p.add_argument("--one-capture", action="store_true", help="the buckets from one capture, as the engine since 33")
    p.add_argument("--batch", type=int, default=1, help="sequences decoding: A is their bucket's graph")
    p.add_argument("--drop", default="", help="buckets whose graphs are reset after A's first timing (e.g. 2,4,8)")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--gpu-memory-utilization", type=float, default=None, help="the engine's (default: its own)")
    args = p.parse_args()
    try:
        kernel, how = parse_variant(args.variant)
        engine_how = parse_how(args.engine_capture)
    except argparse.ArgumentTypeError as e:
        p.error(str(e))
    if args.one_capture and (args.own_pools or args.engine_capture != "engine"):
        p.error("--one-capture captures as the engine does: no --own-pools or --engine-capture with it")
    buckets = sorted({int(b) for b in args.buckets.split(",")}, reverse=args.order == "largest")
    if max(buckets) > args.max_num_seqs or not 1 <= args.batch <= args.max_num_seqs:
        p.error(f"--buckets and --batch: within --max-num-seqs ({args.max_num_seqs})")
    device = torch.device("cuda")
    capture = capture_with(engine_how)

    @torch.inference_mode()
    def capture_buckets(self) -> None:  # the buckets asked for, in that order; the static buffers stay sized for all
        self._pad(0)
        if args.one_capture:
            steps = [(B, lambda B=B: self._step(B)) for B in buckets]
            self.pool = cuda_graph._capture_all(steps, self.graphs, self.pool)
        else:
            for B in buckets:
                pool = capture(B, self.graphs, None if args.own_pools else self.pool, lambda B=B: self._step(B))
                self.pool = self.pool or pool
        torch.cuda.synchronize()

    cuda_graph.GraphRunner.capture = capture_buckets
    model = random_model("2b", "bfloat16", device, seed=0)
    memory = {} if args.gpu_memory_utilization is None else {"gpu_memory_utilization": args.gpu_memory_utilization}
    config = EngineConfig(device="cuda", max_num_seqs=args.max_num_seqs, max_model_len=PROMPT + 600, **memory)
    engine = LLMEngine(config, model=model, tokenizer=None)
    graph_runner = engine.runner.graph_runner
    if graph_runner.bucket(args.batch) not in graph_runner.graphs:
        p.error(f"--batch {args.batch}: its bucket {graph_runner.bucket(args.batch)} is not captured (--buckets)")
    gen = torch.Generator().manual_seed(0)
    for i in range(args.batch):
        prompt = torch.randint(0, 1000, (PROMPT,), generator=gen).tolist()
        engine.add_request(f"p{i}", prompt, SamplingParams(temperature=0, max_tokens=300, ignore_eos=True))
    for _ in range(40 + args.batch):  # prefill, then decode steps: A's static buffers hold a real step at ~1K context
        engine.step()
    torch.cuda.synchronize()
    bandwidth = measure_copy_bandwidth(device)
    roofline_ms = decode_step_bytes(engine, args.batch, PROMPT + 40) / bandwidth * 1e3

    def times() -> str:
        return " ".join(f"{graph_replay_ms(engine, args.batch, 50):.4f}" for _ in range(5))

    before = times()
    for B in (int(b) for b in args.drop.split(",") if b):
        graph_runner.graphs.pop(B).reset()
    torch.cuda.synchronize()
    with torch.inference_mode():
        graphs = second_graph(kernel, how, engine, device)
    for _ in range(10):  # the engine's own steps again (A replays with the real inputs)
        engine.step()
    torch.cuda.synchronize()
    after = times()
    start = time.perf_counter()
    for _ in range(100):
        engine.step()
    torch.cuda.synchronize()
    step_ms = (time.perf_counter() - start) * 10
    reserved = torch.cuda.memory_reserved() / 2**30
    pools = ("own pools" if args.own_pools else "one pool") + f", {reserved:.1f} GiB reserved"
    print(f"{args.variant} (engine {args.engine_capture}, captured {buckets}, {pools}; batch {args.batch}): A "
          f"{before} ms before, {after} ms after ({len(graphs)} graph(s) captured); LLMEngine.step {step_ms:.4f} ms; "
          f"roofline {roofline_ms:.3f} ms ({bandwidth / 1e9:.0f} GB/s copy bandwidth measured here)")  # fmt: skip


if __name__ == "__main__":
    main()
