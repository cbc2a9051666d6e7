"""The default pair's speculative graphs replayed back to back: per batch size, the plain decode graph, then for each
of the engine's draft shapes (the adaptive engine's: chain 7, chain 3) its draft graph, and its draft graph followed
by its verify graph, the static inputs restored before each replay (one small copy, in every figure), so that every
replay drafts and verifies the same rows at the same positions; verify = (draft + verify) - draft; then the draft's
catch-up graphs (each flush width, one position a row — a shadow step's — and a whole row). µs a replay, the
median of --rounds rounds of --reps replays, beside the roofline: the bytes a replay must read (the target's weights
for decode and verify, the draft layer and lm_head for each draft level, the catch-up's draft layer and fc in
verify) over the copy bandwidth measured in the same run. These graphs are bound by their launches (~200 a
speculative step at batch 1), not their bytes, so the roofline is far below every figure.

A/B two versions of the package by running it twice, the other on PYTHONPATH (e.g. the session's starting tree
exported to a folder): the figures repeat to within ~1% between runs on an H200 (session 46). On the CPU (no CUDA
graphs) it times the same bodies eagerly with a host clock: a smoke test of the script, not a measurement.
One JSON line per (batch size, graph) with --json. `--profile N` then replays each graph N more times under the
PyTorch profiler (CUDA only) and prints, per graph, its kernels per replay, the GPU's busy time (the union of kernel
intervals: under programmatic dependent launch a kernel's interval includes its wait for the one before), the idle
rest of the replay, and the kernels taking the most time; JETSERVE_PDL=0 gives each kernel's own time.
Usage: python bench/spec_graphs.py [--batch-sizes 1,8] [--reps 200] [--rounds 5] [--profile N [--top 12]]
       [--json FILE]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from jetserve.assets import resolve_checkpoint
from jetserve.engine.bench_offline import bench_prompts, measure_copy_bandwidth
from jetserve.engine.config import EngineConfig
from jetserve.engine.engine import LLMEngine
from jetserve.engine.speculative import flush_block_size, flush_block_views
from jetserve.sampling_params import SamplingParams


def _timed(fn: Callable[[], None], device: torch.device, reps: int, rounds: int) -> float:
    """µs per call of fn: the median over `rounds` of `reps` calls back to back."""
    fn()
    per_round = []
    for _ in range(rounds):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                fn()
            end.record()
            torch.cuda.synchronize(device)
            per_round.append(start.elapsed_time(end) * 1e3 / reps)
        else:
            begin = time.perf_counter()
            for _ in range(reps):
                fn()
            per_round.append((time.perf_counter() - begin) * 1e6 / reps)
    return statistics.median(per_round)


def _profiled(fn: Callable[[], None], device: torch.device, reps: int, top: int) -> dict:
    """Kernels per call of fn, the GPU's busy µs per call (the union of kernel intervals), and the `top` kernels by
    time: (name, µs per call, launches per call)."""
    fn()
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize(device)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy, end = 0.0, float("-inf")
    by_name: dict[str, list[float]] = {}
    for e in sorted(kernels, key=lambda e: e.time_range.start):
        start, stop = e.time_range.start, e.time_range.end
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
        by_name.setdefault(e.name, []).append(stop - start)
    ranked = sorted(by_name.items(), key=lambda item: -sum(item[1]))[:top]
    return {"kernels": len(kernels) / reps, "busy_us": busy / reps,
            "top": [(name, sum(times) / reps, len(times) / reps) for name, times in ranked]}  # fmt: skip


def _nbytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def _engine(batch_size: int, device: str, dtype: str, steps: int) -> LLMEngine:
    """The default pair's engine, `steps` steps into `batch_size` greedy MT-bench requests (prefilled, decoding)."""
    engine = LLMEngine(EngineConfig(
        model=str(resolve_checkpoint("default", "model")), draft=str(resolve_checkpoint("default", "draft")),
        device=device, dtype=dtype, max_num_seqs=batch_size, gpu_memory_utilization=0.2,
    ))  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=4000, ignore_eos=True)
    for i, prompt in enumerate(bench_prompts(engine, "mtbench", batch_size, 1024, 0, batch_size)[:batch_size]):
        engine.add_request(f"r{i}", prompt, params)
    for _ in range(steps):
        engine.step()
    return engine


