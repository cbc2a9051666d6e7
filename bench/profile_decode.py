"""Where a decode step's time goes: the engine on a random 2B/4B model. Per batch size: the unprofiled step through
`LLMEngine.step` against the decode graph replayed alone (the gap is the host's share: scheduling, upload, sampling's
read-back), then whole-batch decode steps under the PyTorch profiler: wall milliseconds per step beside the GPU's
busy time per step (kernel time summed), the step's roofline (its bytes over the copy bandwidth measured here), and
the kernels that take the most GPU time with their calls per step. One JSON line per batch size with --json FILE.
With `--draft random`, the steps are speculative (a random EAGLE-3 draft, adaptive speculation off so every step
verifies, every draft forced wrong: the verify step's overhead, kernel by kernel).
Usage: python bench/profile_decode.py [--config 2b] [--batch-sizes 1,64] [--input-len 1024] [--steps 20]
       [--max-num-seqs N] [--cuda-graph-max-batch-size B]
       [--draft random --spec-topk 1 --spec-steps 6 --spec-num-draft-tokens 7]
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch
from torch.profiler import ProfilerActivity, profile

from jetserve.engine.bench_offline import decode_step_bytes, measure_copy_bandwidth, random_model
from jetserve.engine.config import EngineConfig
from jetserve.engine.engine import LLMEngine
from jetserve.sampling_params import SamplingParams


def profile_batch(engine: LLMEngine, batch_size: int, input_len: int, steps: int, top: int, bandwidth: float) -> dict:
    gen = torch.Generator().manual_seed(batch_size)
    prefill_steps = math.ceil(batch_size * input_len / engine.config.max_num_batched_tokens)
    params = SamplingParams(temperature=0, max_tokens=prefill_steps + 4 * steps + 8, ignore_eos=True)
    for i in range(batch_size):
        prompt = torch.randint(0, 1000, (input_len,), generator=gen).tolist()
        if engine.spec is not None:  # drafts forced wrong against a made-up continuation: one token a step
            tail = torch.randint(0, 1000, (params.max_tokens + 64,), generator=gen).tolist()
            engine.spec.forced_continuations[f"p{i}"] = prompt + tail
        engine.add_request(f"p{i}", prompt, params)
    for _ in range(prefill_steps + steps):  # prefill, then warm decode steps (graph replay, allocator)
        engine.step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    step_ms = (time.perf_counter() - start) * 1e3 / steps
    replay_ms = graph_replay_ms(engine, batch_size, steps)
    phases = phase_ms(engine, steps)
    print(
        f"\nbatch {batch_size}: one step's phases, each timed to its GPU work's end (ms): "
        + ", ".join(f"{name} {ms:.3f}" for name, ms in phases.items())
    )
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - start) * 1e3 / steps
    averages = prof.key_averages()
    events = [e for e in averages if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]
    if not events:  # this torch names kernels differently: show its own table
        print(averages.table(sort_by="self_cuda_time_total", row_limit=top))
    gpu_ms = sum(e.self_device_time_total for e in events) / 1e3 / steps
    while engine.has_unfinished_requests():
        engine.step()
    # The profiled steps' mean context: prompt + the steps before them (the warm, unprofiled and phase-timed steps).
    roofline_ms = decode_step_bytes(engine, batch_size, input_len + 3 * steps + steps // 2) / bandwidth * 1e3
    print(
        f"\nbatch {batch_size}: LLMEngine.step {step_ms:.3f} ms, decode graph replay alone {replay_ms:.3f} ms "
        f"(unprofiled)"
    )
    kernels = sum(e.count for e in events) / steps
    print(f"batch {batch_size}: {wall_ms:.3f} ms per step (profiled), GPU busy {gpu_ms:.3f} ms per step in "
          f"{kernels:.0f} kernels, roofline {roofline_ms:.3f} ms ({bandwidth / 1e9:.0f} GB/s copy bandwidth measured "
          f"here)")  # fmt: skip
    print(f"{'kernel':80} {'us/step':>9} {'calls/step':>10}")
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:top]:
        print(f"{e.key[:80]:80} {e.self_device_time_total / steps:9.1f} {e.count / steps:10.1f}")
    return {"batch_size": batch_size, "input_len": input_len, "step_ms": step_ms, "replay_ms": replay_ms,
            "phases_ms": phases,
            "kernels_per_step": kernels, "wall_ms_per_step": wall_ms,
            "gpu_ms_per_step": gpu_ms, "roofline_ms_per_step": roofline_ms, "copy_gb_s": bandwidth / 1e9}  # fmt: skip


def phase_ms(engine: LLMEngine, steps: int) -> dict[str, float]:
    """Milliseconds per step in each phase of `LLMEngine.step`, with the device synchronised at every boundary (so
    each phase includes the GPU work it launched): scheduling, the runner's table updates, the graph replay, the
    sampling and the read-back of the tokens, the scheduler's bookkeeping; the rest (outputs) by difference."""
    runner, scheduler, graphs = engine.runner, engine.scheduler, engine.runner.graph_runner
    sync = torch.cuda.synchronize if runner.device.type == "cuda" else (lambda: None)
    totals: dict[str, float] = {}

    def timed(name: str, fn):
        def call(*args, **kwargs):
            sync()
            start = time.perf_counter()
            result = fn(*args, **kwargs)
            sync()
            totals[name] = totals.get(name, 0.0) + time.perf_counter() - start
            return result

        return call

    patched = {(scheduler, "schedule"): "schedule", (runner, "_claim_slots"): "claim slots",
               (runner, "upload"): "upload", (runner.sampler, "__call__"): "sample",
               (scheduler, "postprocess"): "postprocess"}  # fmt: skip
    if graphs is not None:
        patched[(graphs, "run")] = "graph run"
    originals = {key: getattr(*key) for key in patched}
    for (obj, attr), name in patched.items():
        if attr == "__call__":  # a special method is looked up on the type: wrap the instance's use instead
            runner.sampler = _CallWrapper(obj, timed(name, obj))
        else:
            setattr(obj, attr, timed(name, getattr(obj, attr)))
    try:
        sync()
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        sync()
        wall = time.perf_counter() - start
    finally:
        for (obj, attr), fn in originals.items():
            if attr == "__call__":
                runner.sampler = obj
            else:
                setattr(obj, attr, fn)
    result = {name: 1e3 * seconds / steps for name, seconds in totals.items()}
    result["step"] = 1e3 * wall / steps
    result["rest"] = result["step"] - sum(v for k, v in result.items() if k != "step")
    return result


