"""The one backoff: capped exponential waits, counted failures, and a reset once it works."""

from __future__ import annotations

from gateway.tasks.backoff import Backoff


def test_waits_double_up_to_the_cap_and_a_reset_starts_over() -> None:
    backoff = Backoff(first=0.5, cap=5.0)
    assert [backoff.next() for _ in range(6)] == [0.5, 1.0, 2.0, 4.0, 5.0, 5.0]
    assert backoff.failures == 6
    backoff.reset()
    assert (backoff.failures, backoff.next()) == (0, 0.5)


def test_a_long_outage_stays_at_the_cap() -> None:
    """Thousands of failures in a row (a replica down for a day) never overflow the doubling."""
    backoff = Backoff(first=0.1, cap=30.0)
    for _ in range(5000):
        wait = backoff.next()
    assert wait == 30.0
