"""The adaptive speculation policy (`AdaptivePolicy`, the engine's own code, or a variant given with --policy)
against a model of step times on a host whose speed changes in stretches: the share of steps each option gets and the
throughput against always decoding plainly and against an oracle that knows every step's times. A CPU-only,
seconds-long way to weigh a change to the policy before spending GPU time on it; its step times are a model, not a
measurement, so there is no roofline.

The model (defaults: the default pair at batch 1 on an H200, session 44; the plain step's host time session 45's,
after an all-greedy step stopped launching the sampler, `--plain-host-ms` to change it): a step launched ahead of the
one before
(the same option as the step before: overlap scheduling) takes max(GPU, host) — plain decoding is host-bound, a
verify step waits for the GPU — and a step that starts with the pipeline empty takes GPU + host; only steps launched
ahead are timed for the policy, and a step's time reaches it after the next step was chosen, as in the engine. The
host alternates between stretches at full speed and stretches `--slow-factor` times slower (its share of every step),
their lengths drawn around `--fast-steps` and `--slow-steps` (seeded). Each draft shape accepts `tau - 1` drafts a
step on average (whole drafts, dithered so that the mean is exact: session 44's rounding had told the policy 3 where
the model counted 2.5); `--later-tau` changes the τs at the run's midpoint (drafts that start or stop paying: how
fast the policy follows). As in the engine, a chain-7 step's counts also feed chain 3's estimate (min(a, 3)), so give
τs that agree with that, or chain 3's estimate leans towards chain 7's. Every scenario runs once with a steady host
and once with the slow stretches, over `--seeds` seeds (means).
One JSON line per scenario with --json.
Usage: python bench/policy_sim.py [--tau 1,1] [--slow-factor 5] [--fast-steps 600] [--slow-steps 20]
       [--plain-host-ms 0.15] [--later-tau 5.2,3.4] [--accept-rate 0,0.8]
       [--policy AdaptivePolicy|ConfirmedSwitchPolicy|FreshExplorationPolicy|VerifiedExplorationPolicy|module:Class]
       [--shadow [--shadow-host-ms MS]] [--first-guesses [--request-len N]]
       [--json FILE]
"""

from __future__ import annotations

import argparse
import collections
import importlib
import json
import math
import random

from jetserve.engine.speculative import EXPLORE_SAMPLES, MAX_RUN_STEPS, AdaptivePolicy, DraftShape, _Run, batch_bucket

# The default pair on an H200 at batch 1: GPU and host ms of a plain step (the host's since session 45: its step's
# median 0.153 ms, where it was 0.25 while an all-greedy step launched the sampler from Python), of a chain-7 and a
# chain-3 verify step (session 44).
PLAIN = (0.12, 0.15)
SHAPES = ((DraftShape(1, 7, 8), 0.53, 0.30), (DraftShape(1, 3, 4), 0.39, 0.30))
# GPU ms of each shape's draft graph alone at batch 1 (session 46, replayed back to back): what a shadow exploration
# (`--shadow`) adds to the plain step it rides on
DRAFT_GPU_MS = (0.195, 0.074)
RING = 128  # `--first-guesses`: positions a catch-up scores, every this many steps (the default feature ring)


class ConfirmedSwitchPolicy(AdaptivePolicy):
    """A candidate change (session 44; not in the engine, not measured on a GPU): the engine's policy, except that a
    switch of the best option that no exploration made — option Y's estimate now beats the current option X's,
    typically because X's own newest samples rose — is confirmed before it is taken: Y runs until it has
    EXPLORE_SAMPLES more timed steps, then X does, and only then are the options weighed again, on estimates taken a
    few steps apart; Y is taken if it is still the best, and another option that now looks best is confirmed the
    same way. A stall of the host that inflated X's samples then inflates Y's too, or has ended by the time X
    is re-timed. `--policy ConfirmedSwitchPolicy`."""

    settled_fast_path = False  # its `choose` reads the step counts and `plain_until` before the base class's

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


class VerifiedExplorationPolicy(AdaptivePolicy):
    """The engine's policy before session 55: every exploration verifies, none runs in shadow (`shadows`). The
    baseline `bench/spec_overhead.py --candidate` runs beside the engine's shadow explorations."""

    def shadows(self, option: int, bucket: int) -> bool:
        return False


