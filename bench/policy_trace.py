"""What the adaptive speculation policy chose, and from which timings: the default model and its draft on MT-bench
first turns (one run per batch size, at most the batch size at a time, each to its end of turn), every choice of the
policy and every step time it recorded, summed up per option: the share of choices, the timed steps (count, median,
10th and 90th percentiles), the longest run of choices, and how often the best option (by the policy's own estimate
after each timed step) changed. `--forced-acceptance wrong` makes every draft wrong (τ = 1), where a verify step
should only be chosen to explore; `right` makes every draft right. Runs on a GPU (bf16, CUDA graphs, overlap
scheduling: what `jetserve bench offline` measures) or, slowly, on the CPU (fp32). There is no roofline: the figures
are the policy's choices and the host-timed steps it judged from. One JSON line per batch size with --json.
Usage: python bench/policy_trace.py [--batch-sizes 1,8] [--forced-acceptance wrong] [--num-prompts 80]
       [--output-len 128] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from jetserve.assets import DEFAULT_DRAFT, DEFAULT_MODEL
from jetserve.engine.bench_offline import _run, bench_prompts
from jetserve.engine.config import EngineConfig
from jetserve.engine.engine import LLMEngine
from jetserve.engine.speculative import batch_bucket
from jetserve.sampling_params import SamplingParams


class PolicyTrace:
    """Wraps an engine's policy: each choice (the option) and each recorded step time (option, seconds), in order,
    and after each recorded time the option the policy would now judge best for the bucket."""

    def __init__(self, engine: LLMEngine) -> None:
        self.policy = engine.spec.policy
        self.events: list[tuple[str, int, float]] = []  # ("choose", option, 0) / ("timed", option, seconds)
        self.best_after_timing: list[int] = []
        choose, record = self.policy.choose, self.policy.record_step

        def traced_choose(num_seqs: int) -> int:
            option = choose(num_seqs)
            self.events.append(("choose", option, 0.0))
            return option

        def traced_record(option: int, num_seqs: int, seconds: float) -> None:
            record(option, num_seqs, seconds)
            self.events.append(("timed", option, seconds))
            self.best_after_timing.append(self.policy.best(batch_bucket(num_seqs)))

        self.policy.choose, self.policy.record_step = traced_choose, traced_record

    def clear(self) -> None:
        self.events.clear()
        self.best_after_timing.clear()

    def summary(self, names: dict[int, str]) -> dict:
        chosen = [option for kind, option, _ in self.events if kind == "choose"]
        options = sorted(set(chosen) | {o for kind, o, _ in self.events if kind == "timed"}, reverse=True)
        rows = {}
        for option in options:
            times = sorted(1e3 * s for kind, o, s in self.events if kind == "timed" and o == option)
            longest = run = 0
            for c in chosen:
                run = run + 1 if c == option else 0
                longest = max(longest, run)
            rows[names.get(option, str(option))] = {
                "share": round(chosen.count(option) / max(len(chosen), 1), 4),
                "timed": len(times),
                "median_ms": round(statistics.median(times), 4) if times else None,
                "p10_ms": round(times[len(times) // 10], 4) if times else None,
                "p90_ms": round(times[(9 * len(times)) // 10], 4) if times else None,
                "longest_run": longest,
            }
        flips = sum(a != b for a, b in zip(self.best_after_timing, self.best_after_timing[1:], strict=False))
        return {"choices": len(chosen), "best_changes": flips, "options": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--forced-acceptance", choices=["right", "wrong"], default=None)
    p.add_argument("--num-prompts", type=int, default=80)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--json", help="append one JSON line per batch size to this file")
    args = p.parse_args()
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    cuda = torch.cuda.is_available()
    config = EngineConfig(model=str(DEFAULT_MODEL), draft=str(DEFAULT_DRAFT), dtype="bfloat16" if cuda else "float32",
                          device="auto", max_num_seqs=max(batch_sizes), num_pages=4096,
                          num_slots=max(batch_sizes) + 2)  # fmt: skip
    engine = LLMEngine(config, forced_acceptance=args.forced_acceptance)
    names = {
        -1: "plain",
        **{i: f"{s.topk}x{s.num_steps}x{s.num_draft_tokens}" for i, s in enumerate(engine.spec.shapes)},
    }
    trace = PolicyTrace(engine)
    params = SamplingParams(temperature=0, max_tokens=args.output_len)
    header = (f"{'batch':>5} {'option':>8} {'share':>6} {'timed':>6} {'median ms':>10} {'p10':>7} {'p90':>7} "
              f"{'longest run':>12}")  # fmt: skip
    for batch_size in batch_sizes:
        prompts = bench_prompts(engine, "mtbench", batch_size, 4096, 0, args.num_prompts)
        label = f"trace{batch_size}"
        if args.forced_acceptance is not None:  # the drafts' reference: the plain greedy continuation of each prompt
            engine.set_speculation(False)
            plain = _run(engine, prompts, params, f"plain{batch_size}", batch_size).outputs
            engine.set_speculation(True)
            for i, (prompt, out) in enumerate(zip(prompts, plain, strict=True)):
                engine.spec.forced_continuations[f"{label}-{i}"] = prompt + out
        trace.clear()
        _run(engine, prompts, params, label, batch_size)
        summary = {"batch_size": batch_size, "forced": args.forced_acceptance, **trace.summary(names)}
        print(header)
        for name, row in summary["options"].items():
            cells = [f"{row[k]:.3f}" if row[k] is not None else "-" for k in ("median_ms", "p10_ms", "p90_ms")]
            print(f"{batch_size:>5} {name:>8} {row['share']:>6.1%} {row['timed']:>6} {cells[0]:>10} {cells[1]:>7} "
                  f"{cells[2]:>7} {row['longest_run']:>12}")  # fmt: skip
        print(f"{batch_size:>5} {summary['choices']} choices, the best option changed {summary['best_changes']} times")
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(summary) + "\n")


if __name__ == "__main__":
    main()
