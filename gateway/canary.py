"""The continuous canary: the audit's experiment, run by ``kvgate serve`` itself, off the request path.

Every ``canary_interval`` seconds, for each logical ID that served traffic recently, on each replica
currently eligible for its version (no loads are triggered): two warm runs in the production cache
namespace and two cold runs in fresh namespaces, judged like ``kvgate audit``. Verdicts become the
``kvgate_audit_verdicts_total`` metric.
"""

from __future__ import annotations

import logging
import time

import aiohttp

from gateway.audit import COHERENT, Observation, judge, warm_and_cold
from gateway.experiment import long_prompt
from gateway.metrics import Metrics
from gateway.proxy import cache_salt
from gateway.replicas import ReplicaPool
from gateway.routing import eligible
from gateway.snapshot import Snapshot

log = logging.getLogger(__name__)
ACTIVE_WINDOW_S = 600.0
CANARY_PROMPT = long_prompt(12)


class Canary:
    def __init__(
        self,
        snapshot: Snapshot,
        pool: ReplicaPool,
        activity: dict[str, float],
        metrics: Metrics,
        *,
        base_with_root: bool,
    ) -> None:
        self.snapshot = snapshot
        self.pool = pool
        self.activity = activity
        self.metrics = metrics
        self.base_with_root = base_with_root

    async def run_round(self) -> None:
        if self.snapshot.flushed:
            return
        now = time.monotonic()
        for logical_id, last_seen in list(self.activity.items()):
            if now - last_seen > ACTIVE_WINDOW_S:
                del self.activity[logical_id]
                continue
            try:
                await self._audit(logical_id)
            except (aiohttp.ClientError, TimeoutError, RuntimeError, KeyError, ValueError) as exc:
                log.warning("canary round for %s failed: %s", logical_id, exc)

    async def _audit(self, logical_id: str) -> None:
        version = self.snapshot.get(logical_id)
        if version is None:
            return
        salt = cache_salt(self.snapshot.generation, version)
        observations = []
        for replica in eligible(self.pool.replicas, version, with_root=self.base_with_root):
            url, name = replica.url, version.name
            warm, cold = await warm_and_cold(self.pool.session, url, name, CANARY_PROMPT, 2, warm_salt=salt)
            root = replica.listing.adapters.get(name)
            observations.append(Observation(url, name, version.digest, root, None, warm, cold))
        for verdict in judge(observations, version.digest) if observations else []:
            self.metrics.audits.labels(logical_id, verdict.replica, verdict.verdict).inc()
            if verdict.verdict != COHERENT:
                log.error(
                    "canary: %s on %s is %s: %s", logical_id, verdict.replica, verdict.verdict, verdict.detail
                )
