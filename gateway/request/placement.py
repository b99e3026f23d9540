"""The request path's decide stage: the scheduler asked once where a request runs, and its answer
carried out under the request's reservation.

The scheduler decides (serve on R, or load on R), with every eligibility rule its own, the adapter
budget's room among them (``AdapterBudget.has_room``, the scheduler's ``has_room`` over this kvgate's
figures); ``place`` takes the request's ``Reservation`` on that version at R at once (so nothing evicts
it from then on: not this kvgate's budget or sweep, not another kvgate's), loads it when it must, and
hands both back for the forward. When no replica of the base has room, the load waits for a slot
(``slot_wait_timeout``), then ``AdapterBudgetFull``. The scheduler is asked again only on the retries
``place`` documents.
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
        self.room = loader.budget.has_room

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
            decision = self.scheduler.decide(self.pool.replicas, target, pin=pin_url, room=self.room)
            try:
                reservation = Reservation.take(decision.replica, name, self.leases)
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
