"""The adaptive speculation policy (`AdaptivePolicy`, the engine's own code, or a variant given with --policy)
against a model of step times on a host whose speed changes in stretches: the share of steps each option gets and the
throughput against always decoding plainly and against an oracle that knows every step's times. A CPU-only,
seconds-long way to weigh a change to the policy before spending GPU time on it; its step times are a model, not a
measurement, so there is no roofline.

The model (defaults: the default pair at batch 1 on an H200, session 44): a step launched ahead of the one before
(the same option as the step before: overlap scheduling) takes max(GPU, host) — plain decoding is host-bound, a
verify step waits for the GPU — and a step that starts with the pipeline empty takes GPU + host; only steps launched
ahead are timed for the policy, and a step's time reaches it after the next step was chosen, as in the engine. The
host alternates between stretches at full speed and stretches `--slow-factor` times slower (its share of every step),
their lengths drawn around `--fast-steps` and `--slow-steps` (seeded). Each draft shape accepts `tau - 1` drafts a
step. Every scenario runs once with a steady host and once with the slow stretches, over `--seeds` seeds (means).
One JSON line per scenario with --json.
Usage: python bench/policy_sim.py [--tau 1,1] [--slow-factor 5] [--fast-steps 600] [--slow-steps 20]
       [--policy AdaptivePolicy|ConfirmedSwitchPolicy|module:Class] [--json FILE]
"""

from __future__ import annotations

import argparse
import importlib
import json
import random

from jetserve.engine.speculative import EXPLORE_SAMPLES, MAX_RUN_STEPS, AdaptivePolicy, DraftShape, _Run, batch_bucket

# The default pair on an H200 at batch 1 (session 44): GPU and host ms of a plain step, of a chain-7 and a chain-3
# verify step.
PLAIN = (0.12, 0.25)
SHAPES = ((DraftShape(1, 7, 8), 0.53, 0.30), (DraftShape(1, 3, 4), 0.39, 0.30))


class ConfirmedSwitchPolicy(AdaptivePolicy):
    """A candidate change (session 44; not in the engine, not measured on a GPU): the engine's policy, except that a
    switch of the best option that no exploration made — option Y's estimate now beats the current option X's,
    typically because X's own newest samples rose — is confirmed before it is taken: Y runs until it has
    EXPLORE_SAMPLES more timed steps, then X does, and only then are the options weighed again, on estimates taken a
    few steps apart; Y is taken if it is still the best, and another option that now looks best is confirmed the
    same way. A stall of the host that inflated X's samples then inflates Y's too, or has ended by the time X
    is re-timed. `--policy ConfirmedSwitchPolicy`."""

    def __init__(self, shapes: list[DraftShape], adaptive: bool) -> None:
        super().__init__(shapes, adaptive)
        self.current: dict[int, int] = {}  # bucket → the option the last weighing chose
        self.retime: dict[int, int] = {}  # bucket → the option to re-time once the confirming run ends
        self.candidate: dict[int, int] = {}  # bucket → the option being confirmed (taken if still best after)

    def choose(self, num_seqs: int) -> int:
        if self.forced_option is not None or not self.adaptive:
            return super().choose(num_seqs)
        bucket = batch_bucket(num_seqs)
        step = self.bucket_steps.get(bucket, 0)
        if bucket in self.measured and not self._running(bucket):
            if bucket in self.retime:
                return self._begin(bucket, self.retime.pop(bucket), step)
            current = self.current.get(bucket)
            weighs = self.plain_until.get(bucket, 0) <= step < self.next_explore.get(bucket, step + 1)
            if current is not None and weighs:
                best, candidate = self.best(bucket), self.candidate.pop(bucket, None)
                if best not in (current, candidate):  # a new switch: confirm it (a confirmed one is taken)
                    self.retime[bucket], self.candidate[bucket] = current, best
                    return self._begin(bucket, best, step)
        option = super().choose(num_seqs)
        if bucket in self.measured and not self._running(bucket):
            self.current[bucket] = option
        return option

    def _running(self, bucket: int) -> bool:
        run = self.runs.get(bucket)
        return run is not None and run.num_chosen < MAX_RUN_STEPS and self.num_timed[(run.option, bucket)] < run.until

    def _begin(self, bucket: int, option: int, step: int) -> int:
        """A run of `option` until it has EXPLORE_SAMPLES more timed steps (not an exploration: nothing is judged)."""
        self.bucket_steps[bucket] = step + 1
        self.runs[bucket] = _Run(option, self.num_timed[(option, bucket)] + EXPLORE_SAMPLES, step)
        self.plain_until.pop(bucket, None)
        return option


