"""The ``purge-all`` invalidation strategy, for backends (or pools) without cache namespaces.

Under the default ``version-scoped`` strategy nothing is purged: versioned names and per-epoch cache
salts keep every effective model in its own namespace. Under ``purge-all``, every version or epoch
change seen by the snapshot drains the retired versions' in-flight requests (bounded by the drain
grace), then resets the prefix cache of every healthy replica, retrying while a replica answers that
blocks are still in use. Safe, and costly: every tenant's next requests are cold. It needs a server
that can purge (``BackendDialect.prefix_purge``): on any other, kvgate refuses to start with it.
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp

from gateway.core.errors import KvgateError
from gateway.fleet.backends import LoadFailed
from gateway.fleet.replicas import Replica, ReplicaPool
from gateway.table.snapshot import Snapshot
from gateway.telemetry.metrics import Metrics

log = logging.getLogger(__name__)
VERSION_SCOPED = "version-scoped"
PURGE_ALL = "purge-all"
RETRY_INTERVAL_S = 0.2


class PurgeAll:
    def __init__(
        self,
        pool: ReplicaPool,
        snapshot: Snapshot,
        metrics: Metrics,
        *,
        drain_grace: float,
        attempts: int = 100,
    ) -> None:
        if not pool.dialect.prefix_purge:  # refused at start: kvgate would believe caches were purged
            raise KvgateError(
                f'invalidation = "purge-all" needs replicas that can purge their prefix cache; '
                f'{pool.dialect.name} replicas cannot (use invalidation = "version-scoped")'
            )
        self.pool = pool
        self.snapshot = snapshot
        self.metrics = metrics
        self.drain_grace = drain_grace
        self.attempts = attempts
        self._changed = asyncio.Event()

    def changed(self, logical_id: str) -> None:
        """A snapshot hook: some logical ID moved to a new version or epoch."""
        log.info("purge-all: %s changed, purging every replica's prefix cache", logical_id)
        self._changed.set()

    async def run(self) -> None:
        while True:
            await self._changed.wait()
            self._changed.clear()
            await self._drain()
            await asyncio.gather(*(self._purge(replica) for replica in self.pool.healthy()))

    async def _drain(self) -> None:
        """Let requests still using retired versions finish, for at most the drain grace."""
        retired = set(self.snapshot.retired)
        for _ in range(int(self.drain_grace / RETRY_INTERVAL_S)):
            if not any(r.in_flight_by_name.get(name) for r in self.pool.replicas for name in retired):
                return
            await asyncio.sleep(RETRY_INTERVAL_S)

    async def _purge(self, replica: Replica) -> None:
        for _ in range(self.attempts):
            try:
                if await self.pool.dialect.purge_prefix_cache(self.pool.session, replica.url):
                    self.metrics.purges.labels(replica.url, "purged").inc()
                    return
            except (LoadFailed, aiohttp.ClientError, TimeoutError) as exc:
                log.warning("purge of %s failed: %s", replica.url, exc)
                self.metrics.purges.labels(replica.url, "failed").inc()
                return
            await asyncio.sleep(RETRY_INTERVAL_S)  # blocks still in use: try again
        self.metrics.purges.labels(replica.url, "gave-up").inc()
