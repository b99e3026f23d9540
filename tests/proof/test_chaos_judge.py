"""The chaos run's pure parts (``loadtest/chaos.py``): the coherence judge, the schedule of faults, the
changes a tenant's state allows, and what fails the run. The run itself is ``make chaos`` (real vLLM)."""

from __future__ import annotations

import math
import random

import pytest

from loadtest.chaos import (
    FAULT_KINDS,
    ROLLOUT_OPS,
    Answer,
    Fault,
    Outcome,
    failures,
    fault_plan,
    fault_points,
    judge,
    next_op,
)


def checked(diffs: list[float], spread: float | None = None, agree: bool = True) -> Outcome:
    out = Outcome(0.0, 1.0, 0, "tenant-0", "completion", 0, status=200, finished=True)
    out.check, out.diffs, out.cold_spread, out.colds_agree = "checked", diffs, spread, agree
    return out


def test_an_answer_with_other_tokens_than_its_agreeing_cold_runs_is_incoherent() -> None:
    warm = Answer("ab", ("a", "b"), (-0.1, -0.2))
    cold = Answer("ac", ("a", "c"), (-0.1, -0.3))
    assert warm.diff(cold) == math.inf
    assert warm.divergence(cold) == (1, 0.0)
    outs = [checked([warm.diff(cold)], spread=0.0), checked([0.0], spread=0.0)]
    assert judge(outs) == 0.0
    assert [o.verdict for o in outs] == ["incoherent", "coherent"]
    assert failures(outs, [Fault(k, "x", 0.0) for k in FAULT_KINDS]) == ["1 incoherent answers"]


def test_the_tolerance_is_the_margin_over_the_cold_to_cold_spread_and_disagreeing_colds_judge_nothing() -> (
    None
):
    near = checked([0.015], spread=0.01)  # within 2 x 0.01
    far = checked([0.5], spread=0.0)
    noisy = checked([math.inf], agree=False)
    tolerance = judge([near, far, noisy])
    assert tolerance == 0.02
    assert (near.verdict, far.verdict, noisy.verdict) == ("coherent", "incoherent", "nondeterministic")


def test_a_run_fails_when_a_fault_kind_never_ran_or_nothing_was_judged() -> None:
    outs = [Outcome(0.0, 1.0, 0, "tenant-0", "chat", 0, status=200, finished=True)]
    found = failures(outs, [Fault("kill-kvgate", "kvgate-0", 0.0)])
    assert found == [
        "fault kinds never injected: kill-worker, restart-redis-aof, restart-redis-empty, restart-vllm",
        "no answer was judged",
    ]


def test_every_fault_kind_runs_in_a_short_run_spread_over_its_requests() -> None:
    for requests in (200, 500, 10_000):
        plan = fault_plan(requests)
        assert set(plan) == set(FAULT_KINDS)
        points = fault_points(plan, requests)
        assert points == sorted(points)
        assert points[0] > 0
        assert points[-1] < requests
    assert len(fault_plan(10_000)) > len(fault_plan(500))


def test_rollout_commands_only_while_a_rollout_runs_and_publishes_only_while_none_does() -> None:
    rng = random.Random(1)
    running = {next_op(rng, True) for _ in range(300)}
    idle = {next_op(rng, False) for _ in range(300)}
    assert running == {op for op, _ in ROLLOUT_OPS}
    assert {"publish", "rollback", "rollout-start"} <= idle
    assert not idle & {"rollout-raise", "promote", "abort"}


def test_an_answer_parting_at_a_near_tie_within_the_tolerance_is_a_tie_and_far_from_it_incoherent() -> None:
    cold = Answer("xab", ("x", "a", "b"), (-0.5, -1.00, -0.3), ({"x": -0.5}, {"a": -1.00, "c": -1.02}, {}))
    flipped = Answer("xcd", ("x", "c", "d"), (-0.51, -1.01, -0.2))  # noise 0.01 turned a 0.02 tie over
    mixed_up = Answer("xcd", ("x", "c", "d"), (-0.9, -1.01, -0.2))  # 0.4 off before it parts
    unrated = Answer("xed", ("x", "e", "d"), (-0.51, -1.01, -0.2))  # a token the cold run does not rate
    assert flipped.tie_gap(cold) == pytest.approx(0.02)
    assert mixed_up.tie_gap(cold) == pytest.approx(0.4)
    assert unrated.tie_gap(cold) is None
    outs = [checked([math.inf], spread=0.015), checked([math.inf]), checked([math.inf])]
    for out, answer in zip(outs, (flipped, mixed_up, unrated), strict=True):
        out.tie_gap = answer.tie_gap(cold)
    assert judge(outs) == pytest.approx(0.03)
    assert [o.verdict for o in outs] == ["tie", "incoherent", "incoherent"]