def host_factors(steps: int, fast: int, slow: int, factor: float, seed: int) -> list[float]:
    """The host's slowness at each step: stretches at 1.0 and at `factor`, lengths 0.5-1.5x `fast` / `slow`."""
    rng = random.Random(seed)
    out: list[float] = []
    is_slow = False
    while len(out) < steps:
        mean = slow if is_slow else fast
        out += [factor if is_slow else 1.0] * max(1, round(mean * rng.uniform(0.5, 1.5)))
        is_slow = not is_slow and factor != 1.0
    return out[:steps]


def step_ms(option: int, host: float, ahead: bool) -> float:
    gpu, host_ms = PLAIN if option < 0 else SHAPES[option][1:]
    return max(gpu, host_ms * host) if ahead else gpu + host_ms * host


def simulate(taus: list[float], factors: list[float], policy_cls: type = AdaptivePolicy, batch: int = 1) -> dict:
    """One run: the policy chooses every step of the host's `factors`; returns the speed-up over plain decoding, the
    oracle's, and each option's share of the steps."""
    policy = policy_cls([shape for shape, _, _ in SHAPES], adaptive=True)
    options = [*range(len(SHAPES)), -1]

    def tau(option: int) -> float:
        return 1.0 if option < 0 else taus[option]

    chosen = [policy.choose(batch)]
    seconds = tokens = oracle_seconds = plain_seconds = 0.0
    for k, host in enumerate(factors):
        chosen.append(policy.choose(batch))  # the next step's choice comes before this step's results
        option = chosen[k]
        if option >= 0:
            policy.record_acceptance(option, [round(tau(option) - 1)] * batch)
        ahead = k > 0 and chosen[k - 1] == option
        ms = step_ms(option, host, ahead)
        if ahead:
            policy.record_step(option, batch, ms / 1e3)
        seconds += ms
        tokens += tau(option)
        plain_seconds += step_ms(-1, host, True) * tau(option)  # plain decoding's time for the same tokens
        best = min(options, key=lambda o: step_ms(o, host, True) / tau(o))
        oracle_seconds += step_ms(best, host, True) / tau(best) * tau(option)
    shares = {("plain" if o < 0 else f"1x{SHAPES[o][0].num_steps}"): chosen[:-1].count(o) / len(factors)
              for o in options}  # fmt: skip
    return {
        "speedup": round(plain_seconds / seconds, 4),
        "oracle_speedup": round(plain_seconds / oracle_seconds, 4),
        "shares": {name: round(share, 4) for name, share in shares.items()},
    }


def load_policy(spec: str) -> type:
    """`module:Class` → the class (an AdaptivePolicy or one with its interface); a bare name is one of this script's
    (`AdaptivePolicy`, `ConfirmedSwitchPolicy`)."""
    if ":" not in spec:
        return {"AdaptivePolicy": AdaptivePolicy, "ConfirmedSwitchPolicy": ConfirmedSwitchPolicy}[spec]
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tau", default="1,1", help="tokens per verify step of chain 7 and chain 3 (1,1: drafts wrong)")
    p.add_argument("--slow-factor", type=float, default=5.0)
    p.add_argument("--fast-steps", type=int, default=600)
    p.add_argument("--slow-steps", type=int, default=20)
    p.add_argument("--steps", type=int, default=20000)
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--policy", default="AdaptivePolicy",
                   help="AdaptivePolicy (the engine's), ConfirmedSwitchPolicy, or module:Class")  # fmt: skip
    p.add_argument("--json", help="append one JSON line per scenario to this file")
    args = p.parse_args()
    taus = [float(t) for t in args.tau.split(",")]
    if len(taus) != len(SHAPES):
        raise SystemExit(f"--tau: give {len(SHAPES)} values (chain 7, chain 3)")
    policy_cls = load_policy(args.policy)
    print(f"{'slow x':>7} {'speed-up':>9} {'oracle':>7} {'plain':>6} {'1x7':>6} {'1x3':>6}")
    for factor in (1.0, args.slow_factor):
        runs = [simulate(taus, host_factors(args.steps, args.fast_steps, args.slow_steps, factor, seed), policy_cls)
                for seed in range(args.seeds)]  # fmt: skip
        mean = {key: sum(r[key] for r in runs) / len(runs) for key in ("speedup", "oracle_speedup")}
        shares = {name: sum(r["shares"][name] for r in runs) / len(runs) for name in runs[0]["shares"]}
        print(f"{factor:>7.2f} {mean['speedup']:>8.3f}x {mean['oracle_speedup']:>6.3f}x {shares['plain']:>6.1%} "
              f"{shares['1x7']:>6.1%} {shares['1x3']:>6.1%}")  # fmt: skip
        if args.json:
            row = {"policy": args.policy, "tau": taus, "slow_factor": factor, "fast_steps": args.fast_steps,
                   "slow_steps": args.slow_steps, "steps": args.steps, "seeds": args.seeds, **mean,
                   "shares": shares}  # fmt: skip
            with open(args.json, "a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
