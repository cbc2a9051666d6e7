"""bench/policy_sim.py: the engine's adaptive policy against the step-time model. With a steady host it stays within
its exploration budget of the best option — plain decoding when every draft is wrong (never below 0.98x), the drafts
when they pay (within 2% of the oracle) — and a policy given with --policy is the one simulated."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


SESSION_44_HOST = ("--plain-host-ms", "0.25")  # the plain step's host time the first tests were written against


def simulate(tmp_path, *args: str) -> list[dict]:
    out = tmp_path / f"sim{len(list(tmp_path.iterdir()))}.jsonl"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "bench/policy_sim.py", "--steps", "6000", "--seeds", "2", "--json", str(out), *args]
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_policy_sim_steady_host(tmp_path):
    wrong, wrong_noisy = simulate(tmp_path, "--tau", "1,1", *SESSION_44_HOST)
    assert wrong["slow_factor"] == 1.0 and wrong_noisy["slow_factor"] == 5.0
    assert 0.98 <= wrong["speedup"] <= 1.0 and wrong["shares"]["plain"] > 0.97 and wrong["oracle_speedup"] == 1.0
    paying, _ = simulate(tmp_path, "--tau", "3,2.5", *SESSION_44_HOST)
    assert paying["speedup"] >= 0.98 * paying["oracle_speedup"] and paying["shares"]["plain"] < 0.02
    for row in (wrong, wrong_noisy, paying):
        assert sum(row["shares"].values()) == pytest.approx(1.0, abs=1e-3)
        assert row["speedup"] <= row["oracle_speedup"] + 1e-9


class AlwaysPlain:
    """A policy that never speculates (for the --policy test)."""

    def __init__(self, shapes, adaptive):
        pass

    def choose(self, num_seqs):
        return -1

    def record_step(self, option, num_seqs, seconds):
        pass

    def record_acceptance(self, option, accepted):
        raise AssertionError("plain decoding accepts no drafts")


def test_policy_sim_takes_a_policy_class(tmp_path):
    rows = simulate(tmp_path, "--policy", "tests.bench.test_policy_sim:AlwaysPlain")
    for row in rows:
        assert row["shares"]["plain"] == 1.0 and row["speedup"] == pytest.approx(1.0, abs=1e-3)


def test_confirmed_switches_hold_through_host_stalls(tmp_path):
    """The candidate `ConfirmedSwitchPolicy` (a switch that no exploration made is confirmed by running both options
    a few steps apart before it is taken): the same as the engine's policy with a steady host, and closer to the
    oracle when the host stalls (5x slower for ~20 steps every ~600) with drafts that pay. With wrong drafts the
    engine's policy holds through the stalls as well since session 51 (a shape is weighed no faster than plain
    decoding, `AdaptivePolicy.weighed_seconds`: 0.947x → 0.992x here)."""
    for tau, margin in (("1,1", 0.0), ("3,2.5", 0.02)):
        engine_steady, engine_stalls = simulate(tmp_path, "--tau", tau, *SESSION_44_HOST)
        steady, stalls = simulate(tmp_path, "--tau", tau, *SESSION_44_HOST, "--policy", "ConfirmedSwitchPolicy")
        assert steady["speedup"] == pytest.approx(engine_steady["speedup"], abs=0.005)
        assert stalls["speedup"] >= engine_stalls["speedup"] + margin
        assert stalls["speedup"] >= 0.95 * stalls["oracle_speedup"]
    assert engine_stalls["speedup"] < 0.9 * engine_stalls["oracle_speedup"]  # drafts that pay: the engine's policy
    assert simulate(tmp_path, "--tau", "1,1", *SESSION_44_HOST)[1]["speedup"] >= 0.98  # wrong drafts


def test_drawn_acceptance_and_the_fresh_exploration_candidate(tmp_path):
    """`--accept-rate`: acceptance drawn depth by depth (one draw a step, a chain of 3 taking min(a, 3)). Drafts that
    never pay (rate 0) leave plain decoding's speed within the exploration budget; drafts that start to pay halfway
    (0 → 0.9) beat plain decoding. The `FreshExplorationPolicy` candidate (explorations up to 4,096 steps apart, an
    explored shape's acceptance window restarted) explores wrong drafts less and finds the paying ones sooner."""
    wrong, _ = simulate(tmp_path, "--accept-rate", "0")
    assert 0.97 <= wrong["speedup"] <= 1.0 and wrong["oracle_speedup"] == 1.0 and wrong["accept_rate"] == [0.0, 0.0]
    turn, _ = simulate(tmp_path, "--accept-rate", "0,0.9")
    assert turn["oracle_speedup"] > 1.2 and 1.0 < turn["speedup"] <= turn["oracle_speedup"] + 1e-9
    fresh_wrong, _ = simulate(tmp_path, "--accept-rate", "0", "--policy", "FreshExplorationPolicy")
    fresh_turn, _ = simulate(tmp_path, "--accept-rate", "0,0.9", "--policy", "FreshExplorationPolicy")
    assert fresh_wrong["shares"]["plain"] > wrong["shares"]["plain"] and fresh_wrong["speedup"] >= wrong["speedup"]
    assert fresh_turn["speedup"] > turn["speedup"]


def test_the_engine_policy_runs_no_chain_that_cannot_win(tmp_path):
    """The engine's policy (`AdaptivePolicy.cannot_win`, session 48; session 45's `BoundedExplorationPolicy`
    candidate): with every draft wrong the chain of 3 measures no acceptance, which bounds the chain of 7 below plain
    decoding, so with a steady host the chain of 7 never runs; drafts that start to pay halfway lift the bound at the
    chain of 3's next exploration and the chain of 7 takes over; drafts that always pay leave nothing bounded away."""
    wrong, _ = simulate(tmp_path, "--accept-rate", "0")
    assert wrong["shares"]["1x7"] == 0.0 and wrong["speedup"] >= 0.98
    turn, _ = simulate(tmp_path, "--accept-rate", "0,0.9")
    assert turn["shares"]["1x7"] > 0.1 and turn["speedup"] > 1.15
    paying, _ = simulate(tmp_path, "--accept-rate", "0.9")
    assert paying["shares"]["1x7"] > 0.9


def test_shadow_explorations_cost_less_where_drafts_lose_and_nothing_where_they_may_win(tmp_path):
    """`--shadow` (the engine's shadow explorations, session 55: `AdaptivePolicy.shadows`): an exploration of a shape
    estimated well below plain decoding runs as plain steps that also draft. Wrong drafts cost less than verify-step
    explorations (about the same choices — a shadow step is timed at the shape's median, not at a slow stretch's
    step time — and cheaper steps); drafts near plain decoding's rate are still verified, so that run is unchanged;
    drafts that start to pay are followed as before."""
    verified, _ = simulate(tmp_path, "--tau", "1,1")
    shadowed, _ = simulate(tmp_path, "--tau", "1,1", "--shadow")
    assert shadowed["shadow"] and not verified["shadow"]
    assert shadowed["shares"]["plain"] == pytest.approx(verified["shares"]["plain"], abs=0.002)
    assert shadowed["speedup"] > verified["speedup"] + 0.004 and shadowed["speedup"] <= 1.0
    near, _ = simulate(tmp_path, "--tau", "2.9,2.4")
    near_shadowed, _ = simulate(tmp_path, "--tau", "2.9,2.4", "--shadow")
    assert near_shadowed["speedup"] == pytest.approx(near["speedup"], abs=1e-3)
    turn, _ = simulate(tmp_path, "--accept-rate", "0,0.9")
    turn_shadowed, _ = simulate(tmp_path, "--accept-rate", "0,0.9", "--shadow")
    assert turn_shadowed["speedup"] >= turn["speedup"] - 1e-3 and turn_shadowed["shares"]["1x7"] > 0.1


def test_first_guesses_spare_explorations_of_drafts_that_lose_and_follow_drafts_that_turn(tmp_path):
    """`--first-guesses` (the engine's catch-ups score the draft's first guesses, `record_first_guesses`): with every
    draft wrong the chains are bound below plain decoding without being verified, so explorations stop costing;
    drafts that start to pay halfway are found as soon as the guesses turn (their chain explored at once)."""
    wrong, _ = simulate(tmp_path, "--accept-rate", "0")
    wrong_guessed, _ = simulate(tmp_path, "--accept-rate", "0", "--first-guesses")
    assert wrong_guessed["first_guesses"] and not wrong["first_guesses"]
    assert wrong_guessed["speedup"] > wrong["speedup"] + 0.005 and wrong_guessed["shares"]["plain"] > 0.998
    turn, _ = simulate(tmp_path, "--accept-rate", "0,0.9")
    turn_guessed, _ = simulate(tmp_path, "--accept-rate", "0,0.9", "--first-guesses")
    assert turn_guessed["speedup"] >= turn["speedup"] - 0.01 and turn_guessed["shares"]["1x7"] > 0.3


def test_first_guesses_with_requests_shorter_than_the_ring_still_follow_drafts_that_turn(tmp_path):
    """`--request-len 96`: the draft catches up (and scores guesses) only at explorations, which the guesses stop once
    they rule every chain out. The guesses expire (FIRST_GUESS_MAX_AGE) and a shape is shadowed only if it loses even
    at its best, so drafts that start to pay halfway are still found (before either: 0.999x, never speculating again);
    wrong drafts stay near plain decoding."""
    turn, turn_noisy = simulate(tmp_path, "--steps", "12000", "--accept-rate", "0,0.9", "--shadow", "--first-guesses",
                                "--request-len", "96")  # fmt: skip
    assert turn["request_len"] == 96 and turn["speedup"] > 1.25 and turn_noisy["speedup"] > 1.2
    assert turn["shares"]["1x7"] > 0.2
    wrong, _ = simulate(tmp_path, "--accept-rate", "0", "--shadow", "--first-guesses", "--request-len", "96")
    assert wrong["speedup"] > 0.99 and wrong["shares"]["plain"] > 0.99


def test_a_shadow_steps_host_time_is_charged(tmp_path):
    """`--shadow-host-ms`: the host time a shadow step costs beyond a plain step and its draft graph (its catch-up,
    launches and the trees' read-back) slows the wrong drafts' run by about what its shadow steps add, and is
    recorded."""
    free, _ = simulate(tmp_path, "--tau", "1,1", "--shadow")
    charged, _ = simulate(tmp_path, "--tau", "1,1", "--shadow", "--shadow-host-ms", "0.3")
    assert free["shadow_host_ms"] == 0.0 and charged["shadow_host_ms"] == 0.3
    assert charged["shares"]["plain"] == pytest.approx(free["shares"]["plain"], abs=0.002)
    assert free["speedup"] - 0.05 < charged["speedup"] < free["speedup"] - 0.001


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["--request-len", "0", "--first-guesses"], "--request-len"),
        (["--request-len", "96"], "--request-len"),
        (["--shadow-host-ms", "0.3"], "--shadow-host-ms"),
        (["--shadow", "--shadow-host-ms", "-1"], "--shadow-host-ms"),
    ],
)
def test_bad_option_combinations_are_a_one_line_error(args, flag):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "bench/policy_sim.py", *args], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    assert run.returncode == 2 and flag in run.stderr.strip().splitlines()[-1]