class FreshExplorationPolicy(AdaptivePolicy):
    """A candidate change (session 45; measured on an H100 in session 55, no better: batch 1 0.984x against the
    engine's 0.980x, batch 8 0.943x against 0.957x, drafts forced wrong): the engine's policy with explorations
    up to 4,096 steps apart (where it stops at 1,024), and a draft shape's acceptance window restarted when an
    exploration of it begins, so that the exploration's own drafts judge it. With the longer interval alone a draft
    that starts to pay is found late: the window's 64 drafts take an exploration's 6 steps at batch 1 as a tenth of
    their mean. `--policy FreshExplorationPolicy`."""

    max_explore_every = 4096

    def _start_run(self, bucket: int, option: int, step: int, until: int, best_before: int | None = None) -> int:
        if best_before is not None and option >= 0:  # an exploration of a draft shape
            self.recent_accepted[option] = collections.deque()
            self.accepted_totals[option] = [0, 0, 0]
        return super()._start_run(bucket, option, step, until, best_before)


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


def step_ms(
    option: int, host: float, ahead: bool, plain: tuple[float, float] = PLAIN, shadow: bool = False,
    shadow_host_ms: float = 0.0,
) -> float:  # fmt: skip
    """A step's ms; `shadow`: a plain step that also runs `option`'s draft graph (a shadow exploration), and
    `shadow_host_ms` more of host time (its catch-up's and draft's launches, the trees' read-back)."""
    gpu, host_ms = plain if option < 0 or shadow else SHAPES[option][1:]
    if shadow:
        gpu += DRAFT_GPU_MS[option]
        host_ms += shadow_host_ms
    return max(gpu, host_ms * host) if ahead else gpu + host_ms * host


