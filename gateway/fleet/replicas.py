"""The replicas kvgate fronts: what each one reports as loaded, its health, and its load right now.

A poller asks every replica's ``/v1/models`` (through its backend dialect) each ``poll_interval``; a
replica that does not answer is unhealthy until it does. In-flight counts and last use per versioned
name are local to this kvgate and feed routing, the adapter budget and the drain before unload.

Each replica has its own connection limit (``max_connections_per_replica``): a request holds one of its
slots from before it is sent until its last byte is relayed (a stream holds it to the end), and waits at
most ``pool_wait_timeout`` for one; then ``ReplicaBusy``, and the replica is not blamed. The shared HTTP
client has no pool limit of its own, so its connect timeout measures connecting, never queueing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import aiohttp

from gateway.core.base_print import current as current_scheme
from gateway.core.errors import MalformedAnswer, ReplicaBusy
from gateway.core.identity import base_identity
from gateway.core.model import VersionState
from gateway.core.scheduler import holds
from gateway.fleet.backends import AdapterListing, BackendDialect
from gateway.table.epoch_table import REDIS_DOWN, REDIS_REFUSED, EpochTable
from gateway.tasks.supervisor import periodically

log = logging.getLogger(__name__)


@dataclass(slots=True)
class ReplicaPrints:
    """What kvgate knows of a replica's base: fingerprints and, when it changed, why it is another base."""

    behaviour: str | None = None  # encoded ``core.base_print`` of ``incarnation``: the probe's, no bytes
    incarnation: int = -1
    bytes_digest: str | None = None  # blake3 of the base's files as read when ``bytes_incarnation`` began
    bytes_root: str | None = None  # the directory those bytes were read from
    bytes_incarnation: int = -1
    bytes_on_disk: str | None = None  # the files' digest at the last read (a change is logged once)
    identity: str | None = None  # bytes and behaviour together: what the rule compares (``base_print``)
    identity_incarnation: int = -1
    start_time: float | None = None  # the server process's start time, when its /metrics says
    previous: str | None = None  # the print before the last change (None: it never changed)
    changed_reason: str = ""  # why the last change made it another base
    failures: int = 0  # probes that failed in this incarnation
    unprintable: str = ""  # why this incarnation cannot be fingerprinted ('' : it can, or not tried)
    retry_at: float = 0.0  # monotonic time after which an unprintable incarnation is probed again