def _bodies(engine: LLMEngine, batch_size: int, shape: int) -> tuple[Callable[[], None], Callable[[], None]]:
    """(draft, draft + verify) of `shape` for the running rows: graph replays on CUDA, the same calls eagerly
    elsewhere; each restores the rows' inputs (root, cached prefix, slot) first."""
    spec = engine.spec
    seqs = list(engine.scheduler.running)[:batch_size]
    device = engine.runner.device
    host = [[s.token_ids[-1] for s in seqs], [s.num_computed_tokens for s in seqs], [s.slot for s in seqs]]
    inputs = torch.tensor(host, dtype=torch.int64, device=device)  # [3, N]
    graphs = spec.graphs
    if graphs is not None:
        bucket = graphs._load(inputs)  # padded rows past them zeroed once
        draft, verify = graphs.graphs[("draft", bucket, shape)], graphs.graphs[("verify", bucket, shape, True)]

        def draft_only() -> None:
            graphs.inputs[:, : len(seqs)].copy_(inputs)
            draft.replay()

        def draft_verify() -> None:
            draft_only()
            verify.replay()

        return draft_only, draft_verify
    roots, prefix, slots = inputs.clone().unbind(0)

    def draft_eager() -> object:
        return spec.draft_tree(shape, roots, prefix, slots)

    def draft_verify_eager() -> None:
        spec.verify(shape, draft_eager(), prefix, slots, None)

    return draft_eager, draft_verify_eager


def _catch_up_body(engine: LLMEngine, batch_size: int, width: int, valid: int) -> Callable[[], None]:
    """The draft's catch-up (`SpecDecoder.flush_rows`) of the running rows in rows `width` wide, `valid` positions
    each (the flush graph of that width on CUDA, with its inputs' copies; eagerly elsewhere): a shadow step's
    catch-up is one position. It rewrites the draft's K/V at the rows' last cached positions, which no replay reads."""
    spec = engine.spec
    seqs = list(engine.scheduler.running)[:batch_size]
    num_rows = spec.graphs.bucket(len(seqs)) if spec.graphs is not None else len(seqs)
    block = np.zeros(flush_block_size(num_rows, width), dtype=np.int64)  # the host rows, padded to the bucket: ids 0
    _, starts, counts, slots = flush_block_views(block, num_rows, width)
    starts[: len(seqs)] = [max(0, s.num_computed_tokens - width) for s in seqs]
    counts[: len(seqs)] = valid
    slots[: len(seqs)] = [s.slot for s in seqs]
    if spec.graphs is not None:
        return lambda: spec.graphs.flush(block, num_rows, width)
    return lambda: spec.flush_rows(*flush_block_views(engine.runner.uploads.upload(block), num_rows, width))


