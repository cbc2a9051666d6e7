"""A speculating engine against plain decoding, wave by wave: what issue 5's "never below 1.0x" is judged on.

One engine, speculation switched on and off between waves (`LLMEngine.set_speculation`); a wave is `--batch-size`
MT-bench prompts run to their end, prefill steps included, once plainly and once speculating, in ABBA order (plain
then speculating, then speculating then plain, ...), so that a drift of the host's speed between waves cancels.
On the GPU machine the host's speed changes between stretches of a few hundred milliseconds (session 50: whole rounds
of 8 prompts spread ±20–35%), which rounds of many prompts each could not resolve. Each wave gives one ratio (plain's
wall over the speculating engine's); the table gives the total ratio, the median of the waves' ratios, and a 95%
bootstrap interval of the total ratio over the waves. The policy instance persists across waves, as in a server.

`--draft-kept` adds a third run of each wave: speculation on, every step plain (the policy forced to plain decoding), so
that what keeping the draft caught up costs (its feature ring's catch-ups, its prefill catch-up, the plain steps'
host work) is told apart from what the policy's verify steps cost. The waves then run plain, speculating, draft-kept,
and the next wave in the reverse order.

`--candidate NAME` adds a run of each wave speculating under a candidate policy (a class `bench/policy_sim.py` names,
e.g. `FreshExplorationPolicy`, or `VerifiedExplorationPolicy`: the engine's without shadow explorations; or
`module:Class`), its own instance kept across waves as the engine's is: a GPU A/B of a policy the simulator favours,
in the same waves as the engine's policy. Each run's row counts its verify steps and the drafts its shadow
explorations scored (`SpecDecoder.shadow_draft`); a line after the table (and the JSON) gives each run's first guesses
right and scored (`FirstGuesses`: what lets the policy rule chains out without verifying them).

A line after the table gives each run's median over the waves of its first step (the wave's prefill, where its
prompts fit one step) and of its later steps' median: where a run's time goes (session 56: the draft-kept engine's
cost split between the prompt's draft catch-up and the decode steps' feature store). Then each run's engine calls by
kind (`step_kind`: prefill, verify, shadow, catch-up, and plain: after a call of another kind, scoring drafts or
guesses, or alone), their count and total time, over all waves: where the speculating engine's time beyond the
draft-kept engine's goes (its explorations, or slower plain steps); and the plain calls' median, 90th and 99th
percentile and mean (session 58: the speculating run's plain calls cost 1.9 µs more on average than plain decoding's
with equal medians).

`--forced-acceptance wrong` (the default) makes every draft wrong: the overhead of speculating when it never pays;
`right` drafts each request's plain greedy continuation; `none` keeps the draft's own drafts. There is no roofline:
the figure is a ratio of two host-bound runs of the same work. One JSON line per run with --json, each wave's seconds
in each run and the speculating run's verify steps per wave included.
Usage: python bench/spec_overhead.py [--model default --draft default] [--batch-size 1] [--waves 24]
       [--output-len 128] [--forced-acceptance wrong|right|none] [--draft-kept] [--candidate NAME] [--json FILE]
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
from jetserve.engine.speculative import AdaptivePolicy, SpecStats
from jetserve.sampling_params import SamplingParams

BOOTSTRAP_SAMPLES = 2000


# What an engine call did (`step_kind`), in the order a call that did several is counted under. A plain call is told
# apart by what came with it: the call after one of another kind ("plain after"), or one that scored shadow drafts or
# first guesses ("plain scoring": `SpecDecoder.resolve_shadows`).
STEP_KINDS = ("prefill", "verify", "shadow", "catch-up", "plain after", "plain scoring", "plain")
PLAIN_KINDS = STEP_KINDS[4:]
QUANTILES = {"p50": 0.5, "p90": 0.9, "p99": 0.99}  # of the plain calls' seconds (`call_quantiles`)


def spec_counters(stats: SpecStats) -> tuple[int, ...]:
    """What `step_kind` compares across a call: verify steps resolved, shadow steps and catch-up forwards launched,
    shadow drafts and first guesses scored."""
    return (stats.num_verify_steps, stats.num_shadow_steps, stats.num_catch_ups, stats.num_shadow_drafts,
            stats.num_first_guesses)  # fmt: skip


def step_kind(stats: SpecStats, before: tuple[int, ...], first_token: bool, after_other: bool = False) -> str:
    """The kind of the engine call that moved the counters from `before` (`spec_counters`): a prefill where a request
    got its first token, else a verify step resolved, a shadow draft launched, a ring's catch-up run, or plain
    decoding: in the call after one of another kind (`after_other`), or scoring drafts or guesses, or alone."""
    if first_token:
        return "prefill"
    moved = [a > b for a, b in zip(spec_counters(stats), before, strict=True)]
    kind = next((kind for kind, m in zip(STEP_KINDS[1:4], moved, strict=False) if m), None)
    if kind is not None:
        return kind
    if after_other:
        return "plain after"
    return "plain scoring" if any(moved[3:]) else "plain"


def run_wave(
    engine: LLMEngine, prompts: list[list[int]], params: SamplingParams, tag: str
) -> tuple[float, dict, list[float], list[str]]:
    """Run `prompts` to their end at once; returns (wall seconds, request id → output tokens, each engine call's
    seconds — the first the prefill's where the wave's prompts fit one step — and each one's `step_kind`)."""
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, params)
    outputs: dict[str, list[int]] = {}
    steps, kinds = [], []
    start = last = time.perf_counter()
    while engine.has_unfinished_requests():
        before = spec_counters(engine.spec_stats)
        first_token = False
        for out in engine.step():
            first_token |= out.request_id not in outputs
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        now = time.perf_counter()
        steps.append(now - last)
        after_other = bool(kinds) and kinds[-1] not in PLAIN_KINDS
        kinds.append(step_kind(engine.spec_stats, before, first_token, after_other))
        last = now
    return last - start, outputs, steps, kinds