class Replica:
    """One replica as this kvgate sees it; the scheduler reads it as a ``ReplicaView``."""

    def __init__(
        self, url: str, *, base_with_root: bool = False, max_connections: int = 0, pool_wait: float = 0.0
    ) -> None:
        self.url = url
        self.base_with_root = base_with_root
        self.max_connections = max_connections
        self.pool_wait = pool_wait
        self.slots = asyncio.Semaphore(max_connections) if max_connections else None
        self.healthy = False
        self.unhealthy_reason = "not polled yet"
        """Why it is unhealthy ('' while healthy): unreachable, an error status, or a malformed listing."""
        self.listing = AdapterListing(None, None)
        self.in_flight = 0
        self.in_flight_by_name: Counter[str] = Counter()
        self.last_used: dict[str, float] = {}
        self.unloading: set[str] = set()
        """Versioned names this kvgate is unloading here: never served, never reserved meanwhile."""
        self.quarantined: dict[str, str] = {}
        """Versioned name -> the root it is quarantined for here (written by ``fleet.quarantine`` only)."""
        self.incarnation = 0
        """Bumped each time it is seen to (re)start: a base print belongs to one incarnation."""
        self.restart_reason = ""
        self.prints = ReplicaPrints()
        """Its base fingerprints (written by ``fleet.base_prints`` only)."""
        self.agent: str | None = None
        """Its ``kvgate agent``'s URL (``replica_agents``): versions load from the agent's verified copy."""
        self.agent_root = ""
        """Where this replica sees its agent's directory (``agent_root``), when it has an agent."""

    @property
    def base_print(self) -> str | None:
        """Its base's fingerprint (bytes and behaviour, ``core.base_print``), encoded; None until either
        is taken since it last (re)started."""
        prints = self.prints
        return prints.identity if prints.identity_incarnation == self.incarnation else None

    def restarted(self, reason: str) -> None:
        """It (re)started: whatever it served before is unproven until its base is fingerprinted again."""
        self.incarnation += 1
        self.restart_reason = reason
        if self.prints.identity is not None:
            log.warning("replica %s restarted (%s): fingerprinting its base again", self.url, reason)

    @property
    def base(self) -> str | None:
        """The base model identity it serves: its listed name (``name=root`` when roots must match)."""
        if self.listing.base_name is None:
            return None
        return base_identity(self.listing.base_name, self.listing.base_root if self.base_with_root else None)

    @property
    def adapter_count(self) -> int:
        return len(self.listing.adapters)

    def root_for(self, path: str) -> str:
        """Where this replica loads the version stored at PATH from: PATH itself, or with an agent its
        verified local copy ``<agent_root>/<digest>``."""
        return f"{self.agent_root}/{path.rstrip('/').rpartition('/')[2]}" if self.agent else path

    @property
    def adapters(self) -> dict[str, str]:
        """What it lists: versioned name -> root."""
        return self.listing.adapters

    def serves(self, name: str, root: str) -> bool:
        """Whether it serves the version ``name`` stored at ``root``: the scheduler's rule (``holds``)."""
        return holds(self, name, root)

    def begin(self, name: str | None) -> None:
        self.in_flight += 1
        if name is not None:
            self.in_flight_by_name[name] += 1
            self.last_used[name] = time.monotonic()

    def end(self, name: str | None) -> None:
        self.in_flight -= 1
        if name is not None:
            self.in_flight_by_name[name] -= 1
            if self.in_flight_by_name[name] <= 0:
                del self.in_flight_by_name[name]
            self.last_used[name] = time.monotonic()

    def connection(self) -> Slot:
        """Hold one of this replica's connection slots (none to hold without a limit): ``async with``."""
        return Slot(self)

    def __repr__(self) -> str:
        return f"Replica({self.url!r}, healthy={self.healthy}, in_flight={self.in_flight})"


class Slot:
    """One of a replica's connection slots, held for an ``async with`` (``Replica.connection``): taken at
    once when one is free (no timer armed), else waited for at most ``pool_wait`` (then ``ReplicaBusy``)."""

    __slots__ = ("replica",)

    def __init__(self, replica: Replica) -> None:
        self.replica = replica

    async def __aenter__(self) -> None:
        replica = self.replica
        slots = replica.slots
        if slots is None:
            return
        try:
            if slots.locked():  # none free: wait, for at most pool_wait
                async with asyncio.timeout(replica.pool_wait):
                    await slots.acquire()
            else:
                await slots.acquire()  # one is free: taken at once, no timer armed
        except TimeoutError:
            raise ReplicaBusy(
                f"kvgate waited {replica.pool_wait:g} s for a free connection to replica {replica.url}: all "
                f"{replica.max_connections} are in use (max_connections_per_replica); retry later"
            ) from None

    async def __aexit__(self, *exc: object) -> None:
        if self.replica.slots is not None:
            self.replica.slots.release()


