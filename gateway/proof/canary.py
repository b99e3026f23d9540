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

from gateway.core.errors import KvgateError
from gateway.core.model import Target
from gateway.core.scheduler import eligible
from gateway.core.wire import cache_salt
from gateway.fleet.replicas import ReplicaPool
from gateway.proof.audit import COHERENT, Observation, judge, warm_and_cold
from gateway.proof.experiment import long_prompt
from gateway.table.snapshot import Snapshot
from gateway.telemetry.metrics import Metrics

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
    ) -> None:
        self.snapshot = snapshot
        self.pool = pool
        self.activity = activity
        self.metrics = metrics

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
            except (KvgateError, aiohttp.ClientError, TimeoutError) as exc:
                log.warning("canary round for %s failed: %s", logical_id, exc)

    async def _audit(self, logical_id: str) -> None:
        version = self.snapshot.get(logical_id)
        if version is None:
            return
        salt = cache_salt(self.snapshot.generation, version)
        target = Target(logical_id, version.base, version, salt, [])
        observations = []
        for replica in eligible(self.pool.replicas, target):
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