def call_quantiles(seconds: list[float]) -> dict[str, float]:
    """The median, 90th and 99th percentile and mean of calls' seconds (zeros for none): where a run's mean moves
    with its typical call or with its tail."""
    if not seconds:
        return dict.fromkeys([*QUANTILES, "mean"], 0.0)
    ordered = sorted(seconds)
    quantiles = {name: ordered[min(len(ordered) - 1, int(q * len(ordered)))] for name, q in QUANTILES.items()}
    return quantiles | {"mean": sum(ordered) / len(ordered)}


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
    p.add_argument("--waves", type=int, default=24, help="waves of --batch-size prompts, each run every way")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--forced-acceptance", choices=("wrong", "right", "none"), default="wrong")
    p.add_argument("--draft-kept", action="store_true", help="also run each wave speculating with every step plain")
    p.add_argument("--candidate", help="also run each wave speculating under this policy (bench/policy_sim.py's names)")
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
    policies = {"spec": engine.spec.policy}
    if args.candidate:
        from policy_sim import load_policy  # bench/ is this script's folder

        policies["cand"] = load_policy(args.candidate)(engine.spec.shapes, adaptive=True)
    if args.draft_kept:  # its own instance: the engine's policy times only its own waves
        policies["kept"] = AdaptivePolicy(engine.spec.shapes, adaptive=True)
        policies["kept"].forced_option = -1
    b = args.batch_size
    prompts = bench_prompts(engine, "mtbench", b, 2048, 0, b * args.waves)[: b * args.waves]
    params = SamplingParams(temperature=0, max_tokens=args.output_len)
    engine.set_speculation(False)
    _, reference, _, _ = run_wave(engine, prompts, params, "reference")  # warms up; the drafts' continuations
    continuations = [reference[f"reference-{i}"] for i in range(len(prompts))]
    modes = ("plain", *policies)
    seconds: dict[str, list[float]] = {mode: [] for mode in modes}
    verify_steps: dict[str, list[int]] = {mode: [] for mode in modes}  # each run's verify steps, wave by wave
    shadow_drafts = {mode: 0 for mode in modes}  # drafts its shadow explorations scored (`SpecDecoder.shadow_draft`)
    guesses = {mode: [0, 0] for mode in modes}  # the draft's first guesses right, scored (`FirstGuesses`)
    agree = {mode: 0 for mode in modes}  # requests whose tokens equal plain decoding's
    first_steps = {mode: [] for mode in modes}  # each wave's first step (its prefill), seconds
    later_steps = {mode: [] for mode in modes}  # each wave's later steps' median, seconds
    by_kind = {mode: {kind: [0, 0.0] for kind in STEP_KINDS} for mode in modes}  # engine calls, seconds, by kind
    plain_calls = {mode: [] for mode in modes}  # every plain call's seconds (any of PLAIN_KINDS)
    for w in range(args.waves):
        wave = prompts[w * b : (w + 1) * b]
        for mode in modes if w % 2 == 0 else modes[::-1]:
            engine.set_speculation(mode != "plain")
            engine.spec.policy = policies.get(mode, policies["spec"])
            tag = f"{mode}{w}"
            if mode != "plain" and forced is not None:  # made before the wave: not what speculating costs
                for i, prompt in enumerate(wave):
                    row = engine.spec.forced_row(prompt + continuations[w * b + i])
                    engine.spec.forced_continuations[f"{tag}-{i}"] = row
            stats = engine.spec_stats
            before = (stats.num_verify_steps, stats.num_shadow_drafts, stats.num_first_guesses_right,
                      stats.num_first_guesses)  # fmt: skip
            wall, outputs, steps, kinds = run_wave(engine, wave, params, tag)
            for kind, step in zip(kinds, steps, strict=True):
                by_kind[mode][kind][0] += 1
                by_kind[mode][kind][1] += step
                if kind in PLAIN_KINDS:
                    plain_calls[mode].append(step)
            stats = engine.spec_stats
            seconds[mode].append(wall)
            first_steps[mode].append(steps[0])
            later_steps[mode].append(statistics.median(steps[1:]) if len(steps) > 1 else 0.0)
            verify_steps[mode].append(stats.num_verify_steps - before[0])
            shadow_drafts[mode] += stats.num_shadow_drafts - before[1]
            guesses[mode][0] += stats.num_first_guesses_right - before[2]
            guesses[mode][1] += stats.num_first_guesses - before[3]
            agree[mode] += sum(outputs[f"{tag}-{i}"] == continuations[w * b + i] for i in range(len(wave)))
    engine.spec.policy = policies["spec"]
    plain = seconds["plain"]
    row = {
        "model": args.model, "draft": args.draft, "batch_size": b, "waves": args.waves, "output_len": args.output_len,
        "forced_acceptance": args.forced_acceptance, "plain_s": sum(plain), "wave_seconds": seconds,
        "wave_verify_steps": verify_steps["spec"],
        "verify_steps": sum(verify_steps["spec"]), "shadow_drafts": shadow_drafts["spec"],
        "first_guesses_right_scored": guesses["spec"],
        "first_step_median_s": {mode: statistics.median(v) for mode, v in first_steps.items()},
        "later_step_median_s": {mode: statistics.median(v) for mode, v in later_steps.items()},
        "steps_by_kind": by_kind,
        "plain_call_quantiles_s": {mode: call_quantiles(v) for mode, v in plain_calls.items()},
        "requests_equal_to_plain": agree["spec"],
        "requests": len(prompts),
    }  # fmt: skip
    print(f"{'batch':>5} {'waves':>5} {'run':>11} {'plain s':>8} {'run s':>8} {'speed-up':>9} {'median wave':>11} "
          f"{'95% interval':>15} {'verify steps':>12} {'shadow drafts':>13} {'same as plain':>13}")  # fmt: skip
    for mode, name in (("spec", "speculating"), ("cand", "candidate"), ("kept", "draft kept")):
        if mode not in seconds:
            continue
        runs = seconds[mode]
        low, high = bootstrap_interval(plain, runs)
        median = statistics.median(a / s for a, s in zip(plain, runs, strict=True))
        key = "" if mode == "spec" else f"{mode}_"  # the speculating run's keys unprefixed, as before the third run
        row |= {f"{mode}_s": sum(runs), f"{key}speedup": sum(plain) / sum(runs),
                f"{key}speedup_median_wave": median, f"{key}speedup_ci95": [low, high]}  # fmt: skip
        if mode != "spec":
            row |= {f"{mode}_verify_steps": sum(verify_steps[mode]), f"{mode}_shadow_drafts": shadow_drafts[mode],
                    f"{mode}_first_guesses_right_scored": guesses[mode]}  # fmt: skip
        if mode == "cand":
            row |= {"candidate": args.candidate, "cand_requests_equal_to_plain": agree["cand"]}
        same = f"{agree[mode]}/{len(prompts)}"
        print(f"{b:>5} {args.waves:>5} {name:>11} {sum(plain):>8.3f} {sum(runs):>8.3f} {sum(plain) / sum(runs):>8.3f}x "
              f"{median:>10.3f}x {f'{low:.3f}-{high:.3f}x':>15} {sum(verify_steps[mode]):>12} "
              f"{shadow_drafts[mode]:>13} {same:>13}")  # fmt: skip
    print("first guesses right / scored: " + ", ".join(f"{m} {r}/{n}" for m, (r, n) in guesses.items() if m != "plain"))
    print(
        "median µs, a wave's first step (its prefill) / its later steps' median: "
        + ", ".join(
            f"{m} {row['first_step_median_s'][m] * 1e6:.1f} / {row['later_step_median_s'][m] * 1e6:.1f}" for m in modes
        )
    )
    print("engine calls by kind, count / total ms (a call that launched the next step and resolved one):")
    for mode in modes:
        print(f"  {mode:>5}: " + ", ".join(f"{kind} {n} / {t * 1e3:.1f}" for kind, (n, t) in by_kind[mode].items()))
    print("plain calls (every plain kind), µs: " + ", ".join(
        f"{m} " + " / ".join(f"{q} {v * 1e6:.1f}" for q, v in row["plain_call_quantiles_s"][m].items()) for m in modes
    ))  # fmt: skip
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
