"""The shared epoch table in Redis: what kvgate asks of it (publish, rollback, bump, reseed, replicas'
loaded sets, load locks) and its reads (the current versions, a page at a time; histories; loaded sets).

Every mutation is one Lua script (atomic, one Cluster slot, logged: changelog.py), run through
``table.scripts`` (one typed method per script: keys, arguments, reply, status codes to exceptions).
``now`` is the table's ``clock`` (ms), passed to each script so tests control time.

The table runs on any ``RedisClient`` (one server, Sentinel-managed, or a Cluster: every script's keys
share one hash slot). Publish, rollback and bump wait for one Redis replica to acknowledge their writes
when the server that ran them has replicas (``Scripts.run_acked``), so an acknowledged change survives a
failover; if none acknowledges within ``ack_timeout`` the change stands and a warning says it may not.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import redis.exceptions
from opentelemetry.trace import NoOpTracer, Span, Tracer

from gateway.core.errors import MalformedRow, ScriptRefused
from gateway.core.model import Change, TableView, VersionState
from gateway.table import keys
from gateway.table.connection import RedisClient
from gateway.table.replies import as_text
from gateway.table.rows import parse_history_event, parse_state
from gateway.table.scripts import ACK_TIMEOUT, Scripts
from gateway.telemetry import tracing as attr

log = logging.getLogger(__name__)
Clock = Callable[[], int]
REDIS_DOWN = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    redis.exceptions.ClusterDownError,  # a Cluster answering CLUSTERDOWN while it fails over
    OSError,
)
"""What an unreachable Redis raises: callers that can serve from the snapshot catch exactly these."""
REDIS_REFUSED = (redis.exceptions.ResponseError, ScriptRefused)
"""Redis answered and refused the command: ``maxmemory`` reached ("OOM command not allowed", an
``OutOfMemoryError``), a read-only replica, a script's error, a script's refusal of what Redis holds
(``ScriptRefused``: nothing written). Not an outage (reads still work, so the
snapshot is never flushed for it); a loop whose step writes (the replica poll's record, the leases
heartbeat) waits it out like an outage and writes again at its next step."""
READ_PAGE = 1_000  # IDs per page of a full read


def wall_clock_ms() -> int:
    return time.time_ns() // 1_000_000


class EpochTable:
    def __init__(
        self,
        redis: RedisClient,
        *,
        clock: Clock = wall_clock_ms,
        tracer: Tracer | None = None,
        ack_timeout: float = ACK_TIMEOUT,
        log_kept: int = keys.LOG_KEPT,
    ) -> None:
        self.redis = redis
        self.clock = clock
        self.tracer = tracer or NoOpTracer()
        self.scripts = Scripts(redis, ack_timeout=ack_timeout, log_kept=log_kept)
        """Every Lua script, one typed method each: the table's other wrappers (rollouts, leases, the change
        log, inventory) run theirs through it too."""

    @contextlib.contextmanager
    def _span(self, name: str, logical_id: str, digest: str = "") -> Iterator[Span]:
        with self.tracer.start_as_current_span(name) as span:
            span.set_attribute(attr.LOGICAL_ID, logical_id)
            if digest:
                span.set_attribute(attr.VERSION_DIGEST, digest)
            yield span

    # --- mutations -------------------------------------------------------------------------------

    async def ensure_generation(self, *, acked: bool = False) -> str:
        return await self.scripts.ensure_generation(acked=acked)

    async def publish(
        self, logical_id: str, digest: str, name: str, path: str, base: str, base_print: str = ""
    ) -> Change:
        """BASE_PRINT: the fingerprint of the base it is published for ('' : none; see base_print.py)."""
        with self._span("kvgate.publish", logical_id, digest=digest) as span:
            await self.ensure_generation(acked=True)
            change = await self.scripts.publish_version(
                logical_id, digest, name, path, base, base_print, now=self.clock()
            )
            span.set_attribute(attr.EPOCH, change.epoch)
            return change

    async def rollback(self, logical_id: str, digest: str, base: str) -> Change:
        """Go back to DIGEST (or a unique prefix of at least ``keys.DIGEST_PREFIX_MIN``; '' for the
        previous version), choosing only among versions published for BASE."""
        with self._span("kvgate.rollback", logical_id, digest=digest) as span:
            change = await self.scripts.rollback_version(logical_id, digest, base, now=self.clock())
            span.set_attribute(attr.EPOCH, change.epoch)
            return change

    async def bump(self, logical_id: str) -> Change:
        with self._span("kvgate.bump", logical_id) as span:
            change = await self.scripts.bump_epoch(logical_id, now=self.clock())
            span.set_attribute(attr.EPOCH, change.epoch)
            return change

    async def reseed(
        self, logical_id: str, digest: str, name: str, path: str, base: str, epoch: int
    ) -> Change:
        """Put back a version a snapshot held, at its epoch, after the table came back empty (see
        ``lua/reseed_version.lua``). ``changed`` False: the ID's version stays; ``epoch`` is its epoch."""
        return await self.scripts.reseed_version(
            logical_id, digest, name, path, base, epoch, now=self.clock()
        )

    async def record_loaded(self, replica: str, loaded: dict[str, str], ttl_ms: int) -> bool:
        return await self.scripts.record_loaded(replica, loaded, ttl_ms)

    async def acquire_load_lock(
        self, logical_id: str, name: str, replica: str, token: str, ttl_ms: int
    ) -> bool:
        return await self.scripts.acquire_lock(logical_id, name, replica, token, ttl_ms)

    async def release_load_lock(self, logical_id: str, name: str, replica: str, token: str) -> bool:
        return await self.scripts.release_lock(logical_id, name, replica, token)

    # --- reads -----------------------------------------------------------------------------------

    async def read_state(self, logical_id: str) -> VersionState | None:
        raw: dict[bytes, bytes] = await self.redis.hgetall(keys.state(logical_id))  # type: ignore[assignment]
        return parse_state(logical_id, raw)

    async def has_version(self, logical_id: str, base: str, digest: str) -> bool:
        """Whether DIGEST was ever published (or re-seeded) for BASE under LOGICAL_ID."""
        return bool(await self.redis.hexists(keys.versions(logical_id), keys.version_field(base, digest)))

    async def read_all(self, page: int = READ_PAGE) -> TableView:
        """Every current version, all of one generation, a page at a time (lua/read_page.lua: SSCAN COUNT
        PAGE and the page's state hashes in one bounded reply): a read the table was emptied under is read
        again (else it would show the old generation with no IDs, and the snapshot would forget them)."""
        while True:
            generation, cursor = await self.ensure_generation(), "0"
            states: dict[str, VersionState] = {}
            malformed: dict[str, str] = {}
            while True:
                cursor, rows = await self.scripts.read_page(cursor, page)
                for logical_id, raw in rows:
                    try:
                        state = parse_state(logical_id, raw)
                    except MalformedRow as exc:
                        malformed[logical_id] = exc.reason
                        continue
                    if state is not None:
                        states[logical_id] = state
                if cursor == "0":
                    break
            if as_text(await self.redis.get(keys.GENERATION) or b"") == generation:
                return TableView(generation, states, malformed)

    async def read_history(self, logical_id: str, malformed: list[str] | None = None) -> list[dict[str, Any]]:
        """The ID's history, newest first, parsed one entry at a time: an entry that is not one is left
        out, and why is added to ``malformed`` (when given: ``kvgate history`` and ``gc`` say so)."""
        events = []
        for position, item in enumerate(await self.redis.lrange(keys.history(logical_id), 0, -1)):
            try:
                events.append(parse_history_event(logical_id, position, item))
            except MalformedRow as exc:
                if malformed is not None:
                    malformed.append(exc.reason)
        return events

    async def read_loaded(self) -> dict[str, dict[str, str]]:
        replicas = sorted(as_text(r, "replace") for r in await self.redis.smembers(keys.REPLICAS))
        loaded: dict[str, dict[str, str]] = {}
        for replica in replicas:
            doc = await self.redis.get(keys.replica_loaded(replica))
            if doc is not None:
                loaded[replica] = _loaded_doc(replica, doc)
        return loaded


def _loaded_doc(replica: str, doc: bytes | str) -> dict[str, str]:
    """What a replica has loaded (name -> root) as recorded; a record that is not one reads as nothing."""
    try:
        loaded = json.loads(as_text(doc, "replace"))
    except (ValueError, RecursionError):
        loaded = None
    if not isinstance(loaded, dict) or not all(isinstance(v, str) for v in loaded.values()):
        log.warning("the loaded adapters recorded for %s are malformed: left out", replica)
        return {}
    return loaded
