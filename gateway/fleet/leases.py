"""This kvgate's leases on the adapters its requests use, shared with the fleet through Redis.

Counted locally per (replica, versioned name). The first request on a pair this kvgate does not hold
writes the lease in the background as it goes out (``acquire``: no request waits on Redis; refused while
another kvgate unloads that name, and then that request may find the name gone and be retried); the
heartbeat, every quarter of the lease time to live, refreshes what is in use, shares each name's last use
(the fleet's LRU order) and lets go of pairs with nothing in flight. A kvgate that dies stops refreshing,
and its leases expire within the time to live. The loader asks ``begin_unload`` before it unloads.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from gateway.table.epoch_table import REDIS_DOWN, REDIS_REFUSED
from gateway.table.leases import LeaseTable, UnloadClaim
from gateway.tasks.supervisor import periodically

log = logging.getLogger(__name__)
Pair = tuple[str, str]  # (replica URL, versioned name)


def wall_ms() -> int:
    return time.time_ns() // 1_000_000


class Leases:
    def __init__(self, table: LeaseTable, report: Callable[[], dict[str, Any]] = dict) -> None:
        self.table = table
        self.report = report
        """What the heartbeat tells the fleet besides being alive (e.g. this kvgate's quarantines)."""
        self.started_ms = wall_ms()
        self._in_flight: Counter[Pair] = Counter()
        self._held: dict[Pair, int] = {}  # pair -> last use (wall-clock ms)
        self._reporting: dict[Pair, int] = {}  # what the running heartbeat shares (``forget`` edits it)
        self._replicas: set[str] = set()  # every replica this kvgate ever leased on (to let go there)
        self._recording: dict[Pair, asyncio.Task[None]] = {}  # first uses whose lease is being written
        self.refused = 0  # first uses whose lease Redis refused (an unload was in progress there)
        self.unrecorded = 0  # first uses whose lease could not be written (Redis unreachable, or a fault)

    @property
    def gateway_id(self) -> str:
        return self.table.gateway_id

    def held(self) -> dict[Pair, int]:
        return dict(self._held)

    def acquire(self, replica: str, name: str) -> None:
        """Count one request on ``name`` at ``replica``, at once. A pair this kvgate does not hold yet is
        written to Redis in the background (``_record``): the request does not wait for that round trip."""
        pair = (replica, name)
        if pair not in self._held and pair not in self._recording:
            self._replicas.add(replica)
            self._recording[pair] = asyncio.get_running_loop().create_task(self._record(pair))
        self._in_flight[pair] += 1
        self._held[pair] = wall_ms()

    async def _record(self, pair: Pair) -> None:
        """The lease in Redis for a pair's first request. Refused (another kvgate began to unload that
        name there): the requests out already may find it gone (the proxy retries a replica that answers
        it lacks the version, which loads it again), and the pair is not held, so the next request asks
        again. Every failure is logged and counted, never raised: no request waits on this task."""
        replica, name = pair
        try:
            if not await self.table.acquire(replica, name):
                self.refused += 1
                log.info("lease on %s at %s refused: another kvgate is unloading it there", name, replica)
                if pair not in self._in_flight:
                    self._held.pop(pair, None)
        except REDIS_DOWN + REDIS_REFUSED as exc:  # serve on: the local count protects this kvgate's requests
            self.unrecorded += 1
            log.warning("lease on %s at %s not recorded (Redis unreachable): %s", name, replica, exc)
        except Exception:
            self.unrecorded += 1
            log.exception("lease on %s at %s not recorded", name, replica)
        finally:
            self._recording.pop(pair, None)

    def release(self, replica: str, name: str) -> None:
        pair = (replica, name)
        self._in_flight[pair] -= 1
        if self._in_flight[pair] <= 0:
            del self._in_flight[pair]
        self._held[pair] = wall_ms()

    async def heartbeat(self) -> None:
        """Alive for another time to live; refresh what is in flight, let go of the rest."""
        since = self.table.now_ms()  # a lease acquired after this, for a new request, is not dropped
        await self.table.heartbeat(self.started_ms, self.report())
        self._reporting, self._held = (
            self._held,
            {pair: at for pair, at in self._held.items() if pair in self._in_flight},
        )
        used = self._reporting  # ``forget`` takes an unloaded name out until its replica's turn
        for replica in sorted(self._replicas):
            names = {name: at for (url, name), at in used.items() if url == replica}
            keep = {name for (url, name) in self._held if url == replica}
            await self.table.refresh(replica, names, keep, since=since)

    @property
    def interval(self) -> float:
        """Seconds between heartbeats: a quarter of the leases' time to live."""
        return self.table.ttl_ms / 4000

    async def run(self) -> None:
        """Beat until cancelled; Redis unreachable or refusing the write (``maxmemory``) is waited out."""
        interval = self.interval

        def unreachable(exc: Exception) -> None:
            log.warning("lease heartbeat failed (leases expire after %.0f s): %s", interval * 4, exc)

        await periodically(interval, self.heartbeat, survive=REDIS_DOWN + REDIS_REFUSED, on_error=unreachable)

    async def let_go(self) -> None:
        """On shutdown: drop every lease at once instead of waiting for them to expire."""
        self._held.clear()
        self._in_flight.clear()
        for task in list(self._recording.values()):
            task.cancel()
        try:
            for replica in sorted(self._replicas):
                await self.table.refresh(replica, {}, set(), since=self.table.now_ms() + 1)
        except REDIS_DOWN + REDIS_REFUSED as exc:
            log.warning("could not drop leases on shutdown (they expire by themselves): %s", exc)

    async def begin_unload(self, replica: str, name: str, *, force: bool, claim_ms: int) -> UnloadClaim:
        return await self.table.begin_unload(replica, name, force=force, claim_ms=claim_ms)

    async def end_unload(self, replica: str, name: str, *, unloaded: bool) -> None:
        await self.table.end_unload(replica, name, unloaded=unloaded)

    async def last_use(self, replica: str, names: list[str]) -> dict[str, float]:
        """Name -> newest use on ``replica`` (wall-clock seconds) across the fleet, this kvgate included,
        for ``names`` (one Redis read of those fields, however many names the fleet ever used there)."""
        shared = await self.table.shared_last_use(replica, names)
        for name in names:
            used = self._held.get((replica, name))
            if used is not None:
                shared[name] = max(shared.get(name, 0), used)
        return {name: used / 1000 for name, used in shared.items()}

    def forget(self, replica: str, name: str) -> None:
        """``name`` was unloaded from ``replica`` (``end_unload`` dropped its leases and shared last use):
        the next heartbeat does not share its last use again, unless a request uses it meanwhile."""
        pair = (replica, name)
        if pair not in self._in_flight:
            self._held.pop(pair, None)
            self._reporting.pop(pair, None)
