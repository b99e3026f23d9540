"""Which logical IDs get series of their own in ``/metrics``: the top K by recent traffic, the rest ``other``.

Per-logical-ID series exist only for counters (histograms carry no logical ID at all), and only for a
bounded set of IDs, so ``/metrics`` stays the same size whether kvgate serves 100 tenants or 100,000:

- **Traffic** is ranked by a Space-Saving sketch (``heavy_hitters``) of ``SKETCH_FACTOR * K`` entries,
  one unit per proxied request, by each ID's guaranteed count (a newcomer's inherited count does not
  rank it). Memory is O(K), whatever the number of IDs; a request costs one dict update and one heap push.
- **Promotion.** An ID is *promoted* (its requests, tokens, epoch changes and audit verdicts count under
  ``logical_id="<id>"``) when it is among the K heaviest at a re-ranking, every ``rerank_interval``
  seconds; until K IDs are promoted, an ID is promoted by its first request. So with at most K IDs,
  every ID has its own series from its first request, as before.
- **Everything else counts under** ``logical_id="other"`` (``unknown``: a request for no servable ID).
- **Demotion.** An ID that leaves the top K at a re-ranking keeps its series, frozen: what it counted
  stays there, its new traffic goes to ``other``. A frozen series is dropped from the exposition at the
  next re-ranking (it has then been flat for a whole interval), unless the ID is back in the top K, in
  which case it simply goes on counting in the same series.
- **The sketch decays** (every count halved) at each re-ranking: the ranking follows the last few
  intervals' traffic, and an ID that stops getting traffic is replaced.

What this keeps true: each event is counted once, in exactly one series (the ID's while promoted,
``other`` otherwise); every series only grows while it is exposed; so ``sum(rate(...))`` and
``sum(increase(...))`` over the ``logical_id`` label are exact at all times. A raw ``sum(...)`` of the
counters drops when a frozen series is dropped, as it does when a process restarts; a dropped ID that
comes back starts a new series from 0 (Prometheus reads both as a counter reset). At most 2K IDs have
series at any time (K promoted, at most K frozen), plus ``other`` and ``unknown``.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from gateway.telemetry.heavy_hitters import SpaceSaving

DEFAULT_TOP_K = 100
DEFAULT_RERANK_INTERVAL = 300.0
OTHER = "other"
SKETCH_FACTOR = 10
"""The sketch holds this many candidates per promoted ID (any ID above 1/(10K) of the traffic is held)."""


class TopIds:
    """The promoted and frozen IDs (above); ``drop`` removes a frozen ID's series from every metric."""

    def __init__(
        self,
        k: int,
        rerank_interval: float,
        drop: Callable[[str], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.k = k
        self.rerank_interval = rerank_interval
        self.drop = drop
        self.clock = clock
        self.sketch = SpaceSaving(SKETCH_FACTOR * k)
        self.promoted: set[str] = set()
        self.frozen: set[str] = set()
        self.next_rerank = clock() + rerank_interval

    def request(self, logical_id: str) -> str:
        """Count one request for ``logical_id`` (re-ranking when due); the label it counts under now."""
        self.sketch.add(logical_id)
        if self.clock() >= self.next_rerank:
            self.rerank()
        if len(self.promoted) < self.k and logical_id not in self.promoted:
            self.frozen.discard(logical_id)
            self.promoted.add(logical_id)
        return self.label(logical_id)

    def label(self, logical_id: str) -> str:
        return logical_id if logical_id in self.promoted else OTHER

    def rerank(self) -> None:
        top = set(self.sketch.top(self.k))
        dropped = self.frozen - top
        self.frozen = self.promoted - top
        self.promoted = top
        self.sketch.decay(0.5)
        self.next_rerank = self.clock() + self.rerank_interval
        for logical_id in sorted(dropped):
            self.drop(logical_id)