class _CallWrapper:
    """`sampler(...)` through `call`, every other attribute from the sampler itself."""

    def __init__(self, target, call) -> None:
        self._target, self._call = target, call

    def __call__(self, *args, **kwargs):
        return self._call(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._target, name)


def graph_replay_ms(engine: LLMEngine, batch_size: int, steps: int) -> float:
    """Milliseconds per replay of the decode graph of `batch_size`'s bucket, back to back, each after a rewind of its
    positions (`GraphRunner.rewind`, one small copy), so each replay redoes the last step: same bytes, same kernels."""
    graphs = engine.runner.graph_runner
    if graphs is None or not graphs.fits(batch_size):
        return float("nan")
    bucket = graphs.bucket(batch_size)
    graph = graphs.graphs[bucket]
    graph.replay()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(steps):
        graphs.rewind(bucket)
        graph.replay()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="2b")
    p.add_argument("--batch-sizes", default="1,64")
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--json")
    p.add_argument(
        "--max-num-seqs", type=int, default=0,
        help="the engine's max_num_seqs (default: the largest batch size); a server's is its own, often larger",
    )  # fmt: skip
    p.add_argument(
        "--cuda-graph-max-batch-size", type=int, default=None,
        help="the largest decode graph captured (default: max_num_seqs); 1 captures the batch-1 graph alone",
    )  # fmt: skip
    p.add_argument(
        "--overlap-scheduling", action=argparse.BooleanOptionalAction, default=True,
        help="decode steps launched ahead (the engine's default; steps launched ahead skip the scheduler); the "
        "phase breakdown synchronises at every phase boundary, so its phases add up to a step without overlap",
    )  # fmt: skip
    p.add_argument("--draft", choices=["random"], help="speculative steps with a random EAGLE-3 draft")
    p.add_argument("--spec-topk", type=int, default=1)
    p.add_argument("--spec-steps", type=int, default=6)
    p.add_argument("--spec-num-draft-tokens", type=int, default=7)
    args = p.parse_args()
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    device = torch.device("cuda")
    model = random_model(args.config, "bfloat16", device, seed=0)
    spec, draft = {}, None
    if args.draft:
        from jetserve.spec.eagle3 import random_draft_model

        draft = random_draft_model(model, seed=0)
        spec = dict(draft="random", spec_topk=args.spec_topk, spec_steps=args.spec_steps,
                    spec_num_draft_tokens=args.spec_num_draft_tokens, spec_adaptive=False)  # fmt: skip
    max_num_seqs = max(args.max_num_seqs, *sizes)
    config = EngineConfig(device="cuda", max_num_seqs=max_num_seqs, max_model_len=args.input_len + 4 * args.steps + 256,
                          overlap_scheduling=args.overlap_scheduling,
                          cuda_graph_max_batch_size=args.cuda_graph_max_batch_size, **spec)  # fmt: skip
    forced = "wrong" if args.draft else None
    engine = LLMEngine(config, model=model, tokenizer=None, draft=draft, forced_acceptance=forced)
    bandwidth = measure_copy_bandwidth(device)
    rows = [profile_batch(engine, b, args.input_len, args.steps, args.top, bandwidth) for b in sizes]
    if args.json:
        with open(args.json, "a") as f:
            meta = {"config": args.config, "max_num_seqs": max_num_seqs, "device": torch.cuda.get_device_name()}
            f.writelines(json.dumps(r | meta) + "\n"
                         for r in rows)  # fmt: skip


if __name__ == "__main__":
    main()
