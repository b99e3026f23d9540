"""The continuous canary: the audit's experiment, run by ``kvgate serve`` itself, off the request path.

Every ``canary_interval`` seconds, for each logical ID that served traffic recently, on each replica
currently eligible for its version (no loads are triggered): two warm runs in the production cache
namespace and two cold runs in fresh namespaces, judged like ``kvgate audit``. Verdicts become the
``kvgate_audit_verdicts_total`` metric.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

import aiohttp

from gateway.core.errors import KvgateError
from gateway.core.model import Target, VersionState
from gateway.core.scheduler import eligible
from gateway.core.wire import cache_salt
from gateway.fleet.quarantine import Quarantine
from gateway.fleet.replicas import ReplicaPool
from gateway.proof.audit import (
    COHERENT,
    INCOHERENT,
    MISMATCH,
    DirectTarget,
    Observation,
    Verdict,
    cannot_audit,
    judge,
    observed_digest,
    size_probe,
    warm_and_cold,
)
from gateway.proof.experiment import Sample
from gateway.proof.probe import CannotAudit
from gateway.table.snapshot import Snapshot
from gateway.telemetry.metrics import Metrics

log = logging.getLogger(__name__)
ACTIVE_WINDOW_S = 600.0


class Canary:
    def __init__(
        self,
        snapshot: Snapshot,
        pool: ReplicaPool,
        activity: dict[str, float],
        metrics: Metrics,
        quarantine: Quarantine,
        *,
        verdicts: dict[str, dict[str, dict[str, Any]]] | None = None,
    ) -> None:
        self.snapshot = snapshot
        self.pool = pool
        self.activity = activity
        self.metrics = metrics
        self.quarantine = quarantine
        self.verdicts = {} if verdicts is None else verdicts
        """Logical ID -> replica URL -> the last verdict there (the status page shows it)."""
        self._probes: dict[str, str] = {}
        """Base identity -> the probe sized for its replicas (their context and tokenizer)."""
        self._fingerprints: dict[str, Sample] = {}
        """Versioned name -> its cold answer to the probe, taken when the canary first saw it loaded."""

    async def run_round(self) -> None:
        if self.snapshot.flushed:
            return
        current = self.snapshot.current_names()  # a retired version's fingerprint is never needed again
        self._fingerprints = {name: s for name, s in self._fingerprints.items() if name in current}
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
        self._record(logical_id, await self.audit_version(version))

    async def audit_version(
        self,
        version: VersionState,
        floor: float = 0.0,
        *,
        quarantine: bool = True,
        headers: Mapping[str, str] | None = None,
    ) -> list[Verdict]:
        """One round on VERSION (the current one, or a rollout's candidate as ``candidate_version``
        gives it) on each replica eligible for it now: no verdicts when none is. Counted in metrics, and a
        faulty replica's copy quarantined; the caller keeps the verdicts. FLOOR: the smallest logprob
        tolerance (``verdicts.judge``); QUARANTINE False: the caller quarantines what it confirms
        (``quarantine_faults``); HEADERS: sent with each of its requests (the gate's marker)."""
        logical_id = version.logical_id
        salt = cache_salt(self.snapshot.generation, version)
        target = Target(logical_id, version.base, version, salt, [], self.pool.expected_print(version))
        replicas = eligible(self.pool.replicas, target)
        if not replicas:
            return []
        try:
            prompt = await self._probe(
                version.base, DirectTarget(tuple(r.url for r in replicas), version.name, headers)
            )
        except CannotAudit as exc:
            verdicts = [cannot_audit(r.url, exc.message) for r in replicas]
            self._count(logical_id, verdicts, quarantine=quarantine)
            return verdicts
        observations = []
        for replica in replicas:
            url, name = replica.url, version.name
            warm, cold = await warm_and_cold(
                self.pool.session, url, name, prompt, 2, warm_salt=salt, headers=headers
            )
            root = replica.listing.adapters.get(name)
            observations.append(Observation(url, name, observed_digest(root), root, None, warm, cold))
        fingerprint = self._fingerprint(version.name, version.digest, observations)
        verdicts = judge(observations, version.digest, fingerprint, floor)
        self._count(logical_id, verdicts, quarantine=quarantine)
        return verdicts

    def _fingerprint(self, name: str, digest: str, observations: list[Observation]) -> Sample | None:
        """The version's fingerprint: the first cold answer seen from a replica whose bytes match."""
        if name not in self._fingerprints:
            first = next((o for o in observations if o.digest == digest), None)
            if first is not None:
                self._fingerprints[name] = first.cold[0]
        return self._fingerprints.get(name)

    async def _probe(self, base: str, target: DirectTarget) -> str:
        if base not in self._probes:
            probe = await size_probe(self.pool.session, target, list(target.urls))
            self._probes[base] = probe.prompt
        return self._probes[base]

    def _record(self, logical_id: str, verdicts: list[Verdict]) -> None:
        for verdict in verdicts:
            self.verdicts.setdefault(logical_id, {})[verdict.replica] = describe(verdict)

    def _count(self, logical_id: str, verdicts: list[Verdict], *, quarantine: bool = True) -> None:
        for verdict in verdicts:
            self.metrics.audits.labels(
                self.metrics.for_id(logical_id), verdict.replica, verdict.verdict
            ).inc()
            if verdict.verdict != COHERENT:
                log.error(
                    "canary: %s on %s is %s: %s", logical_id, verdict.replica, verdict.verdict, verdict.detail
                )
        if quarantine:
            self.quarantine_faults(verdicts)

    def quarantine_faults(self, verdicts: list[Verdict]) -> None:
        """Quarantine each replica's copy that a fault verdict names."""
        for verdict in verdicts:
            replica = self.pool.get(verdict.replica)
            if verdict.verdict in (MISMATCH, INCOHERENT) and replica is not None:
                observed = verdict.observation
                self.quarantine.add(
                    replica, observed.served, f"canary: {verdict.verdict}", observed.loaded_root or ""
                )


def describe(verdict: Verdict) -> dict[str, Any]:
    """A verdict as ``/kvgate/status`` shows it."""
    return {"verdict": verdict.verdict, "detail": verdict.detail, "name": verdict.observation.served,
            "at_ms": int(time.time() * 1000)}  # fmt: skip
