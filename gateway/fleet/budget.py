"""The adapter budget of each replica (``max_adapters_per_replica``): room for one more load.

Room is made by unloading idle adapters in the scheduler's ``evictions`` order (retired versions first,
then the fleet's least recently used). What a request has reserved (``fleet.reservation``: counted here,
or leased by another kvgate, whose lease refuses the unload claim) is never evicted: while every adapter
is in use, the load waits for one to come free, at most ``slot_wait`` seconds, then
``AdapterBudgetFull``. Loads on one replica take turns at making room, first come first served. Every
load that found the budget full observes its wait (``kvgate_adapter_slot_wait_seconds``). While Redis
cannot say who leases what, nothing this kvgate does not use itself can be proven idle, and the load goes
over budget instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable

from gateway.core.errors import AdapterBudgetFull
from gateway.core.scheduler import evictions, has_room
from gateway.fleet.leases import Leases
from gateway.fleet.replicas import Replica, ReplicaPool
from gateway.table.epoch_table import REDIS_DOWN
from gateway.table.snapshot import Snapshot
from gateway.telemetry.metrics import Metrics

log = logging.getLogger(__name__)

SLOT_POLL = 0.05
"""Seconds between looks for a free adapter slot while every one is in use (another kvgate's requests
end without telling this one; the look is cheap: only idle names cost a Redis call)."""


class AdapterBudget:
    def __init__(
        self,
        pool: ReplicaPool,
        snapshot: Snapshot,
        leases: Leases,
        metrics: Metrics,
        *,
        budget: int,
        slot_wait: float,
        managed: Callable[[Replica], list[str]],
        evict: Callable[[Replica, str], Awaitable[bool]],
    ) -> None:
        """``managed(r)``: the adapters kvgate loaded on ``r``; ``evict(r, name)``: unload ``name`` from
        ``r`` unless something reserves it (True if gone)."""
        self.pool = pool
        self.snapshot = snapshot
        self.leases = leases
        self.metrics = metrics
        self.budget = budget
        self.slot_wait = slot_wait
        self.managed = managed
        self.evict = evict
        self.pending: Counter[str] = Counter()  # replica URL -> loads past their room check, not listed yet
        self.in_line: Counter[str] = Counter()  # replica URL -> loads whose turn it is or who wait for it
        self._turns: dict[str, asyncio.Lock] = {}  # replica URL -> whose turn it is to make room there

    def has_room(self, replica: Replica) -> bool:
        """Whether a load on ``replica`` could start now, as far as this kvgate knows (the scheduler's one
        idea of room, ``core.scheduler.has_room``, over this budget's figures): the scheduler asks it
        both where to load and where a hot version may spread."""
        in_use = replica.in_flight_by_name
        return has_room(self.managed(replica), self.pending[replica.url], in_use, self.budget)

    @contextlib.asynccontextmanager
    async def slot(self, replica: Replica) -> AsyncIterator[None]:
        """Room for one more adapter on ``replica`` (``make_room``), held until the block ends (the load
        done and the replica listing it): concurrent loads here never count the same room twice.

        Loads take turns per replica, in the order they came (``asyncio.Lock`` wakes its waiters first
        come, first served): the one whose turn it is makes room, counts it as its own and lets the next
        one look. Without turns, every waiting load polled on its own, several evicted at once, and the
        room one made went to whichever looked first: a load could lose every race until
        ``slot_wait_timeout`` while slots came free every few milliseconds (``loadtest.churn``)."""
        started = time.monotonic()
        turn = self._turns.setdefault(replica.url, asyncio.Lock())
        self.in_line[replica.url] += 1
        self.metrics.slot_line.labels(replica.url).set(self.in_line[replica.url])
        try:
            try:
                async with asyncio.timeout(self.slot_wait):
                    await turn.acquire()
            except TimeoutError:
                raise self._full(replica, started) from None
            try:
                await self.make_room(replica, started)
                self.pending[replica.url] += 1
            finally:
                turn.release()
        finally:
            self.in_line[replica.url] -= 1
            self.metrics.slot_line.labels(replica.url).set(self.in_line[replica.url])
        try:
            yield
        finally:
            self.pending[replica.url] -= 1

    def _full(self, replica: Replica, started: float) -> AdapterBudgetFull:
        self.metrics.slot_wait.labels(replica.url).observe(time.monotonic() - started)
        return AdapterBudgetFull(
            f"the adapter budget of replica {replica.url} is full: all {self.budget} adapters "
            f"(max_adapters_per_replica) stayed in use for {self.slot_wait:g} s (slot_wait_timeout); "
            "retry later"
        )

    async def make_room(self, replica: Replica, started: float) -> None:
        """Unload idle adapters, least recently used across the fleet first, until one more fits. What
        is reserved (here, or leased by another kvgate) is never taken: while nothing can go, wait for a
        slot, until ``slot_wait`` seconds after ``started``, then ``AdapterBudgetFull``. While Redis cannot
        say who leases what, nothing this kvgate does not use itself can be proven idle: the load goes
        over budget. Run in the load's turn (``slot``)."""
        full = waited = False
        while True:
            managed = self.managed(replica)
            if len(managed) + self.pending[replica.url] < self.budget:
                break
            full = True
            try:
                last_used = await self.leases.last_use(replica.url, managed)
                blind = False
            except REDIS_DOWN:
                last_used, blind = dict(replica.last_used), True
            victims = evictions(
                managed,
                in_use=replica.in_flight_by_name,
                current=self.snapshot.current_names(),
                last_used=last_used,
            )
            if await self._evict_one(replica, victims):
                continue  # look again: a concurrent load may have taken the room meanwhile
            if blind:
                log.warning("loading on %s over its budget: Redis cannot say which adapters are idle",
                            replica.url)  # fmt: skip
                break
            if time.monotonic() - started >= self.slot_wait:
                raise self._full(replica, started)
            waited = True
            await asyncio.sleep(SLOT_POLL)
            await self.pool.refresh(replica)
        if waited:
            log.info("waited %.3f s for an adapter slot on %s", time.monotonic() - started, replica.url)
        if full:
            self.metrics.slot_wait.labels(replica.url).observe(time.monotonic() - started)

    async def _evict_one(self, replica: Replica, victims: list[str]) -> bool:
        for victim in victims:
            if await self.evict(replica, victim):
                return True
        return False
