"""SpecDecoder: EAGLE-3 speculative decoding inside the engine — the draft's K/V pages and per-slot hidden state, its
catch-up after prefill steps and (deferred) after plain decode steps, the VERIFY step (draft tree → target verify →
commit → catch-up), the adaptive choice of tree size per step, and the counters the server and the benchmark read."""

from __future__ import annotations

import collections
import itertools
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from jetserve.engine.config import max_tree_nodes
from jetserve.engine.host_copy import HostCopy, start_host_copy
from jetserve.engine.sequence import Sequence
from jetserve.model.forward_batch import ForwardBatch
from jetserve.ops.feature_ring import store_features
from jetserve.spec.drafter import Drafter, DraftKV
from jetserve.spec.eagle3 import Eagle3DraftModel
from jetserve.spec.tree import DraftTree
from jetserve.spec.verifier import SamplingRows, Verifier, next_tree_inputs

if TYPE_CHECKING:
    from jetserve.engine.model_runner import ModelRunner

# Forced acceptance (benchmarks): the drafts are each request's known continuation ("right": checked by the target as
# any draft; "all": taken without the target's say, as exact arithmetic would take a right draft) or never it ("wrong").
FORCED_MODES = ("right", "all", "wrong")
# An option's step time is the median of its last TIME_SAMPLES timed steps in a bucket: one slow step (a kernel
# compiled on first use, a plain step that flushed the draft's full catch-up ring) must not flip the choice for the
# dozens of steps an average would take to forget it.
TIME_SAMPLES = 9
# An option is judged from at least MIN_SAMPLES timed steps, and an exploration runs an option until it has
# EXPLORE_SAMPLES more: more than half of TIME_SAMPLES, so the newest run of an option decides its median. (Session
# 41: a draft shape judged from one step, the first verify step after a plain stretch, lost to plain decoding at
# batch 1 and 8 of MT-bench, 3.9% and 0.35% of steps verified, where verifying every step was 1.68x and 1.52x
# faster. Session 42: runs of 3 steps and medians of 5 still chose plain decoding for 67% of batch 1's steps, 1.36-
# 1.44x against 1.58x: the GPU machine's host makes step times vary 1.5x between stretches of a few seconds.) Steps
# that do not show an option's steady state are not timed: a plain step that starts with the pipeline empty (the
# engine's `step`) and a verify step that first catches the draft up on a plain stretch
# (`SpecDecoder.verify_caught_up`); so an option may run a step more than it is timed.
MIN_SAMPLES = 5
EXPLORE_SAMPLES = 5
# An option chosen this many times while it still lacks its samples is judged on what it has (a tree that never
# fits the free pages, or whose steps are never timed, must not hold the choice forever); one with none at all is
# left out of the comparison until an exploration times it.
MAX_RUN_STEPS = 3 * EXPLORE_SAMPLES
# Acceptance is the mean over an option's verify steps of its last ACCEPT_WINDOW_DRAFTS drafts (one a sequence a
# step): accepted drafts / drafts. An exponential moving average weighted 0.05 for the newest step, seeded by the
# first, kept a first step that accepted every draft (MT-bench answers open with predictable tokens) for dozens of
# steps (session 18: 25% verify steps at batch 8, 0.67x). A window of the last 8 verify steps holds 8 drafts at batch
# 1, where one draft's accepted count spreads widely: for the default pair's chain of 7 (acceptance by depth 0.58 /
# 0.41 / 0.30 / 0.22 / 0.17 / 0.13 / 0.10, session 41) its mean is 1.9 and its standard deviation 2.3, so the mean of
# 8 wanders by ±0.8 — across the break-even τ, handing the bucket to plain decoding until its next exploration — and
# the mean of 64 by ±0.3.
ACCEPT_WINDOW_DRAFTS = 64
# A chain's bound from a shorter chain (`AdaptivePolicy.cannot_win`) is the larger of two: from the acceptance window
# above and from the shorter chain's newest BOUND_NEWEST_STEPS verify steps, so that drafts that start to pay lift it
# at the exploration that first sees them, not once they fill most of the window. (policy_sim, acceptance turning from
# 0 to 0.9 per depth halfway, steady host: the window alone kept the chain of 7 ruled out, 1.02x against the old
# policy's 1.13x.)
BOUND_NEWEST_STEPS = 8
# The draft's first guesses: each catch-up forward (`SpecDecoder.flush`) also takes the draft's top token at every
# position it catches up on — exactly the first draft a chain grown from the next position would hold — and the
# engine scores it against the token plain decoding emitted there. A chain of depth D accepts on average at most
# D · P(first guess right) drafts, so over the last FIRST_GUESS_WINDOW scored positions that rate (Hoeffding's bound
# at EXPLORE_STOP_RISK) bounds every chain without verifying any (`AdaptivePolicy.cannot_win`).
FIRST_GUESS_WINDOW = 512
# ... and only guesses scored within the last FIRST_GUESS_MAX_AGE steps (all buckets) count. Requests shorter than
# the feature ring never fill it, so their guesses come only from the catch-ups of verify and shadow steps, which the
# guesses themselves stop once they rule every chain out: an old window would keep them out for good, though the
# drafts may have begun to pay (`bench/policy_sim.py --first-guesses --request-len 96`, acceptance 0 then 0.9 a depth:
# 1.455x with a ring's catch-up every 128 steps, 0.999x with requests of 96 tokens and no expiry). Once the window
# empties, the next exploration runs the chain again (in shadow, at the interval it had backed off to), and its
# catch-up scores fresh guesses. As long as the longest exploration interval (MAX_EXPLORE_EVERY).
FIRST_GUESS_MAX_AGE = 1024
# ... taken by a catch-up of at most this many positions (rows × width: its logits over the draft's vocabulary are
# this many rows); a larger one (a ring's catch-up at a large batch) takes none.
FIRST_GUESS_MAX_POSITIONS = 1024


def takes_first_guesses(num_rows: int, width: int) -> bool:
    """Whether a catch-up of `num_rows` rows `width` wide takes the draft's first guesses (FIRST_GUESS_MAX_POSITIONS):
    eagerly, and as the flush graph of that bucket and width."""
    return num_rows * width <= FIRST_GUESS_MAX_POSITIONS


def flush_block_size(num_rows: int, width: int) -> int:
    """The int64 count of a catch-up's block (`flush_block_views`): each part rounded up to an even count, so that
    every view starts 16-byte aligned (Triton specializes a kernel on its pointers' alignment)."""
    return _even(num_rows * width) + 3 * _even(num_rows)


def flush_block_views(block, num_rows: int, width: int) -> tuple:
    """A catch-up's inputs in the layout one copy moves whole: block [flush_block_size] int64 (a host array or a
    device tensor) → ids [num_rows, width] (token t + 1 for each row's positions start .. start + width − 1), then
    starts, valid counts and slots [num_rows] each (`SpecDecoder.flush_rows`), views of the block."""
    ids = block[: num_rows * width].reshape(num_rows, width)
    rows = block[_even(num_rows * width) :].reshape(3, _even(num_rows))[:, :num_rows]
    starts, valid, slots = rows
    return ids, starts, valid, slots


def _even(n: int) -> int:
    return n + n % 2


# Every this many steps of one batch-size bucket, the least recently timed option runs again; each exploration that
# leaves the best option unchanged doubles the interval (up to MAX_EXPLORE_EVERY), one that changes it resets it.
EXPLORE_EVERY = 64
MAX_EXPLORE_EVERY = 1024
# ... and never sooner than keeps an exploration's cost (its steps' time less the best option's time for as many
# tokens) within this share of the best option's time over the interval: a verify step of the default pair costs
# ~6 plain steps at batch 1 (session 17), so exploring it every 64 steps cost ~6% of plain decoding's throughput.
EXPLORE_BUDGET = 0.01
# An exploration of a draft shape ends before its EXPLORE_SAMPLES timed steps once its drafts so far rule the shape
# out with this risk of being wrong (`AdaptivePolicy.exploration_cannot_win`). Session 51, drafts forced wrong: at
# batch 8, 196 verify steps in 2,304 cost the default pair 4.4% against a speculating engine that never verified.
# A bound with one more whole acceptance than seen instead (no confidence) missed drafts that began to pay in 4 of 12
# `policy_sim` runs at batch 1 (1.02x against 1.26x): two verify steps show too little.
EXPLORE_STOP_RISK = 0.05
# Once the policy finds plain decoding best for a bucket, it answers plain for that bucket's next SETTLED_STEPS steps
# (never past its next exploration) without weighing the options again; new acceptance or a verify step's time ends
# that early. On the GPU machine's host a speculating engine's plain step cost ~20 µs over a plain engine's (session
# 22, batch 1), most of it the policy's choice, its step-time median and the ring check redone every step.
SETTLED_STEPS = 16
# An exploration of a draft shape begun while plain decoding is best, of a shape whose estimated rate (tokens a step
# over its median step time) is below this share of plain decoding's, runs in shadow when every request is greedy
# (`SpecDecoder.shadow_draft`): plain steps that also draft, unverified; the drafts are compared with the tokens plain
# decoding then emits. `bench/policy_sim.py --shadow` (session 53, the default pair at batch 1, drafts always wrong):
# 0.986x → 0.996x with a steady host; without the margin (every exploration begun while plain is best in shadow) the
# run whose drafts hover near plain decoding's rate fell 0.956x → 0.945x: a shadow step yields one token where a
# verify step near the break-even yields more, so a shape that may be about to win is still verified. Measured on an
# H100 (session 55, `bench/spec_overhead.py`, drafts wrong): at parity with verified explorations, 0.932x / 0.931x at
# batch 1 and 0.969x / 0.968x at batch 8 — a shadow step's catch-up and draft cost about what a verify step does.
SHADOW_MARGIN = 0.8
# The draft and verify times (metrics) are measured on every PHASE_TIMING_EVERY-th verify step: four CUDA events and
# their read-back cost ~60 µs of host time (H200 host, session 19), ~5% of the default pair's verify step.
PHASE_TIMING_EVERY = 8