def simulate(
    taus: list[float], factors: list[float], policy_cls: type = AdaptivePolicy, batch: int = 1,
    plain: tuple[float, float] = PLAIN, later_taus: list[float] | None = None, accept_rates: list[float] | None = None,
    seed: int = 0, shadow: bool = False, first_guesses: bool = False, request_len: int | None = None,
    shadow_host_ms: float = 0.0,
) -> dict:  # fmt: skip
    """One run: the policy chooses every step of the host's `factors`; returns the speed-up over plain decoding, the
    oracle's, and each option's share of the steps. `plain`: (GPU, host) ms of a plain step; `later_taus`: the
    shapes' τ from the run's midpoint on (drafts that start or stop paying), `taus` before it.

    With `accept_rates` ([before, after the midpoint]) acceptance is drawn instead: each draft depth is accepted with
    that probability if the one above it was (a chain draft's acceptance falls geometrically with depth, as measured),
    one draw a step shared by the shapes, so a chain of 3 accepts min(a, 3) where the chain of 7 accepts a — as the
    policy assumes — and a step yields its own draw's tokens. The oracle then knows each option's mean τ.

    `shadow` models the engine's shadow explorations (`AdaptivePolicy.shadows`, `SpecDecoder.shadow_draft`): an
    exploration of a draft shape begun while plain decoding is the best option, of a shape estimated well below
    plain decoding's rate, runs as plain steps that also draft, unverified — the drafts are compared with the tokens
    plain decoding then emits (exact for greedy requests) — so a step costs a plain step plus the draft graph and
    yields one token; the policy gets the acceptance the drafts would have had (here at once, in the engine a
    shape's depth in steps later) and counts the step at the shape's median time (`record_shadow_step`). The
    draft's catch-up that each shadow step also runs, its launches and the trees' read-back are `shadow_host_ms` of
    host time (default 0: session 58 measured a shadow step's engine call at 0.597 ms against a plain call's 0.143 on
    an H100, so ~0.3 beyond the draft graph; with 0, this model gave shadows a 1% lead over verified explorations where
    session 55 measured parity); the first step of such a run is charged as one
    started with the pipeline empty, as a switch of option is (the engine's keeps the pipeline running): a
    pessimistic simplification.

    `first_guesses` hands the policy the draft's first guesses every RING steps, RING of them, each right with
    probability P(a ≥ 1) at that step's acceptance (`--accept-rate`: the rate; `--tau`: the geometric rate whose
    chain of 3 yields its τ), as the engine's catch-ups score them (`AdaptivePolicy.record_first_guesses`); their
    cost (the draft's top token at each caught-up position) is not modelled. With `request_len` the guesses come as
    the engine's catch-ups bring them in requests of that many tokens: a verify or shadow step catches up (and
    scores) the positions its request's plain steps left since the last catch-up, a ring's worth of them is caught
    up when it fills, and a new request starts with none (its prompt's catch-up scores nothing); so requests shorter
    than RING score guesses only through explorations."""
    policy = policy_cls([shape for shape, _, _ in SHAPES], adaptive=True)
    options = [*range(len(SHAPES)), -1]
    depths = [shape.max_depth for shape, _, _ in SHAPES]
    rng = random.Random(seed)

    def mean_taus(rate: float) -> list[float]:  # 1 + E[min(a, D)] = 1 + rate + rate² + ... + rate^D
        return [1.0 + sum(rate**d for d in range(1, depth + 1)) for depth in depths]

    rates = [1.0, *(taus if accept_rates is None else mean_taus(accept_rates[0]))]  # mean tokens a step, plain first

    def tau(option: int) -> float:
        return rates[option + 1]

    chosen = [policy.choose(batch)]
    seconds = tokens = oracle_seconds = plain_seconds = 0.0
    drafted = [0.0] * len(SHAPES)  # per option: accepted drafts owed so far (τ - 1 a step), of which...
    handed = [0] * len(SHAPES)  # ... whole ones reported to the policy
    missed = produced = 0  # `request_len`: positions since the draft's last catch-up, tokens of the request so far
    for k, host in enumerate(factors):
        if k == len(factors) // 2:
            if accept_rates is not None:
                rates[1:] = mean_taus(accept_rates[1])
            elif later_taus is not None:
                rates[1:] = later_taus
        if request_len is None:
            scored = RING if first_guesses and k % RING == RING - 1 else 0
        else:
            scored = missed if first_guesses and (chosen[k] >= 0 or missed >= RING) else 0
            missed -= scored
        if scored:
            rate = accept_rates[k >= len(factors) // 2] if accept_rates is not None else first_guess_rate(rates[2])
            policy.record_first_guesses(sum(rng.random() < rate for _ in range(scored)), scored)
        shadowed = shadow and chosen[k] >= 0 and policy.shadows(chosen[k], batch_bucket(batch))
        chosen.append(policy.choose(batch))  # the next step's choice comes before this step's results
        option = chosen[k]
        step_tokens = tau(option)
        if option >= 0:
            if accept_rates is None:
                drafted[option] += tau(option) - 1
                accepted = math.floor(drafted[option] + 1e-9) - handed[option]
                handed[option] += accepted
            else:
                rate = accept_rates[k >= len(factors) // 2]
                accepted = 0
                while accepted < depths[option] and rng.random() < rate:
                    accepted += 1
                step_tokens = 1.0 + accepted
            policy.record_acceptance(option, [accepted] * batch)
        ahead = k > 0 and chosen[k - 1] == option
        if shadowed:  # what runs instead: a plain step and the draft, one token, timed at the shape's median
            ms, step_tokens = step_ms(option, host, ahead, plain, shadow=True, shadow_host_ms=shadow_host_ms), 1.0
            policy.record_shadow_step(option, batch)
        else:
            ms = step_ms(option, host, ahead, plain)
            if ahead:
                policy.record_step(option, batch, ms / 1e3)
        seconds += ms
        tokens += step_tokens
        if request_len is not None:
            missed += 1 if option < 0 or shadowed else 0  # a verify step's draft catches up on what it accepted
            produced += step_tokens
            if produced >= request_len:  # the next request: its prompt's catch-up leaves nothing missed
                missed = produced = 0
        plain_seconds += step_ms(-1, host, True, plain) * step_tokens  # plain decoding's time for the same tokens
        best = min(options, key=lambda o: step_ms(o, host, True, plain) / tau(o))
        oracle_seconds += step_ms(best, host, True, plain) / tau(best) * step_tokens
    shares = {("plain" if o < 0 else f"1x{SHAPES[o][0].num_steps}"): chosen[:-1].count(o) / len(factors)
              for o in options}  # fmt: skip
    return {
        "speedup": round(plain_seconds / seconds, 4),
        "oracle_speedup": round(plain_seconds / oracle_seconds, 4),
        "shares": {name: round(share, 4) for name, share in shares.items()},
    }


def first_guess_rate(tau: float, depth: int = 3) -> float:
    """The per-depth acceptance r of a geometric chain of `depth` whose τ is `tau` (1 + r + r² + … + r^depth = τ):
    the share of first guesses right that `--first-guesses` hands the policy under `--tau`."""
    low, high = 0.0, 1.0
    for _ in range(50):
        mid = (low + high) / 2
        low, high = (mid, high) if 1.0 + sum(mid**d for d in range(1, depth + 1)) < tau else (low, mid)
    return low


def load_policy(spec: str) -> type:
    """`module:Class` → the class (an AdaptivePolicy or one with its interface); a bare name is one of this script's
    (`AdaptivePolicy`, the candidates `ConfirmedSwitchPolicy` and `FreshExplorationPolicy`, and the engine's policy
    without shadow explorations, `VerifiedExplorationPolicy`; session 45's
    `BoundedExplorationPolicy` became the engine's `AdaptivePolicy.cannot_win` in session 48)."""
    if ":" not in spec:
        return {
            "AdaptivePolicy": AdaptivePolicy,
            "ConfirmedSwitchPolicy": ConfirmedSwitchPolicy,
            "FreshExplorationPolicy": FreshExplorationPolicy,
            "VerifiedExplorationPolicy": VerifiedExplorationPolicy,
        }[spec]
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
    p.add_argument("--plain-host-ms", type=float, default=PLAIN[1], help="host ms of a plain step (GPU: 0.12)")
    p.add_argument("--later-tau", help="chain 7's and chain 3's τ from the run's midpoint on (default: --tau's)")
    p.add_argument("--accept-rate", help="R or R,R_LATER: draw acceptance, each depth accepted with probability R "
                   "if the one above was (instead of --tau; R_LATER from the run's midpoint on)")  # fmt: skip
    p.add_argument("--policy", default="AdaptivePolicy",
                   help="AdaptivePolicy (the engine's), ConfirmedSwitchPolicy, FreshExplorationPolicy, "
                   "or module:Class")  # fmt: skip
    p.add_argument("--shadow", action="store_true", help="explorations begun while plain is best run as plain steps "
                   "that also draft, unverified (the engine's shadow explorations; see `simulate`)")  # fmt: skip
    p.add_argument("--shadow-host-ms", type=float, default=0.0, help="with --shadow: host ms a shadow step costs "
                   "beyond a plain step and its draft graph (catch-up, launches, read-back; ~0.3: H100)")  # fmt: skip
    p.add_argument("--first-guesses", action="store_true", help="the draft's first guesses scored every RING steps "
                   "(`AdaptivePolicy.record_first_guesses`; see `simulate`)")  # fmt: skip
    p.add_argument(
        "--request-len",
        type=int,
        help="with --first-guesses: requests of this many tokens, whose "
        "catch-ups alone score guesses (see `simulate`); default: a ring's catch-up every RING steps",
    )
    p.add_argument("--json", help="append one JSON line per scenario to this file")
    args = p.parse_args()
    if args.request_len is not None and (args.request_len < 1 or not args.first_guesses):
        p.error("--request-len: a positive count of tokens, with --first-guesses")
    if args.shadow_host_ms < 0 or (args.shadow_host_ms and not args.shadow):
        p.error("--shadow-host-ms: a non-negative ms, with --shadow")
    taus = [float(t) for t in args.tau.split(",")]
    later = [float(t) for t in args.later_tau.split(",")] if args.later_tau else None
    accept_rates = None
    if args.accept_rate:
        accept_rates = [float(r) for r in args.accept_rate.split(",")]
        accept_rates = (accept_rates * 2)[:2]
    if len(taus) != len(SHAPES) or (later is not None and len(later) != len(SHAPES)):
        raise SystemExit(f"--tau, --later-tau: give {len(SHAPES)} values (chain 7, chain 3)")
    policy_cls = load_policy(args.policy)
    print(f"{'slow x':>7} {'speed-up':>9} {'oracle':>7} {'plain':>6} {'1x7':>6} {'1x3':>6}")
    for factor in (1.0, args.slow_factor):
        factors = [host_factors(args.steps, args.fast_steps, args.slow_steps, factor, seed)
                   for seed in range(args.seeds)]  # fmt: skip
        plain = (PLAIN[0], args.plain_host_ms)
        runs = [simulate(taus, f, policy_cls, plain=plain, later_taus=later, accept_rates=accept_rates, seed=seed,
                         shadow=args.shadow, first_guesses=args.first_guesses, request_len=args.request_len,
                         shadow_host_ms=args.shadow_host_ms)
                for seed, f in enumerate(factors)]  # fmt: skip
        mean = {key: sum(r[key] for r in runs) / len(runs) for key in ("speedup", "oracle_speedup")}
        shares = {name: sum(r["shares"][name] for r in runs) / len(runs) for name in runs[0]["shares"]}
        print(f"{factor:>7.2f} {mean['speedup']:>8.3f}x {mean['oracle_speedup']:>6.3f}x {shares['plain']:>6.1%} "
              f"{shares['1x7']:>6.1%} {shares['1x3']:>6.1%}")  # fmt: skip
        if args.json:
            row = {"policy": args.policy, "shadow": args.shadow, "first_guesses": args.first_guesses,
                   "request_len": args.request_len, "shadow_host_ms": args.shadow_host_ms, "tau": taus,
                   "later_tau": later,
                   "accept_rate": accept_rates,
                   "plain_host_ms": args.plain_host_ms,
                   "slow_factor": factor,
                   "fast_steps": args.fast_steps,
                   "slow_steps": args.slow_steps, "steps": args.steps, "seeds": args.seeds, **mean,
                   "shares": shares}  # fmt: skip
            with open(args.json, "a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
