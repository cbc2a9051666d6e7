"""A speculating engine against plain decoding, wave by wave: what issue 5's "never below 1.0x" is judged on.

One engine, speculation switched on and off between waves (`LLMEngine.set_speculation`); a wave is `--batch-size`
MT-bench prompts run to their end, prefill steps included, once plainly and once speculating, in ABBA order (plain
then speculating, then speculating then plain, ...), so that a drift of the host's speed between waves cancels.
On the GPU machine the host's speed changes between stretches of a few hundred milliseconds (session 50: whole rounds
of 8 prompts spread ±20–35%), which rounds of many prompts each could not resolve. Each wave gives one ratio (plain's
wall over the speculating engine's); the table gives the total ratio, the median of the waves' ratios, and a 95%
bootstrap interval of the total ratio over the waves. The policy instance persists across waves, as in a server.

`--forced-acceptance wrong` (the default) makes every draft wrong: the overhead of speculating when it never pays;
`right` drafts each request's plain greedy continuation; `none` keeps the draft's own drafts. There is no roofline:
the figure is a ratio of two host-bound runs of the same work. One JSON line per run with --json.
Usage: python bench/spec_overhead.py [--model default --draft default] [--batch-size 1] [--waves 24]
       [--output-len 128] [--forced-acceptance wrong|right|none] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from jetserve.assets import resolve_checkpoint
from jetserve.engine.bench_offline import bench_prompts
from jetserve.engine.config import EngineConfig
from jetserve.engine.engine import LLMEngine
from jetserve.sampling_params import SamplingParams

BOOTSTRAP_SAMPLES = 2000


def run_wave(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams, tag: str) -> tuple[float, dict]:
    """Run `prompts` to their end at once; returns (wall seconds, request id → output tokens)."""
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, params)
    outputs: dict[str, list[int]] = {}
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
    return time.perf_counter() - start, outputs


def bootstrap_interval(plain: list[float], spec: list[float], seed: int = 0) -> tuple[float, float]:
    """95% interval of sum(plain) / sum(spec), resampling the waves (paired)."""
    rng = random.Random(seed)
    n = len(plain)
    ratios = []
    for _ in range(BOOTSTRAP_SAMPLES):
        picks = [rng.randrange(n) for _ in range(n)]
        ratios.append(sum(plain[i] for i in picks) / sum(spec[i] for i in picks))
    ratios.sort()
    return ratios[int(0.025 * BOOTSTRAP_SAMPLES)], ratios[int(0.975 * BOOTSTRAP_SAMPLES) - 1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default", help="checkpoint folder, or `default` (the embedded model)")
    p.add_argument("--draft", default="default", help="draft folder, or `default` (the embedded model's draft)")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--waves", type=int, default=24, help="waves of --batch-size prompts, each run both ways")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--forced-acceptance", choices=("wrong", "right", "none"), default="wrong")
    p.add_argument("--json", help="append one JSON line to this file")
    args = p.parse_args()
    if min(args.batch_size, args.waves, args.output_len) < 1:
        p.error("--batch-size, --waves and --output-len must be positive")
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU runs the reference ops: a check of this script
    forced = None if args.forced_acceptance == "none" else args.forced_acceptance
    config = EngineConfig(
        model=resolve_checkpoint(args.model, "model"), draft=resolve_checkpoint(args.draft, "draft"),
        dtype="bfloat16" if device == "cuda" else "float32", device=device, max_num_seqs=args.batch_size,
        max_model_len=2048, num_pages=4096, num_slots=args.batch_size + 2,
    )  # fmt: skip
    engine = LLMEngine(config, forced_acceptance=forced)
    b = args.batch_size
    prompts = bench_prompts(engine, "mtbench", b, 2048, 0, b * args.waves)[: b * args.waves]
    params = SamplingParams(temperature=0, max_tokens=args.output_len)
    engine.set_speculation(False)
    _, reference = run_wave(engine, prompts, params, "reference")  # warms up; the drafts' continuations
    continuations = [reference[f"reference-{i}"] for i in range(len(prompts))]
    plain, spec, agree = [], [], 0
    verify_before = engine.spec_stats.num_verify_steps
    for w in range(args.waves):
        wave = prompts[w * b : (w + 1) * b]
        order = ("plain", "spec") if w % 2 == 0 else ("spec", "plain")
        for mode in order:
            engine.set_speculation(mode == "spec")
            tag = f"{mode}{w}"
            if mode == "spec" and forced is not None:
                for i, prompt in enumerate(wave):
                    engine.spec.forced_continuations[f"{tag}-{i}"] = prompt + continuations[w * b + i]
            seconds, outputs = run_wave(engine, wave, params, tag)
            (plain if mode == "plain" else spec).append(seconds)
            if mode == "spec":
                agree += sum(outputs[f"{tag}-{i}"] == continuations[w * b + i] for i in range(len(wave)))
    ratios = [a / s for a, s in zip(plain, spec, strict=True)]
    low, high = bootstrap_interval(plain, spec)
    row = {
        "model": args.model, "draft": args.draft, "batch_size": b, "waves": args.waves, "output_len": args.output_len,
        "forced_acceptance": args.forced_acceptance, "plain_s": sum(plain), "spec_s": sum(spec),
        "speedup": sum(plain) / sum(spec), "speedup_median_wave": statistics.median(ratios),
        "speedup_ci95": [low, high], "verify_steps": engine.spec_stats.num_verify_steps - verify_before,
        "requests_equal_to_plain": agree, "requests": len(prompts),
    }  # fmt: skip
    print(f"{'batch':>5} {'waves':>5} {'plain s':>8} {'spec s':>8} {'speed-up':>9} {'median wave':>11} "
          f"{'95% interval':>15} {'verify steps':>12} {'same as plain':>13}")  # fmt: skip
    print(f"{b:>5} {args.waves:>5} {row['plain_s']:>8.3f} {row['spec_s']:>8.3f} {row['speedup']:>8.3f}x "
          f"{row['speedup_median_wave']:>10.3f}x {f'{low:.3f}-{high:.3f}x':>15} {row['verify_steps']:>12} "
          f"{f'{agree}/{len(prompts)}':>13}")  # fmt: skip
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