@dataclass(frozen=True)
class DraftShape:
    topk: int
    num_steps: int
    num_draft_tokens: int  # T_d: tree nodes verified per sequence, root included

    @property
    def max_depth(self) -> int:
        return min(self.num_steps, self.num_draft_tokens - 1)


def draft_shapes(topk: int, num_steps: int, num_draft_tokens: int) -> list[DraftShape]:
    """The configured shape, then one about half its size when that is smaller (largest first): what the adaptive
    policy chooses among, beside plain decoding."""
    shapes = [DraftShape(topk, num_steps, num_draft_tokens)]
    half_steps = max(1, num_steps // 2)
    half_nodes = min(max_tree_nodes(topk, half_steps), max(2, (num_draft_tokens + 1) // 2))
    if half_nodes < num_draft_tokens:
        shapes.append(DraftShape(topk, min(half_steps, half_nodes - 1), half_nodes))
    return shapes


def batch_bucket(num_seqs: int) -> int:
    """Power-of-two bucket of a batch size (the adaptive policy's step times are kept per bucket)."""
    return 1 << (num_seqs - 1).bit_length()


@dataclass(slots=True)
class _Settled:
    """A settled plain stretch of one bucket (`AdaptivePolicy.choose`), answered without the bookkeeping of a step:
    its choices and timed steps are kept here and folded into the policy's tables when the stretch ends."""

    num_seqs: int  # the batch size it answers for (another, even of the same bucket, ends it)
    left: int  # plain answers it still gives
    taken: int = 0  # plain answers given (bucket steps not yet counted)
    seconds: list[float] = field(default_factory=list)  # plain steps timed meanwhile
    timed_at: int = 0  # `taken` when the newest of them was timed


@dataclass
class _Run:
    """An option the policy keeps choosing for a bucket until it has `until` timed steps (or MAX_RUN_STEPS choices):
    its first measurement, or an exploration (`best_before`: the best option when it began; `started`: its step)."""

    option: int
    until: int
    started: int
    best_before: int | None = None
    num_chosen: int = 1  # the choice that started it
    accepted: int = 0  # an exploration of a draft shape: drafts accepted by its verify steps so far
    drafts: int = 0  # ... and the drafts (one a sequence a step) they verified


class AdaptivePolicy:
    """Per step, which draft shape to verify (or none) for a batch of N decoding sequences.

    Cost model: option c (a draft shape, or plain decoding) yields τ_c tokens per sequence per step — 1 for plain
    decoding, 1 + the measured mean of accepted drafts for a shape — and takes t_c(b) seconds per step at batch
    bucket b (the median wall time of its last timed engine steps). The policy picks the largest τ_c / t_c(b).

    Options are judged in their steady state, as they run when chosen step after step: only such steps are timed
    (plain steps launched ahead of the one in flight, verify steps whose draft had nothing to catch up on), and an
    option runs for several steps at a time — MIN_SAMPLES timed steps when a bucket first measures it, then every
    `EXPLORE_EVERY` steps of the bucket the least recently timed option runs again for EXPLORE_SAMPLES timed steps,
    so the estimates follow changes in acceptance and load (a draft shape's exploration ends sooner once its drafts
    so far cannot win: `exploration_cannot_win`). While explorations keep confirming the best option the
    interval doubles (to `max_explore_every`: MAX_EXPLORE_EVERY, unless a variant sets its own), so a draft that
    never pays costs ever fewer exploration steps, and it snaps back to `EXPLORE_EVERY` when an exploration changes
    the choice. An interval is never shorter than keeps the costliest exploration within `EXPLORE_BUDGET` of the
    best option's time (up to `max_explore_every`).
    Plain decoding is always an option, so what speculation costs when drafts never pay is the exploration steps, the
    draft's catch-up and this bookkeeping on every plain step (session 48, the host-bound default pair at batch 1:
    +4.0% a token with the policy always answering plain; since session 50 a settled stretch keeps its steps aside,
    `_Settled`: on the CPU, with the model stubbed, +5.6 µs a plain step over a plain engine's 80 µs, +8.4 before).
    Without `adaptive`, the largest shape is always chosen (then the smaller, then none, as room allows).

    A chain that cannot win is not run at all (`cannot_win`): a chain of depth D drafts every shorter chain's D_p
    levels first, so with a shorter chain's measured m_p = E[min(a, D_p)] and f_p = P(a ≥ D_p) it yields at most
    1 + m_p + (D − D_p) · f_p tokens a step, in no less time than the shorter chain's step. A bucket's first
    measurement therefore runs the shortest chain, then plain decoding, and only then a longer chain whose bound
    still beats the best rate (`first_measurement_order`); explorations skip it likewise. With every draft wrong
    (f_p = 0) only the shortest chain is ever verified.
    """

    max_explore_every = MAX_EXPLORE_EVERY  # the longest exploration interval (a class attribute: variants set theirs)
    first_guess_max_age = FIRST_GUESS_MAX_AGE  # steps a scored first guess counts for (likewise)
    # A settled plain stretch answers and times its steps through `_Settled` (a few attribute reads a step, where the
    # full bookkeeping cost the speculating engine's host-bound plain step ~4.5 µs: session 48). Variants that read the
    # tables between their own steps turn it off.
    settled_fast_path = True

    def __init__(self, shapes: list[DraftShape], adaptive: bool) -> None:
        self.shapes = shapes
        self.adaptive = adaptive
        self.medians: dict[tuple[int, int], float] = {}  # (option, bucket) → estimate; option -1 = plain
        self.recent_seconds: dict[tuple[int, int], collections.deque] = {}  # its last TIME_SAMPLES timed steps
        self.num_timed: collections.Counter = collections.Counter()  # (option, bucket) → timed steps so far
        self.last_used: dict[tuple[int, int], int] = {}  # (option, bucket) → the bucket's step it was last timed at
        self.bucket_steps: dict[int, int] = {}
        self.mean_accepted: list[float | None] = [None] * len(shapes)  # accepted drafts per sequence-round
        # per option, its verify steps that hold its last ACCEPT_WINDOW_DRAFTS drafts: (drafts accepted, drafts, drafts
        # accepted whole)
        self.recent_accepted: list[collections.deque] = [collections.deque() for _ in shapes]
        self.accepted_totals = [[0, 0, 0] for _ in shapes]  # per option: the sums of recent_accepted's three counts
        self.newest_accepted = [collections.deque(maxlen=BOUND_NEWEST_STEPS) for _ in shapes]  # the same, newest steps
        # the draft's first guesses scored (`record_first_guesses`): (right, scored, `clock`) per catch-up, their sums
        self.first_guesses: collections.deque = collections.deque()
        self.first_guess_totals = [0, 0]
        self.forced_option: int | None = None  # tests: always this option (-1 plain), ignoring the cost model
        self.explore_every: dict[int, int] = {}  # bucket → current exploration interval (steps)
        self.next_explore: dict[int, int] = {}  # bucket → step of its next exploration
        self.runs: dict[int, _Run] = {}  # bucket → the option it keeps choosing until timed enough
        self.tried: dict[int, set[int]] = {}  # bucket → the options it has begun to measure
        self.measured: set[int] = set()  # buckets whose every option has been measured once
        self.plain_until: dict[int, int] = {}  # bucket → step before which it is plain without weighing (SETTLED_STEPS)
        self.stale: set[tuple[int, int]] = set()  # (option, bucket) timed since its median was last taken
        self._settled: _Settled | None = None  # the settled plain stretch in progress (plain_until's fast path)

    @property
    def options(self) -> list[int]:
        """Every shape's index (largest first), then -1 for plain decoding."""
        return [*range(len(self.shapes)), -1]

    def tokens_per_step(self, option: int) -> float:
        if option < 0:
            return 1.0
        accepted = self.mean_accepted[option]
        return 1.0 + (self.shapes[option].max_depth if accepted is None else accepted)

    def choose(self, num_seqs: int) -> int:
        """The option for this step: a shape index, or -1 for plain decoding."""
        if self.forced_option is not None:
            return self.forced_option
        if not self.adaptive:
            return 0
        settled = self._settled
        if settled is not None:
            if settled.left and num_seqs == settled.num_seqs:
                settled.left -= 1
                settled.taken += 1
                return -1
            self._fold_settled()
        bucket = batch_bucket(num_seqs)
        step = self.bucket_steps.get(bucket, 0)
        self.bucket_steps[bucket] = step + 1
        run = self.runs.get(bucket)
        if (
            run is not None
            and run.num_chosen < MAX_RUN_STEPS
            and self.num_timed[(run.option, bucket)] < run.until
            and not self.exploration_cannot_win(run, bucket)
        ):
            run.num_chosen += 1
            return run.option
        self.runs.pop(bucket, None)
        if bucket not in self.measured:  # each option in turn until it has MIN_SAMPLES (`first_measurement_order`)
            tried = self.tried.setdefault(bucket, set())
            for option in self.first_measurement_order():
                if option in tried or self.num_timed[(option, bucket)] >= MIN_SAMPLES:
                    continue
                tried.add(option)
                if not self.cannot_win(option, bucket):
                    return self._start_run(bucket, option, step, until=MIN_SAMPLES)
            self.measured.add(bucket)
        if step < self.plain_until.get(bucket, 0):
            return -1
        best = self.best(bucket)
        if run is not None and run.best_before is not None:  # an exploration has run: judge it
            interval = self.explore_every.get(bucket, EXPLORE_EVERY)
            interval = min(2 * interval, self.max_explore_every) if best == run.best_before else EXPLORE_EVERY
            self.explore_every[bucket] = interval
            self.next_explore[bucket] = run.started + max(interval, self.budget_steps(bucket, best))
        elif bucket not in self.next_explore:  # every option measured for the first time (the first exploration)
            self.next_explore[bucket] = step + max(EXPLORE_EVERY, self.budget_steps(bucket, best))
        if step >= self.next_explore[bucket]:
            option = min(self._explorable(bucket, best), key=lambda c: self.last_used.get((c, bucket), -1))
            self.next_explore[bucket] = step + self.explore_every.get(bucket, EXPLORE_EVERY)
            until = self.num_timed[(option, bucket)] + EXPLORE_SAMPLES
            return self._start_run(bucket, option, step, until, best_before=best)
        if best < 0:
            self.plain_until[bucket] = min(step + 1 + SETTLED_STEPS, self.next_explore[bucket])
            if self.settled_fast_path:
                self._settled = _Settled(num_seqs, left=self.plain_until[bucket] - step - 1)
        return best

    def _fold_settled(self) -> None:
        """End the settled stretch in progress: count its steps, and time its timed plain steps, as `choose` and
        `record_step` would have step by step."""
        settled, self._settled = self._settled, None
        if settled is None:
            return
        bucket = batch_bucket(settled.num_seqs)
        base = self.bucket_steps[bucket]
        self.bucket_steps[bucket] = base + settled.taken
        if settled.seconds:
            key = (-1, bucket)
            self._recent_seconds(key).extend(settled.seconds)
            self.num_timed[key] += len(settled.seconds)
            self.stale.add(key)
            self.last_used[key] = base + settled.timed_at

    def _explorable(self, bucket: int, best: int) -> list[int]:
        """The options an exploration of `bucket` picks from (the least recently timed of them): every one that could
        win (`cannot_win`); a variant may narrow the choice further."""
        return [c for c in self.options if not self.cannot_win(c, bucket)]

    def first_measurement_order(self) -> list[int]:
        """The order a bucket first measures its options in: the trees (as configured), the shortest chain, plain
        decoding, then the longer chains, shortest first — each longer chain after a shorter one and plain decoding,
        so that what they measured can rule it out (`cannot_win`) before it runs."""
        chains = sorted((i for i, s in enumerate(self.shapes) if s.topk == 1), key=lambda i: self.shapes[i].max_depth)
        trees = [i for i, s in enumerate(self.shapes) if s.topk != 1]
        return [*trees, *chains[:1], -1, *chains[1:]]

    def cannot_win(self, option: int, bucket: int) -> bool:
        """Whether chain `option` is sure to yield fewer tokens a second at `bucket` than the best option timed there,
        from what a shorter chain measured: a chain of depth D verifies a shorter chain's D_p levels first, so it
        accepts at most m_p + (D − D_p) · f_p drafts a step (m_p = E[min(a, D_p)], f_p = P(a ≥ D_p), taken with one
        more whole acceptance than seen: a draft that accepts rarely is not ruled out by a few steps; the larger of
        the bounds from the acceptance window and from the newest BOUND_NEWEST_STEPS verify steps), and its step
        takes no less than the shorter chain's (or its own, where that is less: a median taken in a slow stretch of
        the host must not keep it from being timed again). Also sure, without a shorter chain: from the draft's first
        guesses (`first_guess_bound` g), it accepts at most D · g drafts a step, in its own median time. False for
        plain decoding, a tree, a chain with neither bound, or a bucket with nothing timed."""
        if option < 0 or self.shapes[option].topk != 1:
            return False
        seconds = self.step_seconds
        if not any((c, bucket) in seconds for c in self.options):
            return False
        best_rate = self.best_and_rate(bucket, seconds)[1]
        depth = self.shapes[option].max_depth
        if self._guess_rules_out(option, bucket, seconds, best_rate, self.first_guess_bound()):
            return True
        for p, prefix in enumerate(self.shapes):
            lower = seconds.get((p, bucket))
            if prefix.topk != 1 or prefix.max_depth >= depth or lower is None or not self.newest_accepted[p]:
                continue
            lower = min(lower, seconds.get((option, bucket), lower))  # the smaller: either may be a slow stretch's
            newest = [sum(counts) for counts in zip(*self.newest_accepted[p], strict=True)]
            bound = 1.0 + max(
                accepted / drafts + (depth - prefix.max_depth) * (whole + 1) / (drafts + 1)
                for accepted, drafts, whole in (self.accepted_totals[p], newest)
            )
            if bound / lower < best_rate:
                return True
        return False

    def _guess_rules_out(
        self, option: int, bucket: int, seconds: dict[tuple[int, int], float], best_rate: float, guess: float | None
    ) -> bool:
        """Whether a share `guess` of first guesses right bounds chain `option` below `best_rate` at `bucket`."""
        own = seconds.get((option, bucket))
        return guess is not None and own is not None and (1.0 + self.shapes[option].max_depth * guess) / own < best_rate

    def _guess_ruled_out(self, sure: bool) -> set[tuple[int, int]]:
        """The (chain, bucket) pairs the first guesses rule out now (`cannot_win`'s upper bound), or with `sure` would
        rule out even at the lower one (the window's rate less the same spread)."""
        guess = self.first_guess_bound(lower=sure)
        seconds = self.step_seconds
        out = set()
        for bucket in self.next_explore:
            best_rate = self.best_and_rate(bucket, seconds)[1]
            out |= {(c, bucket) for c, shape in enumerate(self.shapes)
                    if shape.topk == 1 and self._guess_rules_out(c, bucket, seconds, best_rate, guess)}  # fmt: skip
        return out

    def record_first_guesses(self, right: int, scored: int) -> None:
        """A catch-up's first guesses (`FIRST_GUESS_WINDOW`): `right` of `scored` positions held the token plain
        decoding emitted next. Kept over the last FIRST_GUESS_WINDOW scored positions. A chain they ruled out and no
        longer would even at the window's lower bound is explored at its bucket's next step, the interval back to
        EXPLORE_EVERY: explorations had backed off while it was ruled out, and its drafts now may pay (a rate that
        merely wanders about the break-even does not reset the interval each time it crosses)."""
        if scored <= 0:
            return
        before = self._guess_ruled_out(sure=False)
        self.first_guesses.append((right, scored, self.clock()))
        totals = self.first_guess_totals
        totals[0] += right
        totals[1] += scored
        while totals[1] - self.first_guesses[0][1] >= FIRST_GUESS_WINDOW:
            self._drop_oldest_guesses()
        for bucket in {bucket for _, bucket in before - self._guess_ruled_out(sure=True)}:
            self.next_explore[bucket] = self.bucket_steps.get(bucket, 0)
            self.explore_every[bucket] = EXPLORE_EVERY
        self._fold_settled()
        self.plain_until.clear()  # the chains' bounds moved: weigh again

    def _drop_oldest_guesses(self) -> None:
        right, scored, _ = self.first_guesses.popleft()
        self.first_guess_totals[0] -= right
        self.first_guess_totals[1] -= scored

    def clock(self) -> int:
        """Steps chosen so far, every bucket's (a settled stretch's included): the first guesses' age."""
        settled = self._settled
        return sum(self.bucket_steps.values()) + (settled.taken if settled is not None else 0)

    def first_guess_bound(self, lower: bool = False) -> float | None:
        """An upper (or `lower`) bound, at confidence 1 − EXPLORE_STOP_RISK (Hoeffding), on the share of positions
        whose first guess is right, from the scored window less what is older than FIRST_GUESS_MAX_AGE steps; None
        when that leaves none."""
        oldest = self.clock() - self.first_guess_max_age
        while self.first_guesses and self.first_guesses[0][2] < oldest:
            self._drop_oldest_guesses()
        right, scored = self.first_guess_totals
        if scored == 0:
            return None
        spread = math.sqrt(math.log(1.0 / EXPLORE_STOP_RISK) / (2 * scored))
        return max(0.0, right / scored - spread) if lower else min(1.0, right / scored + spread)

    def exploration_cannot_win(self, run: _Run, bucket: int) -> bool:
        """Whether an exploration of a draft shape may end before its timed steps: when the drafts its verify steps
        have accepted so far bound the shape's tokens a step, with confidence 1 − EXPLORE_STOP_RISK, below what it
        needs to beat the best option at the time the best had when the exploration began. The bound is Hoeffding's
        on the mean accepted count (each draft accepts between 0 and D, the shape's depth): 1 + mean + D · sqrt(ln(1
        / risk) / 2n) for n drafts. Its step time is the fastest of this run's timed steps, or its median if lower: a
        median taken while the host stalled would end the very exploration that refreshes it. At batch 8 one verify
        step of wrong drafts ends an exploration of the default pair's chain of 3; at batch 1 none does (6 drafts
        leave the bound above the break-even). False for the first measurement, plain decoding, or before the run has
        a verify step's acceptance and a timed step."""
        if run.best_before is None or run.option < 0 or run.drafts == 0:
            return False
        key, best = (run.option, bucket), (run.best_before, bucket)
        fresh = self.num_timed[key] - (run.until - EXPLORE_SAMPLES)  # this run's timed steps
        seconds = self.step_seconds
        if fresh <= 0 or best not in seconds:
            return False
        lower = min(seconds[key], *list(self.recent_seconds[key])[-fresh:])
        depth = self.shapes[run.option].max_depth
        spread = depth * math.sqrt(math.log(1.0 / EXPLORE_STOP_RISK) / (2 * run.drafts))
        bound = 1.0 + run.accepted / run.drafts + spread
        return bound / lower < self.tokens_per_step(run.best_before) / self.weighed_seconds(*best, seconds)

    def shadows(self, option: int, bucket: int) -> bool:
        """Whether this step's choice of draft shape `option` may run in shadow (`SHADOW_MARGIN`): it is an exploration
        begun while plain decoding was best, and the shape's rate is below SHADOW_MARGIN of plain decoding's even
        taken at its best: the larger of its acceptance window's mean and its newest verify steps' (drafts that begin
        to pay show there first) over its fastest recent step. A shadow step neither times the shape nor fills its
        window much (one draft a sequence a step), so a shape that lost on a median taken in a slow stretch of the host,
        or on a window of old drafts, is verified again rather than shadowed for good. Its first measurement is always
        verified (a shadow step has no verify step to time)."""
        run = self.runs.get(bucket)
        if run is None or run.option != option or run.best_before != -1:
            return False
        recent, plain = self.recent_seconds.get((option, bucket)), self.step_seconds.get((-1, bucket))
        if not recent or plain is None:
            return False
        accepted = self.mean_accepted[option]
        newest = self.newest_accepted[option]
        if newest:
            accepted = max(accepted or 0.0, sum(a for a, _, _ in newest) / sum(d for _, d, _ in newest))
        tokens = 1.0 + (self.shapes[option].max_depth if accepted is None else accepted)
        return tokens / min(recent) < SHADOW_MARGIN / plain

    def record_shadow_step(self, option: int, num_seqs: int) -> None:
        """A step of a shadow exploration of `option` (`shadows`): counted as one of the run's timed steps, with no
        time (a shadow step times no verify step; its acceptance comes later, from the tokens plain decoding emits:
        `record_acceptance`)."""
        self._fold_settled()
        key = (option, batch_bucket(num_seqs))
        self.num_timed[key] += 1
        self.last_used[key] = self.bucket_steps.get(key[1], 0)

    def _start_run(self, bucket: int, option: int, step: int, until: int, best_before: int | None = None) -> int:
        self.runs[bucket] = _Run(option, until, step, best_before)
        self.plain_until.pop(bucket, None)
        return option

    def best(self, bucket: int) -> int:
        """The timed option with the most tokens per second at `bucket` (plain decoding when none is timed)."""
        return self.best_and_rate(bucket, self.step_seconds)[0]

    def best_and_rate(self, bucket: int, seconds: dict[tuple[int, int], float]) -> tuple[int, float]:
        """(the best timed option at `bucket`, its tokens a second): the draft shape with the most tokens per second
        at its median, taken over plain decoding only if it beats it at its `weighed_seconds` (a tie goes to plain
        decoding). Shapes are ranked among themselves at their own medians: weighed at plain decoding's time when a
        stalled host inflated it, a chain of 7 and a chain of 3 would be ranked by their tokens a step alone."""
        top, top_rate = -1, 0.0
        for c in range(len(self.shapes)):
            t = seconds.get((c, bucket))
            if t is not None and (rate := self.tokens_per_step(c) / t) > top_rate:
                top, top_rate = c, rate
        plain = seconds.get((-1, bucket))
        if plain is None:
            return top, top_rate  # (-1, 0.0) when nothing is timed
        if top >= 0:
            top_rate = self.tokens_per_step(top) / self.weighed_seconds(top, bucket, seconds)
        return (-1, 1.0 / plain) if 1.0 / plain >= top_rate else (top, top_rate)

    @staticmethod
    def weighed_seconds(option: int, bucket: int, seconds: dict[tuple[int, int], float]) -> float:
        """`option`'s step time at `bucket` as the options are weighed: its median, and for a draft shape no less than
        plain decoding's. A verify step does a plain step's work and more, on the device and on the host, so a shape
        timed faster was timed in a faster stretch of the host. (Session 51, the default pair at batch 8 with every
        draft wrong: verify steps launched ahead timed 0.30-0.60 ms against plain steps' 0.16-1.2 ms, and a shape
        that yields plain decoding's one token a step was chosen for 284 steps in a row, 14% of the steps.)"""
        median = seconds[(option, bucket)]
        return median if option < 0 else max(median, seconds.get((-1, bucket), median))

    def budget_steps(self, bucket: int, best: int) -> int:
        """Steps between explorations of `bucket` that keep the costliest one it may run (`_explorable`) within
        EXPLORE_BUDGET of the time the best option takes over them (at most MAX_EXPLORE_EVERY). An exploration runs
        option c for about EXPLORE_SAMPLES + 1 steps (one not timed), each costing t_c less the best option's time for
        c's tokens, t_best · τ_c / τ_best."""
        seconds = self.step_seconds
        if (best, bucket) not in seconds:
            return EXPLORE_EVERY
        t_best = seconds[(best, bucket)]
        rate = self.tokens_per_step(best) / t_best
        costs = [seconds[(c, bucket)] - self.tokens_per_step(c) / rate
                 for c in self._explorable(bucket, best) if c != best and (c, bucket) in seconds]  # fmt: skip
        cost = (EXPLORE_SAMPLES + 1) * max(costs, default=0.0)
        return min(self.max_explore_every, math.ceil(max(cost, 0.0) / (EXPLORE_BUDGET * t_best)))

    def record_step(self, option: int, num_seqs: int, seconds: float) -> None:
        """Time a steady step of `option`; its median is taken when the options are next weighed (`step_seconds`)."""
        settled = self._settled
        if settled is not None:
            if option < 0 and num_seqs == settled.num_seqs:
                settled.seconds.append(seconds)
                settled.timed_at = settled.taken
                return
            self._fold_settled()
        key = (option, batch_bucket(num_seqs))
        self._recent_seconds(key).append(seconds)
        self.num_timed[key] += 1
        self.stale.add(key)
        self.last_used[key] = self.bucket_steps.get(key[1], 0)
        if option >= 0:
            self.plain_until.pop(key[1], None)

    def _recent_seconds(self, key: tuple[int, int]) -> collections.deque:
        recent = self.recent_seconds.get(key)
        if recent is None:
            recent = self.recent_seconds[key] = collections.deque(maxlen=TIME_SAMPLES)
        return recent

    @property
    def step_seconds(self) -> dict[tuple[int, int], float]:
        """(option, bucket) → the median of its last TIME_SAMPLES step times, taken now for those timed since."""
        self._fold_settled()
        for key in self.stale:
            self.medians[key] = statistics.median(self.recent_seconds[key])
        self.stale.clear()
        return self.medians

    def record_acceptance(self, option: int, accepted_drafts: list[int]) -> None:
        """A verify step of `option` accepted `accepted_drafts` (one count a sequence). A chain's drafts also tell
        every shorter chain's: the draft model drafts a chain level by level, so a shorter chain is this one's
        prefix, and it would have accepted min(accepted, its depth)."""
        assert accepted_drafts, "a verify step verifies at least one sequence's draft"
        shape = self.shapes[option]
        for other, prefix in enumerate(self.shapes):
            if other == option or (shape.topk == 1 and prefix.topk == 1 and prefix.max_depth < shape.max_depth):
                depth = prefix.max_depth
                counts = accepted_drafts if other == option else [min(a, depth) for a in accepted_drafts]
                self._add_acceptance(other, sum(counts), len(counts), sum(a >= depth for a in counts))
        run = self.runs.get(batch_bucket(len(accepted_drafts)))
        if run is not None and run.option == option:
            run.accepted += sum(accepted_drafts)
            run.drafts += len(accepted_drafts)
        self._fold_settled()
        self.plain_until.clear()

    def _add_acceptance(self, option: int, accepted: int, drafts: int, whole: int) -> None:
        recent, totals = self.recent_accepted[option], self.accepted_totals[option]
        recent.append((accepted, drafts, whole))
        self.newest_accepted[option].append(recent[-1])
        for i, count in enumerate(recent[-1]):
            totals[i] += count
        while totals[1] - recent[0][1] >= ACCEPT_WINDOW_DRAFTS:  # the window still holds as many without the oldest
            for i, count in enumerate(recent.popleft()):
                totals[i] -= count
        self.mean_accepted[option] = totals[0] / totals[1]


@dataclass
class SpecStats:
    """Totals since the engine started. A draft is one sequence's tree in one verify step (vLLM's `num_drafts`)."""

    num_verify_steps: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0  # drafted nodes verified (T_d - 1 per draft)
    num_accepted_tokens: int = 0  # drafted nodes accepted
    drafted_at_depth: list[int] = field(default_factory=list)  # [d - 1]: drafts whose tree reached depth d
    accepted_at_depth: list[int] = field(default_factory=list)  # [d - 1]: drafts with ≥ d accepted nodes
    num_verify_steps_ahead: int = 0  # verify steps launched before the host read the one before (overlap)
    # Verify steps launched, those whose sequences all ended before they were read (and were not counted) included:
    # which ones are timed (PHASE_TIMING_EVERY) is decided at launch.
    num_verify_launches: int = 0
    # Phase times, summed over the verify steps timed (every PHASE_TIMING_EVERY-th, the first included):
    timed_verify_steps: int = 0
    draft_seconds: float = 0.0  # drafting the trees, after catching up on what plain steps skipped
    verify_seconds: float = 0.0  # target verify, acceptance, commit, and the draft's catch-up on accepted tokens
    # Shadow explorations (`SpecDecoder.shadow_draft`): drafts scored against the tokens plain decoding emitted, and
    # the drafts they would have had accepted (not in τ or the per-depth rates: nothing was verified)
    num_shadow_drafts: int = 0
    num_shadow_accepted: int = 0
    num_shadow_steps: int = 0  # plain steps launched with a shadow draft
    # Catch-up forwards over positions plain steps left to the draft (`SpecDecoder.flush`: a ring about to wrap, or
    # before a verify step, a shadow draft or a prefill chunk)
    num_catch_ups: int = 0
    # The draft's first guesses scored against the tokens plain decoding emitted (`FirstGuesses`), and those right
    num_first_guesses: int = 0
    num_first_guesses_right: int = 0

    def add(self, num_nodes: int, accepted_drafts: list[int], depths: list[int]) -> None:
        self.num_verify_steps += 1
        self.num_drafts += len(accepted_drafts)
        self.num_draft_tokens += (num_nodes - 1) * len(accepted_drafts)
        self.num_accepted_tokens += sum(accepted_drafts)
        deepest = max(depths)
        if len(self.drafted_at_depth) < deepest:
            grow = deepest - len(self.drafted_at_depth)
            self.drafted_at_depth += [0] * grow
            self.accepted_at_depth += [0] * grow
        for accepted, depth in zip(accepted_drafts, depths, strict=True):
            for d in range(depth):
                self.drafted_at_depth[d] += 1
            for d in range(accepted):
                self.accepted_at_depth[d] += 1

    @property
    def mean_acceptance_length(self) -> float:
        """τ: tokens per sequence per verify step (accepted drafts + the bonus); 0 before the first step."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    @property
    def acceptance_rate_per_depth(self) -> list[float]:
        """[d - 1]: of the drafts whose tree reached depth d, the share that accepted ≥ d nodes."""
        return [a / n if n else 0.0 for a, n in zip(self.accepted_at_depth, self.drafted_at_depth, strict=True)]

    @property
    def draft_ms_per_step(self) -> float:
        return 1e3 * self.draft_seconds / max(self.timed_verify_steps, 1)

    @property
    def verify_ms_per_step(self) -> float:
        return 1e3 * self.verify_seconds / max(self.timed_verify_steps, 1)

    def as_dict(self) -> dict:
        return {
            "num_verify_steps": self.num_verify_steps,
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "num_verify_steps_ahead": self.num_verify_steps_ahead,
            "mean_acceptance_length": round(self.mean_acceptance_length, 4),
            "acceptance_rate_per_depth": [round(r, 4) for r in self.acceptance_rate_per_depth],
            "draft_ms_per_step": round(self.draft_ms_per_step, 4),
            "verify_ms_per_step": round(self.verify_ms_per_step, 4),
            "num_shadow_drafts": self.num_shadow_drafts,
            "num_shadow_accepted": self.num_shadow_accepted,
            "num_shadow_steps": self.num_shadow_steps,
            "num_catch_ups": self.num_catch_ups,
            "num_first_guesses": self.num_first_guesses,
            "num_first_guesses_right": self.num_first_guesses_right,
        }


class _PhaseTimer:
    """Seconds between marks: CUDA events on a GPU (read after the step's one synchronisation), else the host clock.
    A timer made with `enabled=False` marks nothing and times nothing."""

    def __init__(self, device: torch.device, enabled: bool = True) -> None:
        self.is_cuda = device.type == "cuda"
        self.enabled = enabled
        self.marks: list = []

    def mark(self) -> None:
        if not self.enabled:
            return
        if self.is_cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def seconds(self) -> list[float]:
        """Durations between consecutive marks (call after the device finished them)."""
        if self.is_cuda:
            return [a.elapsed_time(b) / 1e3 for a, b in itertools.pairwise(self.marks)]
        return [b - a for a, b in itertools.pairwise(self.marks)]


@dataclass
class VerifyLaunch:
    """A VERIFY step queued on the device (`SpecDecoder.launch_verify`, `launch_verify_next`): its sequences and
    draft shape, its result rows and their copy to the host, started right behind the step, so that reading them
    waits for this step only and a verify step launched after it may reuse the graphs' buffers."""

    seqs: list[Sequence]
    slots_host: np.ndarray  # [N] int64
    shape: int
    is_all_greedy: bool
    use_graphs: bool
    # The result [N, T_d + 2], prefix [N] and slots [N] on the device: on the eager path what a verify step launched
    # after it takes its inputs from (the graph path's verify graph leaves those in its static inputs instead, and a
    # step launched ahead there passes no prefix or slots).
    result: torch.Tensor
    prefix: torch.Tensor | None
    slots: torch.Tensor | None
    timer: _PhaseTimer
    host_result: HostCopy  # [N, T_d + 2] int64: the result's copy to the host, started
    is_ahead: bool = False  # launched before the host read the step before it

    @classmethod
    def start(
        cls,
        seqs: list[Sequence],
        slots_host: np.ndarray,
        shape: int,
        is_all_greedy: bool,
        use_graphs: bool,
        result: torch.Tensor,  # [N, T_d + 2]
        prefix: torch.Tensor | None,
        slots: torch.Tensor | None,
        timer: _PhaseTimer,
        is_ahead: bool = False,
    ) -> VerifyLaunch:
        """Start copying `result` to the host without waiting for it."""
        return cls(seqs, slots_host, shape, is_all_greedy, use_graphs, result, prefix, slots, timer,
                   start_host_copy(result), is_ahead)  # fmt: skip

    @property
    def option(self) -> int:
        """The adaptive policy's option this step ran: its draft shape."""
        return self.shape

    def result_rows(self) -> list[list[int]]:
        """The result rows (waits for the step to finish on the device)."""
        return self.host_result.read()


@dataclass
class ShadowDraft:
    """A shadow exploration's trees (`SpecDecoder.shadow_draft`), waiting for the tokens plain decoding emits."""

    shape: int
    seqs: list[Sequence]
    first: np.ndarray  # [N] int64: the position of each row's first drafted token (its root's + 1)
    nodes: HostCopy  # [2, N, T_d] int64: each tree's tokens and parents, being copied to the host

    def is_due(self, depth: int) -> bool:
        """Whether every row's tokens at the drafted positions are known (or its sequence ended): `depth` past
        `first`; and the trees' copy is made (a chain of one draft is due with the step in flight's token, which
        the draft queued behind it may not have followed yet: reading then would wait on the device)."""
        rows = zip(self.seqs, self.first.tolist(), strict=True)
        return all(s.is_finished or len(s.token_ids) >= f + depth for s, f in rows) and self.nodes.is_ready()

    def accepted(self, depth: int) -> list[int | None]:
        """Per row, the drafts greedy verification would have accepted — the longest path from the root whose tokens
        are the ones emitted (`accepted_along`), of a tree `depth` deep — or None where the sequence emitted no token
        past its root (it ended there)."""
        tokens, parents = self.nodes.read()  # [N, T_d] each
        rows = zip(self.seqs, self.first.tolist(), tokens, parents, strict=True)
        return [accepted_along(row_tokens, row_parents, seq.token_ids[first : first + depth])
                if len(seq.token_ids) > first else None for seq, first, row_tokens, row_parents in rows]  # fmt: skip


def accepted_along(tokens: list[int], parents: list[int], emitted: list[int]) -> int:
    """How many of `emitted` (the tokens after a tree's root) a path down the tree (node 0 the root; `parents[j]`
    node j's parent) matches from its start: greedy acceptance, given the target's argmax at each node."""
    node = 0
    for depth, token in enumerate(emitted):
        node = next((j for j in range(1, len(tokens)) if parents[j] == node and tokens[j] == token), -1)
        if node < 0:
            return depth
    return len(emitted)


@dataclass
class FirstGuesses:
    """A catch-up's first guesses (`SpecDecoder.flush`), waiting for the tokens they guess: the guess at position t
    is the draft's top token for position t + 2 (t + 1 is the catch-up's own input there)."""

    rows: list[tuple[Sequence, int, int]]  # per row: the sequence, and the positions [start, end) caught up on
    guesses: HostCopy  # [N, C] int64, being copied to the host

    def is_due(self) -> bool:
        """Whether every row's guessed tokens are known (or its sequence ended), and the copy is made."""
        return all(s.is_finished or len(s.token_ids) >= end + 2 for s, _, end in self.rows) and self.guesses.is_ready()

    def score(self, forced: str | None) -> tuple[int, int]:
        """(right, scored) over the positions whose guessed token is known. Forced acceptance (benchmarks): a forced
        draft's first token is the continuation (right) or never it (wrong), whatever the draft guessed."""
        table = self.guesses.wait().numpy()  # [N, C]
        right = scored = 0
        for (seq, start, end), row in zip(self.rows, table, strict=True):
            known = min(end, len(seq.token_ids) - 2) - start  # positions start .. start + known − 1
            if known > 0:
                scored += known
                right += int(np.count_nonzero(row[:known] == seq.token_ids[start + 2 : start + 2 + known]))
        return {None: right, "wrong": 0}.get(forced, scored), scored


# (the drafted tree, the sequences' slots [N] int64) → the tree to verify (tests and forced-acceptance runs).
TreeOverride = Callable[[DraftTree, torch.Tensor], DraftTree]


class SpecDecoder:
    """Owned by the ModelRunner. The draft's K/V lives in two `[num_pages, page_size, HK, Dh]` tensors that share the
    target's `attn` block table (draft position t uses the page of target position t); `last_hidden` `[S, H]` holds,
    per state slot, the draft output at the sequence's last cached position: what the next tree grows from.

    Draft position t holds (token t + 1, target feature at t). The draft catches up on the positions a target step
    cached: `catch_up` after PREFILL (chunk [s, e) gives tokens [s + 1, e + 1), the last one the token just sampled
    where the chunk ends the sequence), `extend_after_verify` inside VERIFY. A plain DECODE step does not run the
    draft: `store_features` (inside the decode CUDA graph, or eagerly) keeps its target features in `missed_features`
    (a ring of `ring` positions per slot: `EngineConfig.spec_feature_ring`), and `flush` runs one draft forward over
    every position a sequence missed (its tokens are on the host) before the draft is next needed: a VERIFY step, a
    PREFILL chunk of the sequence, or a decode step that would wrap the ring onto an unseen position (`before_decode`;
    a step launched ahead catches up to the position before it behind the step in flight: `plan_decode_ahead`).
    `draft_len[slot]` (host) counts the positions the draft cache holds. A preempted sequence recomputes through
    prefill, so its draft cache is rebuilt the same way.
    """

    def __init__(
        self,
        runner: ModelRunner,
        draft: Eagle3DraftModel,
        shapes: list[DraftShape],
        adaptive: bool = True,
        forced: str | None = None,
        *,
        ring: int,
        max_flush_tokens: int,
        forced_depth: int | None = None,
    ) -> None:
        if forced is not None and forced not in FORCED_MODES:
            raise ValueError(f"forced acceptance: {forced!r} is not one of {', '.join(FORCED_MODES)}")
        if forced_depth is not None and (forced != "all" or forced_depth < 0):
            raise ValueError(f"forced depth: {forced_depth} needs forced acceptance 'all' and a depth ≥ 0")
        self.runner = runner
        self.draft = draft
        self.shapes = shapes
        self.drafters = [Drafter(draft, s.topk, s.num_steps, s.num_draft_tokens) for s in shapes]
        self.verifier = Verifier(runner.model, draft.capture_layers)
        self.capture_layers = draft.capture_layers
        plan, device = runner.plan, runner.device
        attn = draft.midlayer.self_attn
        dtype = draft.fc.weight.dtype
        shape = (plan.num_pages, plan.page_size, attn.num_kv_heads, attn.head_dim)  # [num_pages, page_size, HK, Dh]
        self.k_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=device)
        draft.bind_cache(self.k_cache, self.v_cache)
        self.last_hidden = torch.zeros(plan.num_slots, draft.config.hidden_size, dtype=dtype, device=device)  # [S, H]
        # Target features of positions plain decode steps cached and the draft has not seen: capture layer l's
        # feature at position t of the sequence in slot s at [s, t % ring, l], [S, ring, L, H_t].
        self.ring = ring
        # A catch-up forward holds at most max_flush_tokens (the engine's step budget, which its activations were
        # sized for) in rows of up to a ring's length: more rows are caught up in several forwards.
        self.max_flush_tokens = max_flush_tokens
        self.rows_per_flush = max(1, max_flush_tokens // ring)
        missed_shape = (plan.num_slots, ring, len(self.capture_layers), runner.config.hidden_size)
        self.missed_features = torch.zeros(missed_shape, dtype=runner.dtype, device=device)
        self.draft_len = np.zeros(plan.num_slots, dtype=np.int64)  # per slot: positions [0, draft_len) are drafted
        self.policy = AdaptivePolicy(shapes, adaptive)
        self.stats = SpecStats()
        self.tree_override: TreeOverride | None = None
        self._next_option: int | None = None  # the policy's choice made ahead (`plan_decode_ahead`), not yet used
        # Steps launched ahead that `plan_decode_ahead` may still take without looking for rings to catch up: a run
        # of them starts with a step launched from the host (`before_decode`, which resets it) and keeps its rows or
        # fewer, each one position further a step; only a catch-up changes `draft_len` meanwhile, and it only grows.
        self._unwrapped_ahead = 0
        # Forced acceptance (benchmarks): every node's token is the sequence's known continuation ("right", "all") or
        # that token + 1 ("wrong"), looked up by slot and position in a table filled when a sequence takes its slot.
        self.forced = forced
        self.forced_depth = forced_depth  # "all": accept at most this many drafts a step (None: the whole path)
        # request_id → prompt + its greedy continuation: a list, or its row made beforehand (`forced_row`)
        self.forced_continuations: dict[str, list[int] | torch.Tensor] = {}
        num_forced = plan.max_model_len + max(s.num_draft_tokens for s in shapes) if forced else 1
        self.forced_tokens = torch.zeros(plan.num_slots, num_forced, dtype=torch.int64, device=device)  # [S, L]
        self.graphs = None  # a SpecGraphRunner once `capture_graphs` ran
        # Whether the last VERIFY step first caught the draft up on positions plain steps cached: a step off the
        # steady state of verifying every step, which the policy does not time (`AdaptivePolicy`).
        self.verify_caught_up = False
        self.shadows: list[ShadowDraft] = []  # shadow explorations' drafts not yet scored (`resolve_shadows`)
        self.first_guesses: list[FirstGuesses] = []  # catch-ups' first guesses not yet scored (`resolve_shadows`)
        # Engine steps not to time: a shadow step (its draft and catch-up are not plain decoding's) and the one whose
        # call launched it (the host launched them during that step's time)
        self._untimed_steps = 0

    # ---- bookkeeping ----

    def on_claim(self, seq: Sequence, slot: int) -> None:
        """A sequence took `slot` (it starts from position 0): load its forced continuation (forced-acceptance runs)."""
        self.draft_len[slot] = 0
        if self.forced is None:
            return
        tokens = self.forced_continuations.get(seq.request_id)
        if tokens is None:
            raise ValueError(f"forced acceptance: no continuation given for request {seq.request_id!r}")
        row = tokens if isinstance(tokens, torch.Tensor) else self.forced_row(tokens)
        self.forced_tokens[slot].copy_(row, non_blocking=True)  # queued behind the step in flight, not waited for

    def forced_row(self, tokens: list[int]) -> torch.Tensor:
        """A forced continuation as the row `on_claim` copies into the device table (pinned on a GPU, so that the copy
        waits for nothing). Benchmarks make it before the run they time (session 51: made at the claim, it cost the
        H200 host ~100 µs a request, 7% of a batch-1 prefill step of the default pair)."""
        row = torch.zeros(self.forced_tokens.shape[1], dtype=torch.int64)
        tokens = tokens[: row.shape[0]]
        row[: len(tokens)] = torch.tensor(tokens, dtype=torch.int64)
        return row.pin_memory() if self.forced_tokens.is_cuda else row

    def verify_options(self, seqs: list[Sequence]) -> list[tuple[int, int]]:
        """VerifyPlanner: the chosen shape then the smaller ones; none when a request wants log-probs (their
        per-token log-probs come from the plain path) or the policy prefers plain decoding."""
        if any(s.sampling_params.logprobs is not None for s in seqs):
            return []
        option, self._next_option = self._next_option, None
        if option is None:
            option = self.policy.choose(len(seqs))
        if option < 0:
            return []
        return [(i, self.shapes[i].num_draft_tokens) for i in range(option, len(self.shapes))]

    def plan_decode_ahead(self, seqs: list[Sequence], slots_host: np.ndarray, positions_host: np.ndarray) -> bool:
        """Overlap scheduling: may a plain DECODE step of `seqs` caching `positions_host` [N] be launched ahead, before
        the step in flight (which caches the positions before them) is read? Not when the policy, asked for this
        step now, picks a draft shape: the choice is kept for the VERIFY step the scheduler builds next
        (`verify_options`), so the policy decides each step once. Otherwise a sequence whose ring the step would
        wrap catches up first, queued behind the step in flight: on positions up to the one that step caches
        (p − 1), whose tokens the host already holds (the in-flight step's input is the last token postprocessed),
        so the pipeline keeps running; position p − 1's own feature and token follow in the ring. A draft shape that
        the policy explores in shadow drafts here instead, and the plain step is launched (`shadow_draft`)."""
        option = self.policy.choose(len(seqs))
        if option >= 0 and not self.shadow_draft(option, seqs, slots_host, positions_host):
            self._next_option = option
            return False
        if self._unwrapped_ahead > 0:  # no ring of these rows wraps yet: each is one position further than last time
            self._unwrapped_ahead -= 1
            return True
        rows = self.needs_flush(slots_host, positions_host)
        if rows.size:
            self.flush([seqs[i] for i in rows], slots_host[rows], (positions_host[rows] - 1).tolist())
        # The steps launched ahead after this one (the same rows or fewer, one position further each) before a ring
        # could wrap: a row wraps at its first step caching p with p − draft_len ≥ ring.
        self._unwrapped_ahead = int(self.ring - 1 - (positions_host - self.draft_len[slots_host]).max())
        return True

    def record_step(self, option: int, num_seqs: int, seconds: float) -> None:
        if self._untimed_steps > 0:
            self._untimed_steps -= 1
            return
        self.policy.record_step(option, num_seqs, seconds)

    # ---- shadow explorations ----

    def shadow_draft(
        self, shape: int, seqs: list[Sequence], slots_host: np.ndarray, positions_host: np.ndarray
    ) -> bool:
        """Explore draft shape `shape` in shadow for a plain DECODE step launched ahead that caches positions_host
        [N] (p), if the policy allows it (`AdaptivePolicy.shadows`) and every request is greedy: catch the draft up
        to p − 1 and draft each sequence's tree from its root at p − 1 (the token the step in flight takes, already
        on the host), queued behind the step in flight; the trees go to the host, to be scored once plain decoding
        has emitted the drafted positions (`resolve_shadows`). Nothing is verified: the step costs a catch-up and a
        draft instead of a verify step, and the tokens are plain decoding's. Returns whether it drafted."""
        if self.forced == "all" or not self.policy.shadows(shape, batch_bucket(len(seqs))):
            return False
        if not self.runner.sampler.is_all_greedy(slots_host):  # a sampled token says nothing of a draft's odds
            return False
        roots_at = positions_host - 1  # [N]
        self.flush(seqs, slots_host, roots_at.tolist())
        assert (self.draft_len[slots_host] == roots_at).all(), "a shadow draft grows from its root's position"
        host = np.empty((3, len(seqs)), dtype=np.int64)
        host[0] = [s.token_ids[-1] for s in seqs]
        host[1] = roots_at
        host[2] = slots_host
        inputs = self.runner.upload_block(host)  # [3, N]
        if self.graphs is not None and self.tree_override is None and self.graphs.fits(len(seqs)):
            tree = self.graphs.draft(shape, inputs)
        else:
            tree = self._draft_eager(shape, *inputs.unbind(0))
        nodes = torch.stack([tree.tokens, tree.parents.long()])  # [2, N, T_d]
        self.shadows.append(ShadowDraft(shape, seqs, positions_host.copy(), start_host_copy(nodes)))
        self.policy.record_shadow_step(shape, len(seqs))
        self.stats.num_shadow_steps += 1
        self._untimed_steps = 2
        return True

    def resolve_shadows(self) -> None:
        """Score the catch-ups' first guesses whose tokens plain decoding has emitted (`FirstGuesses`, handed to the
        policy's first-guess window) and the shadow drafts likewise (`ShadowDraft.is_due`, their acceptance handed to
        the policy as a verify step's). The engine calls it after each step's tokens are postprocessed, while any are
        pending."""
        waiting = []
        for guesses in self.first_guesses:
            if not guesses.is_due():
                waiting.append(guesses)
                continue
            right, scored = guesses.score(self.forced)
            self.stats.num_first_guesses += scored
            self.stats.num_first_guesses_right += right
            self.policy.record_first_guesses(right, scored)
        self.first_guesses = waiting
        pending = []
        for shadow in self.shadows:
            depth = self.shapes[shadow.shape].max_depth
            if not shadow.is_due(depth):
                pending.append(shadow)
                continue
            accepted = [a for a in shadow.accepted(depth) if a is not None]
            if accepted:
                self.stats.num_shadow_drafts += len(accepted)
                self.stats.num_shadow_accepted += sum(accepted)
                self.policy.record_acceptance(shadow.shape, accepted)
        self.shadows = pending

    # ---- draft catch-up after target steps ----

    def store_features(
        self,
        positions: torch.Tensor,  # [N] int64: the position each sequence cached this step
        slots: torch.Tensor,  # [N] state slots
        aux_hidden_states: list[torch.Tensor],  # the target's features at those positions, one [N, H_t] per layer
    ) -> None:
        """Keep a plain DECODE step's target features for a later `flush` instead of running the draft: inside the
        decode CUDA graph, or eagerly after an ungraphed step."""
        store_features(self.missed_features, aux_hidden_states, slots, positions)  # one launch (Triton)

    def before_decode(self, seqs: list[Sequence], slots_host: np.ndarray, positions_host: np.ndarray) -> None:
        """Before a plain DECODE step caches position p (positions_host [N] int64, slots_host [N]): a sequence whose
        ring would wrap onto a position the draft has not seen (p − draft_len ≥ ring) catches up first."""
        self._unwrapped_ahead = 0  # a new run of steps launched ahead checks its rows afresh
        rows = self.needs_flush(slots_host, positions_host)
        if rows.size:
            self.flush([seqs[i] for i in rows], slots_host[rows], positions_host[rows].tolist())

    def needs_flush(self, slots_host: np.ndarray, positions_host: np.ndarray) -> np.ndarray:
        """Rows whose ring a step caching `positions_host` would wrap onto a position the draft has not seen."""
        return (positions_host - self.draft_len[slots_host] >= self.ring).nonzero()[0]  # [rows] (1-D: no ravel)

    def flush(self, seqs: list[Sequence], slots_host: np.ndarray, ends: list[int]) -> int:
        """Catch the draft up on positions [draft_len, end) of each sequence (what plain decode steps skipped), in
        one draft forward per `rows_per_flush` sequences: position t takes (token t + 1 from the host, the stored
        feature at t). Rows of the narrowest captured width that holds the longest catch-up (a ring's, or
        SHORT_FLUSH_WIDTH's: `SpecGraphRunner.flush_width`) replayed as a CUDA graph where one is captured for the
        rows, else rows of the longest catch-up, eagerly. Returns how many sequences had positions to catch up on."""
        todo = [(seq, slot, end) for seq, slot, end in zip(seqs, slots_host.tolist(), ends, strict=True)
                if self.draft_len[slot] < end]  # fmt: skip
        for begin in range(0, len(todo), self.rows_per_flush):
            self._flush_rows_of(todo[begin : begin + self.rows_per_flush])
        return len(todo)

    def _flush_rows_of(self, todo: list[tuple[Sequence, int, int]]) -> None:
        """One catch-up forward for (sequence, slot, end) rows: their inputs built on the host in the layout of the
        flush graph's block (`flush_block_views`, padding rows zero) and moved by one copy."""
        starts = [int(self.draft_len[slot]) for _, slot, _ in todo]
        lens = [end - start for (_, _, end), start in zip(todo, starts, strict=True)]
        assert max(lens) <= self.ring, "a sequence missed more positions than its ring holds"
        num_seqs = len(todo)
        self.stats.num_catch_ups += 1
        width = self.graphs.flush_width(num_seqs, max(lens)) if self.graphs is not None else None
        graphs = self.graphs if width is not None else None
        width = width or max(lens)
        num_rows = graphs.bucket(num_seqs) if graphs is not None else num_seqs
        host = np.zeros(flush_block_size(num_rows, width), dtype=np.int64)
        ids, starts_h, valid_h, slots_h = flush_block_views(host, num_rows, width)
        for i, ((seq, _, end), start) in enumerate(zip(todo, starts, strict=True)):
            ids[i, : end - start] = seq.token_ids[start + 1 : end + 1]
        starts_h[:num_seqs], valid_h[:num_seqs], slots_h[:num_seqs] = starts, lens, [slot for _, slot, _ in todo]
        if graphs is not None:
            guesses = graphs.flush(host, num_rows, width)
        else:
            inputs = flush_block_views(self.runner.uploads.upload(host), num_rows, width)
            guesses = inputs[0].new_empty(inputs[0].shape) if takes_first_guesses(num_rows, width) else None
            self.flush_rows(*inputs, guesses)
        if guesses is not None:
            rows = [(seq, start, end) for (seq, _, end), start in zip(todo, starts, strict=True)]
            self.first_guesses.append(FirstGuesses(rows, start_host_copy(guesses[:num_seqs])))
        for _, slot, end in todo:
            self.draft_len[slot] = end

    def flush_rows(
        self,
        ids: torch.Tensor,  # [N, C] int64: token t + 1 for positions start .. start + C − 1 (the first `valid` count)
        starts: torch.Tensor,  # [N] int64: each row's first missed position (its draft_len)
        valid: torch.Tensor,  # [N] int64: missed positions per row (0 for padding rows)
        slots: torch.Tensor,  # [N] int64 (0 for padding rows)
        guesses: torch.Tensor | None = None,  # [N, C] int64 out: the draft's first guess at each position
    ) -> None:
        """The catch-up's device part (what a flush graph captures): one draft forward of N rows of C tokens, the
        first `valid` of each stored and counted; a row with none keeps its draft output. With `guesses`, the draft's
        top token at every position too (`FIRST_GUESS_WINDOW`)."""
        width = ids.shape[1]
        positions = starts[:, None] + torch.arange(width, device=ids.device)  # [N, C]
        index = (slots[:, None].expand(-1, width), positions % self.ring)
        features = list(self.missed_features[index].flatten(0, 1).unbind(1))  # one [N*C, H_t] per capture layer
        kv = DraftKV(self.runner.block_table[slots], self.runner.page_size)
        hidden = self.drafters[0].extend_rows(ids, features, starts, kv, valid, guesses)  # [N, H]
        self.last_hidden[slots] = torch.where((valid > 0)[:, None], hidden, self.last_hidden[slots])

    def before_prefill(self, seqs: list[Sequence], slots_host: np.ndarray, starts: list[int], lens: list[int]) -> None:
        """Before `catch_up` on PREFILL chunks [s, s + n): flush what each sequence missed before s; afterwards the
        draft holds [0, s + n). A draft shape the policy chose ahead (`plan_decode_ahead`) was for a decode step that
        this PREFILL step (an admission after the drain) replaced: it is dropped, not applied to a later batch."""
        self._next_option = None
        self.flush(seqs, slots_host, starts)
        for slot, start, n in zip(slots_host.tolist(), starts, lens, strict=True):
            assert self.draft_len[slot] == start, "the draft cache must reach a prefill chunk's start"
            self.draft_len[slot] = start + n

    def catch_up(
        self,
        next_ids: torch.Tensor,  # [T] int64: token t + 1 for each new position t
        aux_hidden_states: list[torch.Tensor],  # the target's features at those positions, one [T, H_t] per layer
        cu_seqlens: torch.Tensor,  # [N+1]
        starts: torch.Tensor,  # [N] int64: first new position of each sequence
        slots: torch.Tensor,  # [N] int64
        max_seqlen_q: int,
        next_embeds: torch.Tensor | None = None,  # [T, H]: the embeddings of next_ids where a VLM prompt has images
    ) -> None:
        kv = DraftKV(self.runner.block_table[slots], self.runner.page_size)
        hidden = self.drafters[0].extend(
            next_ids, aux_hidden_states, cu_seqlens, starts, kv, max_seqlen_q, input_embeds=next_embeds
        )  # [N, H]
        self.last_hidden[slots] = hidden

    def catch_up_prefill(
        self,
        next_ids: torch.Tensor,  # [T] int64: token t + 1 for each new position t
        aux_hidden_states: list[torch.Tensor],  # the target's features at those positions, one [T, H_t] per layer
        fb: ForwardBatch,  # the target's PREFILL batch: its positions, and its `attn` K/V metadata for the draft's
        slots: torch.Tensor,  # [N] int64
        next_embeds: torch.Tensor | None = None,  # [T, H]: the embeddings of next_ids where a VLM prompt has images
    ) -> None:
        """`catch_up` in the target's own forward batch (`Drafter.extend_in`): the draft's pages are the `attn`
        layers' (`DraftKV`), so the step's slot mapping and block tables are the draft's too."""
        self.last_hidden[slots] = self.drafters[0].extend_in(next_ids, aux_hidden_states, fb, next_embeds)  # [N, H]

    # ---- the VERIFY step ----

    def draft_tree(
        self, shape: int, roots: torch.Tensor, prefix: torch.Tensor, slots: torch.Tensor, out: DraftTree | None = None
    ) -> DraftTree:
        """Draft each sequence's tree: roots [N] (its last token), prefix [N] int64 (its cached tokens = the root's
        position), slots [N] int64 (0 for padded rows); into `out` when given (`Drafter.draft_tree`'s)."""
        kv = DraftKV(self.runner.block_table[slots], self.runner.page_size)
        tree = self.drafters[shape].draft_tree(self.last_hidden[slots], roots, prefix, kv, out)
        if self.forced is not None:
            table = self.forced_tokens
            right = table[slots[:, None], tree.positions.clamp(max=table.shape[1] - 1)]  # [N, T_d]
            if self.forced == "wrong":
                right = (right + 1) % self.runner.config.vocab_size
            tree.tokens[:, 1:].copy_(right[:, 1:])
        return tree

    def verify(
        self,
        shape: int,
        tree: DraftTree,
        prefix: torch.Tensor,
        slots: torch.Tensor,
        sampling: SamplingRows | None,
        next_inputs: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Verify `tree` with the target, commit the accepted paths, catch the draft up on them. Returns [N, T_d + 2]
        int64: the emitted tokens (accepted drafts then the bonus, -1 after), the accepted node count (root
        included) and the tree's depth, per sequence — read with one host transfer. `next_inputs` = (roots [N],
        cached [N]) int64 (a graph's static inputs): set to a next verify step's, the bonus token (0 on a padded
        row) and the cached prefix advanced by the accepted count, from the acceptance's own outputs (what
        `next_tree_inputs` reads back out of the result row in five launches)."""
        is_chain = self.shapes[shape].topk == 1
        fb = self.verifier.forward_batch(tree, prefix, slots.to(torch.int32), self.runner.verify_kv_metadata, is_chain)
        forced = self._accept_all(shape, tree, slots) if self.forced == "all" else None
        out = self.verifier.verify(fb, tree, sampling, is_chain=is_chain, forced=forced)
        kv = DraftKV(self.runner.block_table[slots], self.runner.page_size)
        emitted = out.emitted_tokens(tree)  # [N, T_d]
        hidden = self.drafters[shape].extend_after_verify(
            tree, out.accepted_nodes, out.num_accepted, emitted, out.aux_hidden_states, kv, is_chain=is_chain
        )  # [N, H]
        self.last_hidden[slots] = hidden
        if next_inputs is not None:
            roots, cached = next_inputs
            torch.mul(out.bonus, out.num_accepted > 0, out=roots)  # a padded row's bonus is not a token: 0
            cached.add_(out.num_accepted)
        if out.result is not None:  # made by the acceptance (greedy)
            return out.result
        depth = tree.depths.max(dim=1, keepdim=True).values.long()  # [N, 1]
        return torch.cat([emitted, out.num_accepted.long()[:, None], depth], dim=1)

    def _accept_all(
        self, shape: int, tree: DraftTree, slots: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Forced "all": each row accepts the path to its tree's first deepest node, or its first `forced_depth`
        nodes after the root (every node's token is the continuation's at its position, `draft_tree`), and the bonus
        is the continuation's next token. Returns what the acceptance kernels do: accepted nodes [N, T_d] int32 (root
        first, -1 after), their count [N] int32 and the bonus [N] int64."""
        num_nodes = tree.tokens.shape[1]
        full = tree.depths.max(dim=1).values.long()  # [N]
        deepest = tree.depths.argmax(dim=1)  # [N]: the first node of that depth
        up = [deepest]
        for _ in range(self.shapes[shape].max_depth):
            up.append(tree.parents.gather(1, up[-1][:, None]).squeeze(1).long().clamp(min=0))
        up = torch.stack(up, dim=1)  # [N, D + 1]: the deepest node, its parent, ..., the root (repeated past it)
        j = self.verifier.constants.arange(num_nodes, full.device)  # [T_d]
        ancestors = up.gather(1, (full[:, None] - j).clamp(0, up.shape[1] - 1))  # [N, T_d]: the path's node j
        depth = full if self.forced_depth is None else full.clamp(max=self.forced_depth)  # [N]: accepted drafts
        accepted = torch.where(j <= depth[:, None], ancestors, -1).to(torch.int32)
        last = ancestors.gather(1, depth[:, None])  # [N, 1]: the last accepted node
        after = tree.positions.gather(1, last).squeeze(1) + 1  # [N]: the bonus token's position
        bonus = self.forced_tokens[slots, after.clamp(max=self.forced_tokens.shape[1] - 1)]  # [N]
        return accepted, (depth + 1).to(torch.int32), bonus

    def launch_verify(
        self, seqs: list[Sequence], slots_host: np.ndarray, shape: int, is_all_greedy: bool
    ) -> VerifyLaunch:
        """Queue a VERIFY step for `seqs` (their pages for the tree reserved) whose inputs come from the host: each
        sequence's last token as the root, its cached length as the prefix; the draft first catches up on what plain
        steps cached (`flush`). Returns without waiting for the result (`finish_verify` reads it)."""
        host = np.empty((3, len(seqs)), dtype=np.int64)
        host[0] = [s.token_ids[-1] for s in seqs]
        host[1] = [s.num_computed_tokens for s in seqs]
        host[2] = slots_host
        inputs = self.runner.upload_block(host)  # [3, N]
        roots, prefix, slots = inputs.unbind(0)
        timer = self._phase_timer()
        timer.mark()
        self.verify_caught_up = self.flush(seqs, slots_host, host[1].tolist()) > 0
        use_graphs = self.graphs is not None and self.tree_override is None and self.graphs.fits(len(seqs))
        timer.mark()
        if use_graphs:
            tree = self.graphs.draft(shape, inputs, host)
        else:
            tree = self._draft_eager(shape, roots, prefix, slots)
        timer.mark()
        if use_graphs:
            result = self.graphs.verify(shape, len(seqs), is_all_greedy)
        else:
            result = self._verify_eager(shape, tree, prefix, slots, is_all_greedy)
        timer.mark()
        return VerifyLaunch.start(seqs, slots_host, shape, is_all_greedy, use_graphs, result, prefix, slots, timer)

    def launch_verify_next(self, prev: VerifyLaunch) -> VerifyLaunch:
        """Queue the VERIFY step after `prev` (queued, not yet read) for the same sequences and draft shape, from
        `prev`'s result on the device: each row's root is the bonus token `prev` emits, its prefix is `prev`'s moved
        past the accepted path, and the draft already holds that path (`prev` caught it up), so nothing waits for
        the host. The caller reserved the pages of the longest path `prev` may accept plus this step's tree."""
        shape, N = prev.shape, len(prev.seqs)
        timer = self._phase_timer()
        timer.mark()
        self.verify_caught_up = False
        timer.mark()
        if prev.use_graphs:  # the graph of `prev` left the next inputs in the static buffers
            self.graphs.draft_next(shape, N)
            timer.mark()
            result = self.graphs.verify(shape, N, prev.is_all_greedy)
            prefix = slots = None
        else:
            roots, count = next_tree_inputs(prev.result, self.shapes[shape].num_draft_tokens)  # [N] each
            prefix, slots = prev.prefix + count, prev.slots
            tree = self._draft_eager(shape, roots, prefix, slots)
            timer.mark()
            result = self._verify_eager(shape, tree, prefix, slots, prev.is_all_greedy)
        timer.mark()
        return VerifyLaunch.start(prev.seqs, prev.slots_host, shape, prev.is_all_greedy, prev.use_graphs, result,
                                  prefix, slots, timer, is_ahead=True)  # fmt: skip

    def _draft_eager(self, shape: int, roots: torch.Tensor, prefix: torch.Tensor, slots: torch.Tensor) -> DraftTree:
        tree = self.draft_tree(shape, roots, prefix, slots)
        return tree if self.tree_override is None else self.tree_override(tree, slots)

    def _verify_eager(
        self, shape: int, tree: DraftTree, prefix: torch.Tensor, slots: torch.Tensor, is_all_greedy: bool
    ) -> torch.Tensor:
        sampling = None if is_all_greedy else self.runner.sampler.rows(slots, prefix + 1)
        return self.verify(shape, tree, prefix, slots, sampling)

    def _phase_timer(self) -> _PhaseTimer:
        """The phase timer of the verify step launched now: every PHASE_TIMING_EVERY-th launch, the first included
        (counted at launch: the steps launched ahead are read after the next launch)."""
        enabled = self.stats.num_verify_launches % PHASE_TIMING_EVERY == 0
        self.stats.num_verify_launches += 1
        return _PhaseTimer(self.runner.device, enabled=enabled)

    def finish_verify(self, launch: VerifyLaunch, rows: list[int], followed: bool) -> list[list[int]]:
        """Read `launch`'s result (the step's one synchronisation) and account for its `rows`: the sequences still
        running, whose progress is the launch's own (the step before it was postprocessed). Returns each row's
        emitted tokens (accepted drafts then the bonus). Unless a verify step was launched after it (`followed`), the
        trees of a next verify step of the same rows are drafted now, while the host postprocesses (graphs only)."""
        results = launch.result_rows()
        if not rows:
            return []
        shape = launch.shape
        num_nodes = self.shapes[shape].num_draft_tokens
        picked = [results[i] for i in rows]
        emitted = [row[: row[num_nodes]] for row in picked]  # accepted drafts then the bonus: one per accepted node
        seqs = [launch.seqs[i] for i in rows]
        slots_host = launch.slots_host[rows]  # [n]
        cached = np.fromiter((s.num_computed_tokens + len(e) for s, e in zip(seqs, emitted, strict=True)),
                             dtype=np.int64, count=len(rows))  # fmt: skip
        self.draft_len[slots_host] = cached
        if launch.use_graphs and not followed and len(rows) == len(launch.seqs):
            bonus = np.fromiter((tokens[-1] for tokens in emitted), dtype=np.int64, count=len(emitted))  # [N]
            self.graphs.draft_ahead(shape, np.stack([bonus, cached, slots_host]))
        accepted_drafts = [len(tokens) - 1 for tokens in emitted]
        self.stats.add(num_nodes, accepted_drafts, [row[num_nodes + 1] for row in picked])
        self.stats.num_verify_steps_ahead += launch.is_ahead
        timer = launch.timer
        if timer.enabled:
            flush_s, draft_s, verify_s = timer.seconds()
            self.stats.timed_verify_steps += 1
            self.stats.draft_seconds += flush_s + draft_s
            self.stats.verify_seconds += verify_s
        self.policy.record_acceptance(shape, accepted_drafts)
        return emitted

    def run_verify(
        self, seqs: list[Sequence], slots_host: np.ndarray, shape: int, is_all_greedy: bool
    ) -> list[list[int]]:
        """One VERIFY step for `seqs` (their pages for the tree reserved), waited for. Returns each sequence's emitted
        tokens."""
        launch = self.launch_verify(seqs, slots_host, shape, is_all_greedy)
        return self.finish_verify(launch, list(range(len(seqs))), followed=False)

    def plan_verify_ahead(self, num_seqs: int, shape: int) -> bool:
        """Overlap scheduling: may the VERIFY step after the one in flight (`shape`, the same `num_seqs` sequences) be
        launched before that one is read? Only when the policy, asked for this step now, picks the same shape;
        otherwise its choice is kept for the step the scheduler builds next (`verify_options`), as in
        `plan_decode_ahead`."""
        option = self.policy.choose(num_seqs)
        if option == shape:
            return True
        self._next_option = option
        return False

    def capture_graphs(self, batch_sizes: list[int]) -> None:
        from jetserve.engine.cuda_graph import SpecGraphRunner

        assert self.runner.device.type == "cuda", "CUDA graphs need a CUDA device"
        self.graphs = SpecGraphRunner(self, batch_sizes)
        self.graphs.capture()
