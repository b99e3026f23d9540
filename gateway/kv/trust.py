"""How far routing trusts what kvgate knows of each replica's cache, where an operator sees it.

Per replica (``KvFollower.trust``, after vllm-project/router RFC #294): ``exact`` (every data-parallel
rank's KV events followed, its base's tokenizer found), ``degraded`` (some ranks' events) or
``predicted`` (no events followed, or no tokenizer for its base: the predicted index routes it), with
the reason on ``/healthz`` and as ``kvgate_routing_trust{replica,trust}``.

The predicted index is each process's own guess of where it sent what, so where several processes route
one fleet (``workers`` > 1, or kvgates sharing Redis) they split cache affinity between them. So a kvgate
in such a fleet says once at start, in one log line (its first worker only), which replicas it routes
on the predicted index and why.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Mapping

from gateway.kv.follower import KvFollower
from gateway.telemetry.metrics import Metrics

log = logging.getLogger(__name__)

TRUSTS = ("exact", "degraded", "predicted")
SETTLE_S = 15.0  # how long the start line waits for every replica's events to be found (or not)
_STEP_S = 0.5


def track(metrics: Metrics, followers: Mapping[str, KvFollower]) -> None:
    """``kvgate_routing_trust{replica,trust}``: 1 for each replica's current trust, 0 for the others."""
    for url, follower in followers.items():
        for trust in TRUSTS:
            metrics.routing_trust.labels(url, trust).set_function(functools.partial(_is, follower, trust))


def _is(follower: KvFollower, trust: str) -> float:
    return 1.0 if follower.trust()[0] == trust else 0.0


def predicted_line(
    followers: Mapping[str, KvFollower], names: Mapping[str, str], processes: str
) -> str | None:
    """The start line: which replicas are routed on the predicted index and why (None: none is)."""
    if not followers:
        return (
            f"kv_events is off: every replica is routed on the predicted index, which {processes} each "
            "keep on their own (cache affinity splits between them)"
        )
    guessed = {url: why for url, f in followers.items() for trust, why in [f.trust()] if trust == "predicted"}
    if not guessed:
        return None
    reasons = "; ".join(f"{names.get(url, url)}: {why or 'no events'}" for url, why in guessed.items())
    return (
        f"{len(guessed)} of {len(followers)} replicas routed on the predicted index, which {processes} "
        f"each keep on their own (cache affinity splits between them): {reasons}"
    )


def _settled(follower: KvFollower) -> bool:
    """Its trust will not move by itself soon: exact, a failure seen, no events published, or its base
    without a tokenizer."""
    trust, _ = follower.trust()
    base = follower.replica.listing.base_name
    no_tokenizer = follower.tokenizers is not None and follower.tokenizers.problem(base) is not None
    return trust == "exact" or bool(follower.last_error or follower.lost or follower.absent) or no_tokenizer


async def announce(followers: Mapping[str, KvFollower], names: Mapping[str, str], processes: str) -> None:
    """Once every replica's events are followed or known not to be (at most ``SETTLE_S``), log the start
    line (``predicted_line``) when there is one to say."""
    for _ in range(int(SETTLE_S / _STEP_S)):
        if all(_settled(f) for f in followers.values()):
            break
        await asyncio.sleep(_STEP_S)
    if line := predicted_line(followers, names, processes):
        log.warning("%s", line)
