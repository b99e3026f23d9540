"""How far routing trusts what kvgate knows of each replica's cache, where an operator sees it.

Per replica (after vllm-project/router RFC #294): ``exact`` (every data-parallel rank's KV events
followed, its base's tokenizer found, its token counts agreeing), ``degraded`` (some ranks' events) or
``predicted`` (no events followed, no tokenizer for its base, or kvgate's token counts disagree with its
answers: the predicted index routes it), with the reason on ``/healthz`` and as
``kvgate_routing_trust{replica,trust}``.

Three owners meet here, so each process (each worker) judges its own (``RoutingTrust``): the events'
state is the KV indexer's, one per kvgate (``kv.shared_index``: each replica's record, written by its
follower); the tokenizers (``kv.tokenizers``) and the live check (``kv.live_check``, fed by this
process's answers) are the process's own. The request path reads the same three: the shared table
scores a replica whose events are not routable as holding nothing, a base without a tokenizer has no
tokens to key, and the scheduler's ``TokenTrust`` (the live check) drops a replica whose counts disagree.

The predicted index is each process's own guess of where it sent what, so where several processes route
one fleet (``workers`` > 1, or kvgates sharing Redis) they split cache affinity between them. So a kvgate
in such a fleet says once at start, in one log line (its first worker only), which replicas it routes
on the predicted index and why.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Mapping, Sequence

from gateway.fleet.replicas import Replica
from gateway.kv.follower import ROUTING
from gateway.kv.live_check import LiveCheck
from gateway.kv.shared_index import ReplicaEvents, SharedReader, events_health
from gateway.kv.tokenizers import Tokenizers
from gateway.telemetry.metrics import Metrics

log = logging.getLogger(__name__)

TRUSTS = ("exact", "degraded", "predicted")
SETTLE_S = 15.0  # how long the start line waits for every replica's events to be found (or not)
_STEP_S = 0.5


class RoutingTrust:
    """Each replica's routing trust as this process sees it: the KV indexer's record of its events
    (``events``), its base's tokenizer (``tokenizers``) and its token-count check (``live``)."""

    def __init__(
        self, events: SharedReader, replicas: Sequence[Replica], tokenizers: Tokenizers, live: LiveCheck
    ) -> None:
        self.events = events
        self.replicas = {replica.url: replica for replica in replicas}
        self.tokenizers = tokenizers
        self.live = live

    @property
    def urls(self) -> list[str]:
        return list(self.replicas)

    def of(self, url: str, events: ReplicaEvents | None = None) -> tuple[str, str]:
        """``url``'s trust (``TRUSTS``) and why not exact: no tokenizer for its base, events or not
        (no request for that base is keyed by its tokens); its token counts disagree; else its events'
        state (``follower.ROUTING``)."""
        missing = self._no_tokenizer(url)
        if missing is not None:
            return "predicted", missing
        disagree = self.live.fallback_reason(url)
        if disagree is not None:
            return "predicted", disagree
        events = events or self.events.events(url)
        reason = events.health.get("reason")
        return ROUTING[events.state], reason if isinstance(reason, str) else ""

    def settled(self, url: str) -> bool:
        """Its trust will not move by itself soon: exact, its events settled (a failure seen, lost, none
        published), or its base without a tokenizer."""
        events = self.events.events(url)
        return self.of(url, events)[0] == "exact" or events.settled or self._no_tokenizer(url) is not None

    def _no_tokenizer(self, url: str) -> str | None:
        replica = self.replicas.get(url)
        return None if replica is None else self.tokenizers.problem(replica.listing.base_name)

    def health(self, names: Mapping[str, str]) -> tuple[dict[str, int], dict[str, object]]:
        """``/healthz``'s ``kv_events``: how many replicas are in each events state and how many the
        live check routes on the predicted index (``token_fallback``; public), and each replica's record
        under its public name (``names``; detail) with this process's trust (``routing``, and
        ``routing_reason`` when it is not the events' reason) and its window of token-count checks
        (``token_check``)."""
        counts, detail = events_health(self.events, dict(names))
        fallbacks = 0
        for url in self.events.region.replicas:
            doc = detail.get(names.get(url, url))
            if not isinstance(doc, dict):
                continue
            routing, why = self.of(url, self.events.events(url))
            doc["routing"] = routing
            if why and why != doc.get("reason"):
                doc["routing_reason"] = why
            checked = self.live.health(url)
            if checked is not None:
                doc["token_check"] = checked
            fallbacks += self.live.fallback_reason(url) is not None
        return {**counts, "token_fallback": fallbacks}, detail


def track(metrics: Metrics, trust: RoutingTrust) -> None:
    """``kvgate_routing_trust{replica,trust}``: 1 for each replica's current trust, 0 for the others."""
    for url in trust.urls:
        for name in TRUSTS:
            metrics.routing_trust.labels(url, name).set_function(functools.partial(_is, trust, url, name))


def untrack(metrics: Metrics) -> None:
    """``kvgate_routing_trust`` no longer read (before the shared table it reads is closed)."""
    metrics.routing_trust.clear()


def _is(trust: RoutingTrust, url: str, name: str) -> float:
    return 1.0 if trust.of(url)[0] == name else 0.0


def predicted_line(trust: RoutingTrust | None, names: Mapping[str, str], processes: str) -> str | None:
    """The start line: which replicas are routed on the predicted index and why (None: none is;
    ``trust`` None: ``kv_events`` is off)."""
    if trust is None:
        return (
            f"kv_events is off: every replica is routed on the predicted index, which {processes} each "
            "keep on their own (cache affinity splits between them)"
        )
    guessed = {url: why for url in trust.urls for name, why in [trust.of(url)] if name == "predicted"}
    if not guessed:
        return None
    reasons = "; ".join(f"{names.get(url, url)}: {why or 'no events'}" for url, why in guessed.items())
    return (
        f"{len(guessed)} of {len(trust.urls)} replicas routed on the predicted index, which {processes} "
        f"each keep on their own (cache affinity splits between them): {reasons}"
    )


async def announce(trust: RoutingTrust | None, names: Mapping[str, str], processes: str) -> None:
    """Once every replica's events are followed or known not to be (at most ``SETTLE_S``), log the start
    line (``predicted_line``) when there is one to say."""
    for _ in range(int(SETTLE_S / _STEP_S)):
        if trust is None or all(trust.settled(url) for url in trust.urls):
            break
        await asyncio.sleep(_STEP_S)
    if line := predicted_line(trust, names, processes):
        log.warning("%s", line)
