"""The live check's window and bound, and what it counts: token counts against ``usage.prompt_tokens``
per replica (a replica past the bound is routed on the predicted index, and returns by itself), and a
precise decision's claim against the answer's ``cached_tokens``. tests/vllm/test_live_check_vllm.py runs
it on the real replicas with the wrong tokenizer and the right one."""

from __future__ import annotations

from gateway.kv.live_check import MIN_CHECKED, LiveCheck, Window
from gateway.request.status_page import kv_event_fields
from gateway.telemetry.metrics import Metrics

R0, R1 = "http://r0", "http://r1"


def sample(metrics: Metrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


def check(window: int = 50, bound: float = 0.2, block: int | None = 128) -> tuple[LiveCheck, Metrics]:
    metrics = Metrics()
    return LiveCheck(metrics, lambda replica: block, window=window, max_mismatch=bound), metrics


def answer(live: LiveCheck, replica: str, *, agree: bool, base: str = "base") -> None:
    live.answered(replica, base, counted=100, reported=100 if agree else 97, precise_blocks=0, cached=0)


def test_a_rate_is_judged_only_once_the_fewest_answers_are_in_the_window() -> None:
    window = Window(50, 0.2)
    changes = [window.add(True) for _ in range(MIN_CHECKED)]
    assert changes == [False] * (MIN_CHECKED - 1) + [True]  # nine mismatches in a row are not yet a rate
    assert window.distrusted
    small = Window(3, 0.2)  # a window smaller than the fewest judged: judged once full
    assert [small.add(True) for _ in range(3)] == [False, False, True]


def test_the_bound_is_passed_only_above_it_and_left_at_half_of_it() -> None:
    window = Window(10, 0.2)
    for mismatch in [False] * 8 + [True, True]:  # 2 of 10: at the bound, not past it
        window.add(mismatch)
    assert (window.mismatched, window.distrusted) == (2, False)
    assert window.add(True)  # the oldest (an agreement) leaves: 3 of 10, past the bound
    assert (window.mismatched, window.distrusted) == (3, True)
    flips = [window.add(False) for _ in range(8)]  # 7 agreements leave, then the first mismatch
    assert (window.mismatched, window.distrusted) == (2, True), "at the bound is not yet half of it"
    flips.append(window.add(False))
    assert (window.mismatched, window.distrusted) == (1, False), "half the bound: trusted again"
    assert flips == [False] * 8 + [True]


def test_a_bound_of_one_never_distrusts() -> None:
    window = Window(10, 1.0)
    for _ in range(30):
        window.add(True)
    assert (window.mismatched, window.distrusted) == (10, False)


def test_checks_are_counted_per_replica_and_base_and_a_replica_past_the_bound_falls_back() -> None:
    live, metrics = check(window=20)
    for _ in range(MIN_CHECKED):
        answer(live, R0, agree=False)
        answer(live, R1, agree=True, base="other")
    assert sample(metrics, "kvgate_token_checks_total", replica=R0, base="base", result="mismatch") == 10
    assert sample(metrics, "kvgate_token_checks_total", replica=R1, base="other", result="match") == 10
    assert sample(metrics, "kvgate_token_checks_total", replica=R1, base="other", result="mismatch") == 0
    assert (live.exact(R0), live.exact(R1), live.exact("http://never-checked")) == (False, True, True)
    assert sample(metrics, "kvgate_token_check_fallback", replica=R0) == 1
    assert sample(metrics, "kvgate_token_check_fallback", replica=R1) == 0
    reason = live.fallback_reason(R0)
    assert reason is not None
    assert "10 of the last 10" in reason
    assert "usage.prompt_tokens" in reason
    assert live.fallback_reason(R1) is None
    assert live.health(R0) == {"checked": 10, "mismatched": 10, "fallback": True}
    assert live.health("http://never-checked") is None
    for _ in range(20):  # the answers agree again: it returns by itself
        answer(live, R0, agree=True)
    assert live.exact(R0)
    assert live.fallback_reason(R0) is None
    assert sample(metrics, "kvgate_token_check_fallback", replica=R0) == 0


def test_answers_without_a_count_on_either_side_are_not_checked() -> None:
    live, metrics = check()
    live.answered(R0, "base", counted=None, reported=12, precise_blocks=0, cached=None)  # not whole
    live.answered(R0, "base", counted=12, reported=None, precise_blocks=0, cached=None)  # no usage
    assert live.health(R0) is None
    assert sample(metrics, "kvgate_token_checks_total", replica=R0, base="base", result="match") == 0


def test_a_precise_claim_is_confirmed_by_the_answers_cached_tokens() -> None:
    live, metrics = check(block=128)
    live.answered(R0, "base", counted=None, reported=500, precise_blocks=3, cached=384)  # all confirmed
    live.answered(R0, "base", counted=None, reported=500, precise_blocks=3, cached=128)  # one of three
    live.answered(R0, "base", counted=None, reported=500, precise_blocks=0, cached=256)  # no claim
    live.answered(R0, "base", counted=None, reported=500, precise_blocks=2, cached=None)  # not reported
    assert sample(metrics, "kvgate_prefix_claimed_tokens_total", replica=R0) == 768
    assert sample(metrics, "kvgate_prefix_confirmed_tokens_total", replica=R0) == 512
    shown = kv_event_fields(metrics.registry.collect())[R0]  # /kvgate/status, per replica
    assert (shown["claimed_tokens"], shown["confirmed_tokens"]) == (768, 512)
    unknown, unknown_metrics = check(block=None)  # no block size known: no claim in tokens
    unknown.answered(R0, "base", counted=None, reported=500, precise_blocks=3, cached=384)
    assert sample(unknown_metrics, "kvgate_prefix_claimed_tokens_total", replica=R0) == 0
