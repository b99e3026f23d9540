"""Stage 3 of the request path: where a request runs, carried out under its reservation.

The scheduler decides (serve on R, or load on R); ``place`` takes the request's ``Reservation`` on that
version at R at once (so nothing evicts it from then on: not this kvgate's budget or sweep, not another
kvgate's), loads it when it must, and hands both back for the forward. A load goes where the budget has
room when the replica picked has none (every adapter reserved); when no replica of the base has room,
the load waits for a slot (``slot_wait_timeout``), then ``AdapterBudgetFull``.
"""

from __future__ import annotations

import asyncio
import logging
import time

from gateway.core.errors import AdapterBudgetFull, NoEligibleReplica, VersionUnloading
from gateway.core.model import Target
from gateway.core.scheduler import Decision, Scheduler
from gateway.fleet.budget import SLOT_POLL
from gateway.fleet.leases import Leases
from gateway.fleet.loader import AdapterLoader
from gateway.fleet.replicas import Replica, ReplicaPool
from gateway.fleet.reservation import Reservation

log = logging.getLogger(__name__)


class Placement:
    def __init__(
        self, pool: ReplicaPool, scheduler: Scheduler, loader: AdapterLoader, leases: Leases
    ) -> None:
        self.pool = pool
        self.scheduler = scheduler
        self.loader = loader
        self.leases = leases

    async def place(self, target: Target, pin: Replica | None) -> tuple[Decision[Replica], Reservation]:
        """The scheduler's decision, carried out, with the request's reservation on it taken at once (a
        "load on R" loads while the reservation already holds the version there). A replica that turns
        out to be down during the load is marked unhealthy and the scheduler decides again (unless
        pinned); a version being unloaded where it was picked is looked at again until it is gone (and
        then loaded again), for at most ``slot_wait_timeout``. (The loader's and the replicas' words name
        versions and replica URLs: the proxy says them to the client as ``relay.public_message``.)"""
        pin_url = pin.url if pin is not None else None
        name = target.version.name if target.version is not None else None
        down, deadline = 0, time.monotonic() + self.loader.budget.slot_wait
        while True:
            decision = self._decide(target, pin_url)
            try:
                reservation = await Reservation.take(decision.replica, name, self.leases)
            except VersionUnloading:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(SLOT_POLL)
                await self.pool.refresh(decision.replica)
                continue
            if decision.action == "serve" or target.version is None:
                return decision, reservation
            try:
                await self.loader.ensure_loaded(target.version, decision.replica, decision.reason)
                return decision, reservation
            except NoEligibleReplica as exc:
                reservation.release()
                down += 1
                if isinstance(exc, AdapterBudgetFull) or pin is not None or decision.replica.healthy:
                    raise
                if down >= len(self.pool.replicas):
                    raise NoEligibleReplica(
                        f"no replica could serve {target.logical_id!r}", param="model"
                    ) from exc
                log.warning("%s is down; loading %s elsewhere", decision.replica.url, target.version.name)
            except BaseException:
                reservation.release()
                raise

    def _decide(self, target: Target, pin: str | None) -> Decision[Replica]:
        """The scheduler's decision; a load goes to a replica of the base with room in its adapter
        budget (or an adapter not in use here) when the one picked has none."""
        decision = self.scheduler.decide(self.pool.replicas, target, pin=pin)
        if decision.action == "serve" or self.loader.budget.has_room(decision.replica):
            return decision
        roomy = [r for r in self.pool.replicas if self.loader.budget.has_room(r)]
        if not roomy:
            return decision  # the load waits for a slot there (slot_wait_timeout)
        try:
            return self.scheduler.decide(roomy, target, pin=pin)
        except NoEligibleReplica:  # none of them serves the base
            return decision