def _measure(
    batch_size: int, args: argparse.Namespace, device: torch.device, dtype: str, bandwidth: float, out
) -> None:
    """Time (and with --profile, profile) every graph of an engine at `batch_size`; the engine is freed on return."""
    engine = _engine(batch_size, args.device, dtype, args.steps)
    spec, runner = engine.spec, engine.runner
    target, draft = _nbytes(runner.model), _nbytes(spec.draft.midlayer)
    head, fc = _nbytes(spec.draft.lm_head), _nbytes(spec.draft.fc)
    rows: list[tuple[str, float, int]] = []
    bodies: list[tuple[str, Callable[[], None], float]] = []  # (graph, body, its µs) for --profile
    graphs = runner.graph_runner
    if graphs is not None:
        bucket = graphs.bucket(batch_size)
        graph = graphs.graphs[bucket]
        graph.replay()

        def replay() -> None:  # the same step again: each replay advances its inputs to the next one
            graphs.rewind(bucket)
            graph.replay()

        rows.append(("decode", _timed(replay, device, args.reps, args.rounds), target))
        bodies.append(("decode", replay, rows[-1][1]))
    for shape, options in enumerate(spec.shapes):
        levels = options.num_draft_tokens - 1
        name = f"chain {levels}" if options.topk == 1 else f"tree {options.topk}x{options.num_steps}"
        draft_only, draft_verify = _bodies(engine, batch_size, shape)
        drafted = _timed(draft_only, device, args.reps, args.rounds)
        both = _timed(draft_verify, device, args.reps, args.rounds)
        draft_bytes = levels * head + (levels - 1) * draft
        rows += [(f"{name} draft", drafted, draft_bytes), (f"{name} verify", both - drafted, target + draft + fc),
                 (f"{name} draft + verify", both, draft_bytes + target + draft + fc)]  # fmt: skip
        bodies += [(f"{name} draft", draft_only, drafted), (f"{name} draft + verify", draft_verify, both)]
    widths = spec.graphs.flush_widths if spec.graphs is not None else [spec.ring]
    for width in widths:
        for valid in sorted({1, width}):
            body = _catch_up_body(engine, batch_size, width, valid)
            rows.append((f"catch-up {valid} of {width}", _timed(body, device, args.reps, args.rounds), draft + fc))
    for graph, us, nbytes in rows:
        roofline = nbytes / (bandwidth * 1e3)  # µs
        print(f"{batch_size:5d}  {graph:22s} {us:9.2f} {roofline:9.2f}")
        if out:
            out.write(json.dumps({"batch_size": batch_size, "graph": graph, "us": round(us, 3),
                                  "roofline_us": round(roofline, 3), "bytes": nbytes, "device": str(device),
                                  "copy_bandwidth_gb_s": round(bandwidth, 1)}) + "\n")  # fmt: skip
    for graph, body, us in bodies if args.profile else []:
        prof = _profiled(body, device, args.profile, args.top)
        print(
            f"\nbatch {batch_size}, {graph} (profiled, {args.profile} replays): {prof['kernels']:.1f} kernels, "
            f"GPU busy {prof['busy_us']:.1f} of {us:.1f} µs a replay (idle {us - prof['busy_us']:.1f})"
        )
        for kernel, kernel_us, calls in prof["top"]:
            print(f"  {kernel[:72]:72s} {kernel_us:8.1f} µs {calls:5.1f} calls")
        if out:
            out.write(json.dumps({"batch_size": batch_size, "graph": graph, "profile": prof}) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--reps", type=int, default=200)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=30, help="engine steps before timing (prefill, then decoding)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--profile", type=int, default=0, help="replays of each graph under the profiler (CUDA only)")
    p.add_argument("--top", type=int, default=12, help="kernels listed per profiled graph")
    p.add_argument("--json")
    args = p.parse_args()
    try:
        batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    except ValueError:
        p.error(f"--batch-sizes {args.batch_sizes!r}: want integers, comma-separated (e.g. 1,8)")
    if min(batch_sizes) < 1 or args.reps < 1 or args.rounds < 1 or args.profile < 0:
        p.error("--batch-sizes, --reps and --rounds must be ≥ 1, --profile ≥ 0")
    device = torch.device(args.device)
    if args.profile and device.type != "cuda":
        p.error("--profile times CUDA graphs' kernels: it needs a CUDA device")
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    bandwidth = measure_copy_bandwidth(device) / 1e9  # GB/s
    out = open(args.json, "a") if args.json else None
    clock = "CUDA-graph replays" if device.type == "cuda" else "eager calls, host clock (CPU: a smoke test)"
    print(f"{clock}; copy bandwidth {bandwidth:.0f} GB/s; µs a replay (roofline µs)")
    print(f"{'batch':>5s}  {'graph':22s} {'µs':>9s} {'roofline':>9s}")
    for batch_size in batch_sizes:
        _measure(batch_size, args, device, dtype, bandwidth, out)
        gc.collect()  # the engine's reference cycles, before the next engine plans its memory
        if device.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
