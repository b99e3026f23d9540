"""Quarantine: a replica whose listing or behaviour disagrees with the table is never trusted for that name.

Each sweep compares every replica's listing with the snapshot and the store. For a logical ID kvgate
manages, a versioned name listed from a root outside the store (``foreign-root``), or from a store
directory of another digest (``digest-mismatch``), is quarantined there; so is a version the canary found
answering unlike its fingerprint or incoherently (``canary: <verdict>``). A quarantined name is never
eligible on that replica (``Replica.serves``), is reported (``/kvgate/status``, a metric, a log line)
and is repaired when no kvgate leases it: unloaded, so the next request loads it from the store again.
An adapter listed under a logical ID's bare name (``unversioned``) is reported, never unloaded: kvgate
never routes to bare names, and it may be someone else's.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import PurePosixPath

from gateway.core.identity import SHORT_DIGEST_LEN
from gateway.fleet.replicas import Replica, ReplicaPool
from gateway.telemetry.metrics import Metrics

log = logging.getLogger(__name__)
FOREIGN_ROOT = "foreign-root"
DIGEST_MISMATCH = "digest-mismatch"
UNVERSIONED = "unversioned"


@dataclass(frozen=True, slots=True)
class Finding:
    replica: str
    name: str
    reason: str
    root: str
    since: float  # wall-clock seconds

    @property
    def repairable(self) -> bool:
        return self.reason != UNVERSIONED


def inspect(replica: Replica, logical_ids: set[str], store_prefix: str) -> list[tuple[str, str, str]]:
    """(name, reason, root) for each adapter the replica lists that disagrees with the table."""
    found = []
    for name, root in replica.listing.adapters.items():
        logical_id, at, short = name.partition("@")  # logical IDs never contain "@"
        if not at:
            if name in logical_ids:
                found.append((name, UNVERSIONED, root))
            continue
        if logical_id not in logical_ids or len(short) != SHORT_DIGEST_LEN:
            continue  # not a version kvgate manages
        if not root.startswith(f"{replica.agent_root}/" if replica.agent else store_prefix):
            found.append((name, FOREIGN_ROOT, root))
        elif not PurePosixPath(root).name.startswith(short):
            found.append((name, DIGEST_MISMATCH, root))
    return found


class Quarantine:
    """The one owner of every replica's quarantined names."""

    def __init__(self, pool: ReplicaPool, metrics: Metrics) -> None:
        self.pool = pool
        self.metrics = metrics
        self._findings: dict[tuple[str, str], Finding] = {}

    def findings(self) -> list[Finding]:
        return sorted(self._findings.values(), key=lambda f: (f.replica, f.name))

    def add(self, replica: Replica, name: str, reason: str, root: str = "") -> None:
        key = (replica.url, name)
        if key in self._findings:
            return
        root = root or replica.listing.adapters.get(name, "")
        self._findings[key] = Finding(replica.url, name, reason, root, time.time())
        replica.quarantined[name] = root
        self.metrics.quarantines.labels(replica.url, reason).inc()
        self._gauge(replica)
        log.error("quarantined %s on %s: %s (root %r)", name, replica.url, reason, root)

    def clear(self, replica: Replica, name: str) -> None:
        if self._findings.pop((replica.url, name), None) is not None:
            replica.quarantined.pop(name, None)
            self._gauge(replica)
            log.info("%s on %s is out of quarantine", name, replica.url)

    def inspect_all(self, logical_ids: set[str], store_prefix: str) -> None:
        """Quarantine what listings newly disagree on; lift what no longer shows (unloaded meanwhile)."""
        for replica in self.pool.healthy():
            seen = set()
            for name, reason, root in inspect(replica, logical_ids, store_prefix):
                seen.add(name)
                self.add(replica, name, reason, root)
            for finding in [f for f in self.findings() if f.replica == replica.url]:
                listed = finding.name in replica.listing.adapters
                if not listed or (finding.name not in seen and not finding.reason.startswith("canary")):
                    self.clear(replica, finding.name)

    def _gauge(self, replica: Replica) -> None:
        self.metrics.quarantined.labels(replica.url).set(len(replica.quarantined))
