"""The fleet's shared view of adapter use, in Redis: gateway heartbeats, leases and the shared LRU.

A lease says "a request of gateway G is (or was just) using versioned name N on replica R"; it expires
by itself when G stops refreshing it (G died), so a dead gateway can hold nothing for longer than the
lease time to live. An unload first claims the name (``begin_unload``: refused while a live lease holds
it, unless forced), which also makes ``acquire_lease`` refuse the name until the unload is over: no
request can start on a name that is being unloaded. All of one replica's lease keys share its hash tag.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from dataclasses import dataclass
from typing import Any

from gateway.table import keys
from gateway.table.epoch_table import EpochTable
from gateway.table.replies import as_text
from gateway.table.scripts import Code

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class UnloadClaim:
    claimed: bool
    live_leases: int  # leases that held the name (when forced, the ones overridden)
    reason: str  # "claimed" | "leased" | "unloading"


class LeaseTable:
    def __init__(self, table: EpochTable, gateway_id: str, *, ttl_ms: int) -> None:
        self.table = table
        self.gateway_id = gateway_id
        self.ttl_ms = ttl_ms

    async def heartbeat(self, started_ms: int, report: dict[str, Any]) -> None:
        """This gateway is alive for another lease time to live, with what it reports (``kvgate status``
        lists the fleet: each gateway's host, pid and report)."""
        doc = json.dumps(
            {"pid": os.getpid(), "host": socket.gethostname(), "started_ms": started_ms, **report}
        )
        redis = self.table.redis
        await redis.sadd(keys.GATEWAYS, self.gateway_id)
        await redis.set(keys.gateway(self.gateway_id), doc, px=self.ttl_ms)

    async def acquire(self, replica: str, name: str) -> bool:
        """Lease ``name`` on ``replica``; False while it is being unloaded."""
        return await self.table.scripts.acquire_lease(
            replica, name, self.gateway_id, now=self.table.clock(), ttl_ms=self.ttl_ms
        )

    async def refresh(self, replica: str, used: dict[str, int], keep: set[str], *, since: int) -> None:
        """Share the last use of each name in ``used`` (wall-clock ms) on ``replica``, keep the leases
        of the names in ``keep`` alive, and drop this gateway's other leases there written before
        ``since`` (ms)."""
        await self.table.scripts.refresh_leases(
            replica, self.gateway_id, used, keep, now=self.table.clock(), ttl_ms=self.ttl_ms, since=since
        )

    def now_ms(self) -> int:
        return self.table.clock()

    async def begin_unload(self, replica: str, name: str, *, force: bool, claim_ms: int) -> UnloadClaim:
        code, live = await self.table.scripts.begin_unload(
            replica, name, self.gateway_id, now=self.table.clock(), claim_ms=claim_ms, force=force
        )
        reason = {Code.CHANGED: "claimed", Code.LEASED: "leased"}.get(code, "unloading")
        return UnloadClaim(reason == "claimed", live, reason)

    async def end_unload(self, replica: str, name: str, *, unloaded: bool) -> None:
        await self.table.scripts.end_unload(replica, name, unloaded=unloaded)

    async def shared_last_use(self, replica: str, names: list[str]) -> dict[str, int]:
        """Versioned name -> the newest use (wall-clock ms) any gateway reported on ``replica``, for
        ``names`` only (the adapters it has: at most the budget). The hash can hold more (a name whose
        last use was shared after its unload), so it is never read whole on the load path. A value that
        is not a time (a direct write) is left out."""
        if not names:
            return {}
        raw = await self.table.redis.hmget(keys.last_use(replica), names)
        return {
            name: used
            for name, value in zip(names, raw, strict=True)
            if value is not None and (used := _ms(value)) is not None
        }


async def live_gateways(table: EpochTable) -> dict[str, dict[str, Any]]:
    """Gateway id -> its last heartbeat's document, for every gateway whose heartbeat has not expired."""
    ids = sorted(as_text(i, "replace") for i in await table.redis.smembers(keys.GATEWAYS))
    alive = {}
    for gateway_id in ids:
        doc = await table.redis.get(keys.gateway(gateway_id))
        if doc is not None:
            alive[gateway_id] = _report(gateway_id, doc)
    gone = set(ids) - set(alive)
    if gone:
        await table.redis.srem(keys.GATEWAYS, *gone)
    return alive


def _ms(value: bytes | str) -> int | None:
    """A stored time in ms; None when it is not one (a direct write: that row is left out)."""
    text = as_text(value, "replace").strip()
    return int(text) if text.isascii() and text.isdigit() and len(text) < 19 else None


def _report(gateway_id: str, doc: bytes | str) -> dict[str, Any]:
    """A live gateway's heartbeat document; one that is not a JSON object still counts it alive."""
    try:
        report = json.loads(as_text(doc, "replace"))
    except (ValueError, RecursionError):
        report = None
    if not isinstance(report, dict):
        log.warning(
            "gateway %s's heartbeat document is malformed: %r", gateway_id, as_text(doc, "replace")[:80]
        )
        return {"malformed": True}
    return report
