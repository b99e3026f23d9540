"""Getting a version onto a replica, and off again.

``ensure_loaded`` carries out the scheduler's "load on R". It is single-flight twice over: within this
process (one task per replica and name) and across every kvgate (a Redis lock per version and replica).
Loads always use the versioned name and the content-addressed root, never ``load_inplace``. Before a
load, the replica's adapter budget makes room (``fleet.budget``: never evicting what a request
reserved, waiting for a slot when all are). ``sweep`` unloads versions that are no longer current once
they have been retired for the drain grace period and nothing reserves them, and, at once, versions a
replica serves on another base than they were published for (its base fingerprint changed).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import secrets
import time

import aiohttp
from opentelemetry.trace import StatusCode, Tracer

from gateway.core.errors import AdapterNotReady, NoEligibleReplica
from gateway.core.model import VersionState
from gateway.fleet.agents import ready_path
from gateway.fleet.backends import LoadFailed
from gateway.fleet.base_prints import mismatch
from gateway.fleet.budget import SLOT_POLL, AdapterBudget
from gateway.fleet.leases import Leases
from gateway.fleet.quarantine import Quarantine
from gateway.fleet.replicas import Replica, ReplicaPool
from gateway.table.epoch_table import REDIS_DOWN, EpochTable
from gateway.table.snapshot import Snapshot
from gateway.tasks.supervisor import periodically
from gateway.telemetry import tracing as attr
from gateway.telemetry.metrics import Metrics

log = logging.getLogger(__name__)


class AdapterLoader:
    def __init__(
        self,
        pool: ReplicaPool,
        table: EpochTable,
        snapshot: Snapshot,
        *,
        store_prefix: str,
        budget: int,
        drain_grace: float,
        max_drain: float,
        load_timeout: float,
        lock_ttl: float,
        slot_wait: float,
        leases: Leases,
        quarantine: Quarantine,
        metrics: Metrics,
        tracer: Tracer,
        agent_token: str = "",
    ) -> None:
        """``store_prefix``: what every root in the store starts with (``adapters.stores.location_prefix``);
        ``agent_token``: sent to replicas' agents (``fleet.agents``)."""
        self.pool = pool
        self.agent_token = agent_token
        self.leases = leases
        self.quarantine = quarantine
        self.max_drain = max_drain
        self.table = table
        self.snapshot = snapshot
        self.store_prefix = store_prefix
        self.drain_grace = drain_grace
        self.load_timeout = load_timeout
        self.budget = AdapterBudget(
            pool, snapshot, leases, metrics, budget=budget, slot_wait=slot_wait, managed=self._managed,
            evict=lambda replica, name: self._unload(replica, name, reason="budget"),
        )  # fmt: skip
        self.lock_ttl_ms = int(lock_ttl * 1000)
        self.metrics = metrics
        self.tracer = tracer
        self._loading: dict[tuple[str, str], asyncio.Task[None]] = {}

    async def ensure_loaded(self, version: VersionState, replica: Replica, reason: str = "loaded") -> None:
        """Load ``version`` on ``replica`` (the scheduler's choice, for ``reason``: its decision's, which
        labels the load counter), or raise ``NoEligibleReplica``.

        A replica that turns out to be down is marked unhealthy (the scheduler then looks elsewhere);
        a replica that refuses the load ends the attempt with its reason.
        """
        await self._load_once(replica, version, reason)

    async def _load_once(self, target: Replica, version: VersionState, reason: str) -> None:
        """Single-flight within this process: concurrent requests share one load task. It runs on when
        every request waiting on it has left (shielded: the next request finds the load done); its
        outcome is then nobody's, so its failure is logged here, never left unretrieved."""
        key = (target.url, version.name)
        task = self._loading.get(key)
        if task is None:
            task = asyncio.create_task(self._load(target, version, reason))
            self._loading[key] = task
            task.add_done_callback(functools.partial(self._loaded, key))
        await asyncio.shield(task)

    def _loaded(self, key: tuple[str, str], task: asyncio.Task[None]) -> None:
        """A load ended. Its failure is logged here: its requests may all have left (it runs on without
        them), and a failure nobody retrieves would be asyncio's "Task exception was never retrieved"."""
        self._loading.pop(key, None)
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.warning("load of %s on %s failed: %s", key[1], key[0], exc)

    async def stop(self) -> None:
        """On shutdown, before the session closes: cancel the loads in flight (their requests are gone)."""
        loads = list(self._loading.values())
        for task in loads:
            task.cancel()
        await asyncio.gather(*loads, return_exceptions=True)

    async def _load(self, replica: Replica, version: VersionState, reason: str) -> None:
        token = secrets.token_hex(8)
        deadline = time.monotonic() + self.load_timeout
        while version.name in replica.unloading:  # this kvgate is unloading it there: load it again after
            if time.monotonic() > deadline:
                raise NoEligibleReplica(f"timed out waiting for the unload of {version.name} to end")
            await asyncio.sleep(SLOT_POLL)
        locked = await self._acquire(replica, version.name, token)
        while not locked:  # another kvgate is loading it: watch the replica until it lists it
            await asyncio.sleep(0.2)
            await self.pool.refresh(replica)
            if replica.serves(version.name, version.path):
                return
            if time.monotonic() > deadline:
                raise NoEligibleReplica(f"timed out waiting for another kvgate to load {version.name}")
            locked = await self._acquire(replica, version.name, token)
        try:
            await self.pool.refresh(replica)
            if replica.serves(version.name, version.path):
                return
            if version.name in replica.listing.adapters:
                # Same name from another root (another store, or loaded by hand): never trust it.
                await self._unload(replica, version.name, reason="wrong-root", force=True)
            path = await self._local_copy(replica, version)
            async with self.budget.slot(replica):  # room made (or waited for), held until it is listed
                await self._post_load(replica, version, reason, path)
                log.info("loaded %s on %s from %s", version.name, replica.url, path)
                await self.pool.refresh(replica)
            await self._announce(replica)
            if not replica.serves(version.name, version.path):
                listed = replica.listing.adapters.get(version.name)
                log.warning("%s lists %s from %r, not %r", replica.url, version.name, listed, version.path)
                raise NoEligibleReplica(
                    f"{replica.url} does not list {version.name} from kvgate's store after loading it"
                )
        finally:
            if locked:
                await self._release(replica, version.name, token)

    async def _local_copy(self, replica: Replica, version: VersionState) -> str:
        """The directory REPLICA loads VERSION from: the store's, or its agent's verified copy."""
        if replica.agent is None and "://" in version.path:
            log.warning("%s has no agent (replica_agents) to fetch %s from %s", replica.url, version.name,
                        version.path)  # fmt: skip
            raise AdapterNotReady(version.logical_id, "a replica has no adapter agent for the object store")
        return await ready_path(self.pool.session, replica, version, token=self.agent_token,
                                within=self.load_timeout, metrics=self.metrics)  # fmt: skip

    async def _post_load(self, replica: Replica, version: VersionState, reason: str, path: str) -> None:
        started = time.perf_counter()
        outcome = "failed"
        with self.tracer.start_as_current_span("kvgate.load") as span:
            span.set_attribute(attr.VERSION_NAME, version.name)
            span.set_attribute(attr.VERSION_DIGEST, version.digest)
            span.set_attribute(attr.REPLICA, replica.url)
            try:
                async with asyncio.timeout(self.load_timeout):
                    await self.pool.dialect.load(self.pool.session, replica.url, version.name, path)
                outcome = "loaded"
            except LoadFailed as exc:
                raise NoEligibleReplica(
                    f"loading {version.name} on {replica.url} failed: {exc.reason}"
                ) from exc
            except (aiohttp.ClientError, TimeoutError) as exc:
                if isinstance(exc, aiohttp.ClientConnectionError):
                    replica.healthy = False  # until its next good poll
                log.warning("loading %s on %s failed: %r", version.name, replica.url, exc)
                why = "timed out" if isinstance(exc, TimeoutError) else "the replica could not be reached"
                raise NoEligibleReplica(f"loading {version.name} on {replica.url} failed: {why}") from exc
            finally:
                span.set_attribute(attr.OUTCOME, outcome)
                self.metrics.loads.labels(replica.url, outcome, reason).inc()
                self.metrics.load_seconds.labels(replica.url).observe(time.perf_counter() - started)

    async def _acquire(self, replica: Replica, name: str, token: str) -> bool:
        """The fleet-wide lock on loading (or repairing) versioned ``name`` on ``replica``."""
        logical_id = name.partition("@")[0]
        try:
            return await self.table.acquire_load_lock(logical_id, name, replica.url, token, self.lock_ttl_ms)
        except REDIS_DOWN as exc:
            log.warning("load lock unavailable (%s); loading with local single-flight only", exc)
            return True

    async def _release(self, replica: Replica, name: str, token: str) -> None:
        try:
            await self.table.release_load_lock(name.partition("@")[0], name, replica.url, token)
        except REDIS_DOWN as exc:
            log.warning("could not release load lock (it expires by itself): %s", exc)

    def _managed(self, replica: Replica) -> list[str]:
        """Adapters kvgate loaded: their root is in our content-addressed store."""
        prefix = f"{replica.agent_root}/" if replica.agent else self.store_prefix
        return [name for name, root in replica.listing.adapters.items() if root.startswith(prefix)]

    async def _unload(self, replica: Replica, name: str, *, reason: str, force: bool = False) -> bool:
        """Unload ``name`` once nothing reserves it, here or in another kvgate (``force``: whatever
        reserves it); True if gone. From the check on, no reservation of it can start here."""
        if name in replica.unloading or (replica.in_flight_by_name.get(name) and not force):
            return False
        replica.unloading.add(name)  # no await between the check and this: no reservation slips in
        try:
            return await self._claimed_unload(replica, name, reason=reason, force=force)
        finally:
            replica.unloading.discard(name)

    async def _claimed_unload(self, replica: Replica, name: str, *, reason: str, force: bool) -> bool:
        if not await self._claim(replica, name, force=force):
            return False
        unloaded = False
        try:
            with self.tracer.start_as_current_span("kvgate.unload") as span:
                span.set_attribute(attr.VERSION_NAME, name)
                span.set_attribute(attr.REPLICA, replica.url)
                span.set_attribute(attr.UNLOAD_REASON, reason)
                try:
                    await self.pool.dialect.unload(self.pool.session, replica.url, name)
                    unloaded = True
                except (LoadFailed, aiohttp.ClientError, TimeoutError) as exc:
                    log.warning("unloading %s from %s failed: %s", name, replica.url, exc)
                    span.set_status(StatusCode.ERROR, str(exc))
                    return False
        finally:
            await self._release_claim(replica, name, unloaded=unloaded)
        self.leases.forget(replica.url, name)  # its last use is not shared again: it is gone there
        self.metrics.unloads.labels(replica.url, reason).inc()
        log.info("unloaded %s from %s (%s)", name, replica.url, reason)
        replica.listing.adapters.pop(name, None)
        replica.last_used.pop(name, None)
        self.quarantine.clear(replica, name)
        await self._announce(replica)
        return True

    async def _announce(self, replica: Replica) -> None:
        """Tell every kvgate this replica's adapters changed (its hint), without waiting for a poll."""
        try:
            await self.pool.record(self.table, replica)
        except REDIS_DOWN as exc:
            log.warning("could not announce %s's adapters (kvgates see them at their next poll): %s",
                        replica.url, exc)  # fmt: skip

    async def _claim(self, replica: Replica, name: str, *, force: bool) -> bool:
        try:
            claim = await self.leases.begin_unload(
                replica.url, name, force=force, claim_ms=int(self.load_timeout * 1000)
            )
        except REDIS_DOWN as exc:  # leases unknown: only a forced unload goes ahead (a budget goes over)
            verb = "unloading" if force else "not unloading"
            log.warning("%s %s from %s without the fleet's leases (Redis unreachable): %s", verb, name,
                        replica.url, exc)  # fmt: skip
            return force
        if not claim.claimed:
            log.debug("not unloading %s from %s: %s", name, replica.url, claim.reason)
            self.metrics.unloads_deferred.labels(replica.url, claim.reason).inc()
        elif claim.live_leases:
            log.warning(
                "forced unload of %s from %s over %d live lease(s)", name, replica.url, claim.live_leases
            )
        return claim.claimed

    async def _release_claim(self, replica: Replica, name: str, *, unloaded: bool) -> None:
        try:
            await self.leases.end_unload(replica.url, name, unloaded=unloaded)
        except REDIS_DOWN as exc:
            log.warning("could not end the unload claim on %s (it expires by itself): %s", name, exc)

    async def sweep(self) -> None:
        """Quarantine what replicas list against the table and repair it; unload retired versions after
        the drain grace, once no kvgate leases them, and at the latest after ``max_drain`` (forced,
        counted as ``forced``)."""
        if self.snapshot.flushed:
            return  # never judge what is current from a snapshot that may be incomplete
        await self._repair()
        current = self.snapshot.current_names()
        now = time.monotonic()
        by_name = {state.name: state for state in self.snapshot.versions()}
        for replica in self.pool.healthy():
            for name in self._managed(replica):
                if name in by_name and mismatch(self.pool, replica, by_name[name]) is not None:
                    await self._unload(replica, name, reason="base-mismatch", force=True)
                    continue
                if name in current:
                    continue
                drained = now - self.snapshot.retired.setdefault(name, now)
                forced = drained >= self.max_drain
                if drained < self.drain_grace or (replica.in_flight_by_name.get(name) and not forced):
                    continue
                await self._unload(replica, name, reason="forced" if forced else "retired", force=forced)
        loaded = {name for replica in self.pool.replicas for name in replica.listing.adapters}
        for name, retired_at in list(self.snapshot.retired.items()):  # forget what is gone everywhere
            if name not in loaded and now - retired_at >= self.drain_grace:
                del self.snapshot.retired[name]

    async def _repair(self) -> None:
        """Unload quarantined copies, each under its load lock (never racing a load of that name), and
        only while the replica still lists the quarantined root."""
        self.quarantine.inspect_all({state.logical_id for state in self.snapshot}, self.store_prefix)
        for finding in self.quarantine.findings():
            replica = self.pool.get(finding.replica)
            if not finding.repairable or replica is None or not replica.healthy:
                continue
            token = secrets.token_hex(8)
            if not await self._acquire(replica, finding.name, token):
                continue  # being loaded right now: look again at the next sweep
            try:
                await self.pool.refresh(replica)
                if replica.listing.adapters.get(finding.name) == finding.root:
                    await self._unload(replica, finding.name, reason="repair")
            finally:
                await self._release(replica, finding.name, token)

    async def sweep_forever(self, interval: float) -> None:
        await periodically(interval, self.sweep)
