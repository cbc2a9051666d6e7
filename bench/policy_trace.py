"""What the adaptive speculation policy chose, and from which timings: the default model and its draft on MT-bench
first turns (at most the batch size at a time, each to its end of turn), every choice of the policy and every step
time it recorded, summed up per option: the share of choices, the timed steps (count, median, 10th and 90th
percentiles), the longest run of choices, and how often the best option (by the policy's own estimate after each
timed step) changed; beside it, the speed-up over a plain run of the same requests. `--policies` A/Bs policies in
one process: each round runs plain decoding and each policy once, in an order that rotates from round to round (the
GPU machine's host changes speed between stretches of a few seconds: session 48 measured 0.79x and 1.12x for a policy
that always answers plain, one round each). Each policy is one instance for all rounds, in place of the engine's
while it runs, as an engine keeps its own (`--fresh-policy`: a new one each round, every bucket measured afresh):
`AdaptivePolicy`, the engine's; `ConfirmedSwitchPolicy` or `FreshExplorationPolicy`, bench/policy_sim.py's
candidates; or module:Class. The speed-up is over all rounds (decode tokens over decode-step
seconds, each against plain's); the median and spread of the rounds' own speed-ups beside it.
`--forced-acceptance wrong` makes every draft wrong (τ = 1), where a verify step should only be chosen to explore;
`right` makes every draft right. Runs on a GPU (bf16, CUDA graphs, overlap scheduling: what `jetserve bench offline`
measures) or, slowly, on the CPU (fp32). There is no roofline: the figures are the policy's choices and the
host-timed steps it judged from. One JSON line per batch size and policy with --json.
Usage: python bench/policy_trace.py [--batch-sizes 1,8] [--forced-acceptance wrong] [--num-prompts 80]
       [--output-len 128] [--policies AdaptivePolicy,ConfirmedSwitchPolicy] [--rounds 2] [--fresh-policy]
       [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from policy_sim import load_policy

from jetserve.assets import DEFAULT_DRAFT, DEFAULT_MODEL
from jetserve.engine.bench_offline import _run, bench_prompts
from jetserve.engine.config import EngineConfig
from jetserve.engine.engine import LLMEngine
from jetserve.engine.speculative import AdaptivePolicy, batch_bucket
from jetserve.sampling_params import SamplingParams


class PolicyTrace:
    """Wraps a policy: every call to it, in order, with what `choose` answered; `events` are its choices (the option)
    and recorded step times (option, seconds). After the run, `best_after_timing` replays the calls into a fresh
    instance of the policy's class (the policy is deterministic in its calls) for the option it judged best for the
    bucket after each recorded time: computing that inside the steps cost ~15 µs of host time a step (a median and the
    weighing), which the host-bound default pair paid on every step of the speculating runs only (session 48: an
    always-plain policy at 0.86x of plain decoding)."""

    def __init__(self, policy: AdaptivePolicy) -> None:
        self.policy = policy
        self.calls: list[tuple[str, tuple, int | None]] = []  # (method name, its arguments, what choose answered)
        for name in ("choose", "record_step", "record_acceptance"):
            setattr(policy, name, self._traced(name, getattr(policy, name)))

    def _traced(self, name: str, method):
        def traced(*args):
            result = method(*args)
            self.calls.append((name, args, result))
            return result

        return traced

    @property
    def events(self) -> list[tuple[str, int, float]]:
        """("choose", option, 0) / ("timed", option, seconds), in order."""
        return [("choose", result, 0.0) if name == "choose" else ("timed", args[0], args[2])
                for name, args, result in self.calls if name != "record_acceptance"]  # fmt: skip

    @property
    def best_after_timing(self) -> list[int]:
        cls = type(self.policy)
        replay = cls(self.policy.shapes, self.policy.adaptive)
        best = []
        for name, args, result in self.calls:
            if getattr(replay, name)(*args) != result:
                raise RuntimeError(f"{cls.__name__} chose differently when replayed: it is not deterministic")
            if name == "record_step":
                best.append(replay.best(batch_bucket(args[1])))
        return best


def summarize(traces: list[PolicyTrace], names: dict[int, str]) -> dict:
    """The choices and timed steps of `traces` (runs of one policy) per option; best-option changes within each run."""
    events = [event for trace in traces for event in trace.events]
    chosen = [option for kind, option, _ in events if kind == "choose"]
    options = sorted(set(chosen) | {o for kind, o, _ in events if kind == "timed"}, reverse=True)
    rows = {}
    for option in options:
        times = sorted(1e3 * s for kind, o, s in events if kind == "timed" and o == option)
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
    flips = 0
    for trace in traces:
        best = trace.best_after_timing
        flips += sum(a != b for a, b in zip(best, best[1:], strict=False))
    return {"choices": len(chosen), "best_changes": flips, "options": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--forced-acceptance", choices=["right", "wrong"], default=None)
    p.add_argument("--num-prompts", type=int, default=80)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--policies", default="AdaptivePolicy", help="comma-separated: AdaptivePolicy, "
                   "ConfirmedSwitchPolicy, FreshExplorationPolicy, module:Class")  # fmt: skip
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--fresh-policy", action="store_true", help="a new policy instance each round")
    p.add_argument("--json", help="append one JSON line per batch size and policy to this file")
    args = p.parse_args()
    if args.rounds < 1:
        p.error(f"--rounds: must be at least 1, got {args.rounds}")
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    policies = {name: load_policy(name) for name in args.policies.split(",")}
    cuda = torch.cuda.is_available()
    config = EngineConfig(model=str(DEFAULT_MODEL), draft=str(DEFAULT_DRAFT), dtype="bfloat16" if cuda else "float32",
                          device="auto", max_num_seqs=max(batch_sizes), num_pages=4096,
                          num_slots=max(batch_sizes) + 2)  # fmt: skip
    engine = LLMEngine(config, forced_acceptance=args.forced_acceptance)
    spec = engine.spec
    names = {-1: "plain", **{i: f"{s.topk}x{s.num_steps}x{s.num_draft_tokens}" for i, s in enumerate(spec.shapes)}}
    params = SamplingParams(temperature=0, max_tokens=args.output_len)
    header = (f"{'batch':>5} {'policy':>22} {'option':>8} {'share':>6} {'timed':>6} {'median ms':>10} {'p10':>7} "
              f"{'p90':>7} {'longest run':>12}")  # fmt: skip
    for batch_size in batch_sizes:
        prompts = bench_prompts(engine, "mtbench", batch_size, 4096, 0, args.num_prompts)
        # The drafts' reference (forced acceptance): the greedy continuation of each prompt, from a plain run first.
        engine.set_speculation(False)
        reference = _run(engine, prompts, params, f"reference{batch_size}", batch_size).outputs
        totals = {name: [[], []] for name in ["plain", *policies]}  # name → per round: decode tokens, seconds
        traces = {name: [] for name in policies}  # name → one PolicyTrace per instance
        instances: dict[str, AdaptivePolicy] = {}
        for r in range(args.rounds):
            order = ["plain", *policies]
            for name in order[r % len(order) :] + order[: r % len(order)]:
                label = f"{name}{batch_size}-{r}"
                engine.set_speculation(name != "plain")
                if name != "plain":
                    for i, (prompt, out) in enumerate(zip(prompts, reference, strict=True)):
                        spec.forced_continuations[f"{label}-{i}"] = prompt + out
                    if args.fresh_policy or name not in instances:
                        instances[name] = policies[name](spec.shapes, engine.config.spec_adaptive)
                        traces[name].append(PolicyTrace(instances[name]))
                    spec.policy = instances[name]
                run = _run(engine, prompts, params, label, batch_size)
                totals[name][0].append(run.decode_tokens)
                totals[name][1].append(sum(run.decode_step_seconds))
        print(header)
        plain_tokens, plain_seconds = totals["plain"]
        plain_rates = [t / max(s, 1e-12) for t, s in zip(plain_tokens, plain_seconds, strict=True)]
        plain_tok_s = sum(plain_tokens) / max(sum(plain_seconds), 1e-12)
        for name in policies:
            tokens, seconds = totals[name]
            speedup = sum(tokens) / max(sum(seconds), 1e-12) / plain_tok_s if plain_tok_s > 0 else None
            per_round = sorted(t / max(s, 1e-12) / p for t, s, p in zip(tokens, seconds, plain_rates, strict=True))
            summary = {"batch_size": batch_size, "policy": name, "forced": args.forced_acceptance,
                       "rounds": args.rounds, "fresh_policy": args.fresh_policy,
                       "speedup": round(speedup, 4) if speedup else None,
                       "round_speedups": [round(x, 4) for x in per_round],
                       "plain_ms_per_token": round(1e3 / plain_tok_s, 4) if plain_tok_s > 0 else None,
                       **summarize(traces[name], names)}  # fmt: skip
            for option, row in summary["options"].items():
                cells = [f"{row[k]:.3f}" if row[k] is not None else "-" for k in ("median_ms", "p10_ms", "p90_ms")]
                print(f"{batch_size:>5} {name:>22} {option:>8} {row['share']:>6.1%} {row['timed']:>6} {cells[0]:>10} "
                      f"{cells[1]:>7} {cells[2]:>7} {row['longest_run']:>12}")  # fmt: skip
            print(
                f"{batch_size:>5} {name:>22}: speed-up {summary['speedup']}x over plain decoding (rounds: median "
                f"{statistics.median(per_round):.3f}x, {per_round[0]:.3f}-{per_round[-1]:.3f}x; plain "
                f"{summary['plain_ms_per_token']} ms a token), {summary['choices']} choices, the best option changed "
                f"{summary['best_changes']} times"
            )
            if args.json:
                with open(args.json, "a") as f:
                    f.write(json.dumps(summary) + "\n")


if __name__ == "__main__":
    main()