class ReplicaPool:
    def __init__(
        self,
        urls: list[str],
        dialect: BackendDialect,
        session: aiohttp.ClientSession,
        *,
        base_with_root: bool,
        max_connections: int = 0,
        pool_wait: float = 0.0,
        agents: dict[str, tuple[str, str]] | None = None,
    ) -> None:
        """``max_connections``: per replica, 0 for no limit; ``pool_wait``: seconds to wait for one;
        ``agents``: replica URL -> (its agent's URL, where the replica sees the agent's directory)."""
        self.replicas = [
            Replica(url, base_with_root=base_with_root, max_connections=max_connections, pool_wait=pool_wait)
            for url in urls
        ]
        for replica in self.replicas:
            if replica.url in (agents or {}):
                replica.agent, replica.agent_root = (agents or {})[replica.url]
        self.dialect = dialect
        self.session = session
        self.base_with_root = base_with_root
        self.record_ttl_ms = 10_000  # how long a recorded listing outlives the last kvgate polling it
        self.base_references: dict[str, str] = {}
        """Base identity -> the first print this kvgate took of it (written by ``fleet.base_prints``)."""
        self.after_restart: Callable[[Replica], Awaitable[None]] | None = None
        """Run when a refresh notices a restart (``fleet.base_prints`` fingerprints the base again), so a
        request that found its version forgotten can be served without waiting for the next poll."""

    def expected_print(self, version: VersionState) -> str:
        """The base print a replica must have to serve ``version``: the one it was published with, else
        (a version published without one, or with a ``bp1`` print, whose probe is not taken any more) the
        first print this kvgate took of its base ('' : none yet)."""
        if current_scheme(version.base_print):
            return version.base_print
        return self.base_references.get(version.base, "")

    def base_identities(self) -> dict[str, str]:
        """Served base name -> its base identity, over the healthy replicas (the first one listed wins)."""
        found: dict[str, str] = {}
        for replica in self.healthy():
            if replica.listing.base_name is not None and replica.base is not None:
                found.setdefault(replica.listing.base_name, replica.base)
        return found

    def get(self, url: str) -> Replica | None:
        return next((replica for replica in self.replicas if replica.url == url), None)

    def healthy(self) -> list[Replica]:
        return [replica for replica in self.replicas if replica.healthy]

    async def refresh(self, replica: Replica) -> None:
        try:
            listing = await self.dialect.list_adapters(self.session, replica.url)
        except MalformedAnswer as exc:  # it answered, but kvgate cannot tell what it serves
            self._unhealthy(replica, f"its /v1/models answer is malformed: {exc.reason}")
            return
        except (aiohttp.ClientError, TimeoutError) as exc:
            self._unhealthy(replica, f"unreachable: {exc!r}")
            return
        incarnation = replica.incarnation
        if not replica.healthy:
            replica.restarted("reachable again after being down" if replica.incarnation else "first seen")
        elif replica.listing.adapters and not listing.adapters and replica.prints.start_time is None:
            # A replica without a start time to read: losing every adapter is the only sign of a restart.
            # With one, the start time says (``fleet.base_prints``, every poll): an empty listing is as often
            # kvgate's own unloads (budget, retired versions), and a false restart costs a new print and
            # empties its KV view.
            replica.restarted("its listing lost every adapter")
        replica.listing = listing
        replica.healthy, replica.unhealthy_reason = True, ""
        if replica.incarnation != incarnation and self.after_restart is not None:
            await self.after_restart(replica)

    @staticmethod
    def _unhealthy(replica: Replica, reason: str) -> None:
        """Mark it unhealthy; logged once per reason (a malformed answer repeats every poll)."""
        if replica.healthy or reason != replica.unhealthy_reason:
            log.warning("replica %s is unhealthy: %s", replica.url, reason)
        replica.healthy, replica.unhealthy_reason = False, reason

    async def refresh_all(self) -> None:
        await asyncio.gather(*(self.refresh(replica) for replica in self.replicas))

    async def record(self, table: EpochTable, replica: Replica) -> None:
        """Record what ``replica`` has loaded in the shared table; a change hints every kvgate to
        refresh that replica at once (``refresh_hinted``)."""
        await table.record_loaded(replica.url, replica.listing.adapters, self.record_ttl_ms)

    async def refresh_hinted(self, url: str) -> None:
        """Another kvgate saw this replica's adapters change (a load or an unload): look now."""
        replica = self.get(url)
        if replica is not None:
            await self.refresh(replica)

    async def poll_forever(
        self, interval: float, table: EpochTable, after_refresh: Callable[[], Awaitable[None]] | None = None
    ) -> None:
        """Refresh every replica (then ``after_refresh``: fingerprint what restarted), then record what
        each has loaded in the shared table (for status)."""
        self.record_ttl_ms = int(max(interval * 10, 10) * 1000)

        async def step() -> None:
            await self.refresh_all()
            if after_refresh is not None:
                await after_refresh()
            for replica in self.healthy():
                await self.record(table, replica)

        def redis_down(exc: Exception) -> None:
            refused = isinstance(exc, REDIS_REFUSED)  # Redis answers: say so (an outage shows elsewhere)
            level = logging.WARNING if refused else logging.DEBUG
            log.log(level, "could not record loaded adapters: %s", exc)

        await periodically(interval, step, survive=REDIS_DOWN + REDIS_REFUSED, on_error=redis_down)
