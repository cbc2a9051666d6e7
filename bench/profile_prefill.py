"""Where a PREFILL step's time goes: the engine prefilling one prompt at a time (batch 1: a request's time to first
token), on the embedded default model or a random 2B/4B config.

Per prompt length: the first step of that length (anything compiled or specialised for it runs then) and the median
of `--repeats` more, each a whole `LLMEngine.step` (schedule, forward, sample, read the token back), beside the step's
roofline (the larger of its FLOPs over the bf16 GEMM throughput and its weight bytes over the copy bandwidth, both
measured in the same run); then one length under the PyTorch profiler: the GPU's busy time and its kernels, the host
ops, the CUDA calls that synchronise or copy, and the host's time in each part of the step (each layer's mixer and
MLP, the logits, the forward batch's tables, the draft's catch-up). One JSON line per result with --json FILE.

Usage: python bench/profile_prefill.py [--model default | --config 2b] [--lengths 32,100,300,1000] [--repeats 5]
       [--profile-len 100] [--draft default|random] [--top 20]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import Counter, defaultdict
from contextlib import contextmanager

import torch
from torch.profiler import ProfilerActivity, profile

from jetserve.assets import resolve_checkpoint
from jetserve.engine.bench_offline import measure_copy_bandwidth, measure_gemm_tflops, prefill_flops, random_model
from jetserve.engine.config import EngineConfig
from jetserve.engine.engine import LLMEngine
from jetserve.ops.jit_watch import watch_specializations
from jetserve.sampling_params import SamplingParams

# CUDA runtime/driver calls that synchronise with the device, and copies (which wait when their host side is pageable)
WAITING_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
                 "cuStreamSynchronize", "cuEventSynchronize")  # fmt: skip
LAUNCH_CALLS = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")


def allocated_segments() -> int:
    """Device memory segments the caching allocator has taken from the driver so far (each a cudaMalloc)."""
    return torch.cuda.memory_stats().get("segment.all.allocated", 0) if torch.cuda.is_available() else 0


def first_prefill(engine: LLMEngine, prompt: list[int], tag: str) -> tuple[float, Counter, int]:
    """`prefill_once` of a length not seen before: its seconds, the Triton specializations it built (by kernel), the
    allocator segments it took."""
    segments = allocated_segments()
    with watch_specializations() as built:
        seconds = prefill_once(engine, prompt, tag)
    return seconds, built, allocated_segments() - segments


def prefill_once(engine: LLMEngine, prompt: list[int], tag: str) -> float:
    """Wall seconds of the step that prefills `prompt` alone and samples its one token."""
    engine.add_request(tag, prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = engine.step()
    seconds = time.perf_counter() - start
    assert any(o.request_id == tag and o.finished for o in outputs), "the prefill step did not finish the request"
    assert not engine.has_unfinished_requests()
    return seconds


class PartTimer:
    """Host seconds spent inside named parts of a step (forward hooks and wrapped methods; nothing synchronised, so a
    part's figure is its launches plus any wait for the device inside it)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self._undo: list = []

    @contextmanager
    def part(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - start

    def wrap(self, obj, attr: str, name: str) -> None:
        fn = getattr(obj, attr)

        def timed(*args, **kwargs):
            with self.part(name):
                return fn(*args, **kwargs)

        setattr(obj, attr, timed)
        self._undo.append(lambda: delattr(obj, attr) if attr in vars(obj) else None)

    def remove(self) -> None:
        for undo in self._undo:
            undo()
        self._undo.clear()


def attach_parts(engine: LLMEngine, timer: PartTimer) -> None:
    runner = engine.runner
    model = runner.model
    for i, layer in enumerate(model.model.layers):
        timer.wrap(layer.self_attn, "forward", f"layer {i} {layer.kind} mixer")
        timer.wrap(layer.mlp, "forward", f"layer {i} mlp")
    timer.wrap(model, "compute_logits", "logits")
    timer.wrap(runner, "prefill_forward_batch", "forward batch (host tables, upload, kv metadata)")
    timer.wrap(engine.scheduler, "schedule", "schedule")
    timer.wrap(engine.scheduler, "postprocess", "postprocess")
    if runner.spec is not None:
        timer.wrap(runner, "_catch_up_prefill", "draft catch-up")
    graphs = runner.prefill_graphs
    if graphs is not None:  # a graphed step: the rows and their copy, then the replay (no layer parts)
        timer.wrap(graphs, "run", "prefill graph (host rows, copy, replay)")
        if runner.spec is not None:
            timer.wrap(graphs, "catch_up", "draft catch-up graph")


def profile_length(engine: LLMEngine, prompt: list[int], top: int) -> dict:
    """One prefill step of `prompt` under the profiler, then the same again with the part timer (unprofiled)."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        wall = prefill_once(engine, prompt, "profiled")
    averages = prof.key_averages()
    kernels = [e for e in averages if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]
    runtime = [e for e in averages if e.key.startswith(("cuda", "cu")) and e.key not in {k.key for k in kernels}]
    gpu_ms = sum(e.self_device_time_total for e in kernels) / 1e3
    launches = sum(e.count for e in runtime if e.key.startswith(LAUNCH_CALLS))
    waits = {e.key: (e.count, e.cpu_time_total / 1e3) for e in runtime if e.key.startswith(WAITING_CALLS)}
    print(f"\nprofiled step, {len(prompt)} tokens: wall {wall * 1e3:.3f} ms (profiler on), GPU busy {gpu_ms:.3f} ms in "
          f"{sum(e.count for e in kernels)} kernels, {launches} launch calls")  # fmt: skip
    print("synchronisations and copies: " + (", ".join(f"{k} ×{n} ({ms:.3f} ms)" for k, (n, ms) in waits.items())
                                                  or "none"))  # fmt: skip
    print(f"{'kernel':72} {'us':>9} {'calls':>6}")
    for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:top]:
        print(f"{e.key[:72]:72} {e.self_device_time_total:9.1f} {e.count:6d}")
    host = [e for e in averages if getattr(e, "device_type", None) != torch.autograd.DeviceType.CUDA]
    print(f"\n{'host op (self CPU time)':72} {'us':>9} {'calls':>6}")
    for e in sorted(host, key=lambda e: -e.self_cpu_time_total)[:top]:
        print(f"{e.key[:72]:72} {e.self_cpu_time_total:9.1f} {e.count:6d}")
    timer = PartTimer()
    attach_parts(engine, timer)
    try:
        wall_parts = prefill_once(engine, prompt, "parts")
    finally:
        timer.remove()
    print(f"\nhost time per part, {len(prompt)} tokens (unprofiled step: {wall_parts * 1e3:.3f} ms)")
    for name, seconds in timer.seconds.items():
        print(f"  {name:60} {seconds * 1e3:8.3f} ms")
    return {"kind": "profile", "tokens": len(prompt), "wall_ms_profiled": wall * 1e3, "gpu_busy_ms": gpu_ms,
            "kernels": sum(e.count for e in kernels), "launch_calls": launches,
            "waits": {k: n for k, (n, _) in waits.items()}, "step_ms": wall_parts * 1e3,
            "parts_ms": {k: v * 1e3 for k, v in timer.seconds.items()}}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = p.add_mutually_exclusive_group()
    source.add_argument("--model", default="default", help="checkpoint folder, or `default` (the embedded model)")
    source.add_argument("--config", help="2b | 4b: random weights made on the device (instead of --model)")
    p.add_argument("--draft", help="`default` (the embedded draft), a draft folder, or `random`")
    p.add_argument(
        "--lengths",
        default="32,100,300,1000,37",
        help="prompt lengths, in this order (a shorter one last: a first step that builds nothing and takes no memory)",
    )
    p.add_argument(
        "--prefill-graph-max-tokens",
        type=int,
        default=EngineConfig.prefill_graph_max_tokens,
        help="steps up to this many tokens replay a prefill graph (0: every step eager; default: the engine's)",
    )
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--profile-len", type=int, default=100)
    p.add_argument("--top", type=int, default=20)
    p.add_argument("--json", help="append one JSON line per result to this file")
    args = p.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    if min(lengths) < 1 or args.repeats < 1:
        p.error("--lengths and --repeats must be positive")
    if args.prefill_graph_max_tokens < 0:
        p.error("--prefill-graph-max-tokens must be ≥ 0")
    max_len = max(*lengths, args.profile_len) + 64
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU runs the reference ops: a check of this script
    dtype = "bfloat16" if device == "cuda" else "float32"
    model = random_model(args.config, dtype, torch.device(device), seed=0) if args.config else None
    draft = None
    if args.draft == "random":
        from jetserve.spec.eagle3 import random_draft_model

        draft = random_draft_model(model, seed=0)
    config = EngineConfig(
        model=None if args.config else resolve_checkpoint(args.model, "model"),
        draft=None if args.draft in (None, "random") else resolve_checkpoint(args.draft, "draft"),
        dtype=dtype, device=device, max_num_seqs=1, max_model_len=max_len,
        prefill_graph_max_tokens=args.prefill_graph_max_tokens,
    )  # fmt: skip
    started = time.perf_counter()
    engine = LLMEngine(config, model=model, draft=draft)
    graphs = engine.runner.prefill_graphs
    print(f"engine start-up {time.perf_counter() - started:.2f} s; prefill graphs: "
          f"{'none' if graphs is None else ', '.join(map(str, graphs.buckets))} tokens")  # fmt: skip
    vocab = engine.model_config.vocab_size
    device = engine.runner.device
    bandwidth, tflops = measure_copy_bandwidth(device), measure_gemm_tflops(device, engine.runner.dtype)
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s, GEMM {tflops:.3g} TFLOP/s (measured here)")
    gen = torch.Generator().manual_seed(0)
    results = []
    prefill_once(engine, torch.randint(0, vocab, (7,), generator=gen).tolist(), "warm")  # the first step of all
    print(f"{'tokens':>7} {'first step ms':>14} {'(kernels built':>14} {'segments)':>10} {'warm median ms':>15} "
          f"{'warm min':>9} {'roofline ms':>12} {'tok/s (warm)':>13}")  # fmt: skip
    for n in lengths:
        prompts = torch.randint(0, vocab, (args.repeats + 1, n), generator=gen).tolist()
        first, built, segments = first_prefill(engine, prompts[0], f"first{n}")
        warm = [prefill_once(engine, prompt, f"warm{n}-{i}") for i, prompt in enumerate(prompts[1:])]
        median = statistics.median(warm)
        roofline = max(prefill_flops(engine, n, n) / (tflops * 1e12), weight_bytes / bandwidth)
        names = " ".join(sorted(built))
        print(f"{n:7d} {first * 1e3:14.3f} {sum(built.values()):14d} {segments:10d} {median * 1e3:15.3f} "
              f"{min(warm) * 1e3:9.3f} {roofline * 1e3:12.3f} {n / median:13.0f}  {names}")  # fmt: skip
        results.append({"kind": "length", "tokens": n, "first_ms": first * 1e3, "first_kernels_built": dict(built),
                        "first_new_segments": segments, "warm_median_ms": median * 1e3,
                        "warm_min_ms": min(warm) * 1e3, "roofline_ms": roofline * 1e3,
                        "copy_gb_s": bandwidth / 1e9, "gemm_tflops": tflops})  # fmt: skip
    prompt = torch.randint(0, vocab, (args.profile_len,), generator=gen).tolist()
    prefill_once(engine, prompt, "before-profile")
    results.append(profile_length(engine, prompt, args.top))
    if args.json:
        with open(args.json, "a") as f:
            for r in results:
                tags = {"model": args.config or args.model, "draft": args.draft,
                        "prefill_graph_max_tokens": args.prefill_graph_max_tokens}  # fmt: skip
                f.write(json.dumps(tags | r) + "\n")


if __name__ == "__main__":
    main()
