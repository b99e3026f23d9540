"""kvgate's background tasks, each a ``cleanup_ctx`` that starts it under the app's ``Supervisor`` once the
components exist (``gateway.app.wiring``'s ``components``) and stops it in reverse: the snapshot sync, the
API-key sync, the replica poller, the lease heartbeat, the adapter sweep, the canary and rollout gate, the
purger (purge-all) and the KV events (the tokenizers, the KV indexer, the routing trust)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
from collections.abc import AsyncIterator

from aiohttp import web

from gateway.app.keys import (
    ACTIVITY,
    BASE_PRINTS,
    CALLERS,
    GATE,
    KV_INDEX_FD,
    LEASES,
    LOADER,
    METRICS,
    POOL,
    PRECISE_INDEX,
    PROXY,
    PURGER,
    QUARANTINE,
    RESEEDER,
    ROUTING_TRUST,
    SETTINGS,
    SIBLINGS,
    SNAPSHOT,
    SUPERVISOR,
    TABLE,
    TOKENIZERS,
    VERDICTS,
)  # fmt: skip
from gateway.fleet.invalidation import PURGE_ALL, PurgeAll
from gateway.kv import trust
from gateway.kv.indexer import page_path
from gateway.kv.shared_index import SharedReader
from gateway.process.indexer import kept_indexer
from gateway.process.parent import embedded_redis_url
from gateway.proof.canary import Canary
from gateway.proof.gate import LEASE_INTERVALS, Gate, GateRules, tick_of
from gateway.table.callers import CallerSync, CallerTable
from gateway.table.rollout_gate import GateTable
from gateway.table.snapshot import SnapshotSync
from gateway.table.snapshot_file import snapshot_file
from gateway.tasks.supervisor import periodically

log = logging.getLogger(__name__)


async def snapshot_sync(app: web.Application) -> AsyncIterator[None]:
    sync = SnapshotSync(
        app[TABLE],
        app[SNAPSHOT],
        interval=app[SETTINGS].reconcile_interval,
        reseeder=app[RESEEDER],
        on_replica_hint=app[POOL].refresh_hinted,
        scrub_page=app[SETTINGS].scrub_page,
        metrics=app[METRICS],
        file=snapshot_file(app[SETTINGS].data_dir, app[SETTINGS].snapshot_file_interval, app[METRICS]),
    )
    await sync.reconcile()
    async with app[SUPERVISOR].run("snapshot-sync", sync.run, period=app[SETTINGS].reconcile_interval):
        yield


async def caller_sync(app: web.Application) -> AsyncIterator[None]:
    if CALLERS not in app:
        yield
        return
    sync = CallerSync(CallerTable(app[TABLE].redis), app[CALLERS], interval=app[SETTINGS].reconcile_interval)
    await sync.reload()
    log.info("API keys on: %d keys", len(app[CALLERS]))
    async with app[SUPERVISOR].run("api-key-sync", sync.run, period=app[SETTINGS].reconcile_interval):
        yield


async def replica_poller(app: web.Application) -> AsyncIterator[None]:
    pool, prints, interval = app[POOL], app[BASE_PRINTS], app[SETTINGS].poll_interval
    await pool.refresh_all()
    await prints.check_all()
    poll = functools.partial(pool.poll_forever, interval, app[TABLE], prints.check_all)
    async with app[SUPERVISOR].run("replica-poll", poll, period=interval):
        yield


async def lease_heartbeat(app: web.Application) -> AsyncIterator[None]:
    leases = app[LEASES]
    async with app[SUPERVISOR].run("leases-heartbeat", leases.run, period=leases.interval):
        yield
    await leases.let_go()


async def sweeper(app: web.Application) -> AsyncIterator[None]:
    sweep, interval = app[LOADER].sweep_forever, app[SETTINGS].poll_interval
    async with app[SUPERVISOR].run("adapter-sweep", functools.partial(sweep, interval), period=interval):
        yield


async def purger(app: web.Application) -> AsyncIterator[None]:
    settings = app[SETTINGS]
    if settings.invalidation != PURGE_ALL:
        yield
        return
    app[PURGER] = PurgeAll(app[POOL], app[SNAPSHOT], app[METRICS], drain_grace=settings.drain_grace)
    async with app[SUPERVISOR].run("purger", app[PURGER].run, period=settings.reconcile_interval):
        yield


async def canary_rounds(app: web.Application) -> AsyncIterator[None]:
    """The canary over active IDs and the rollout gate over running rollouts: each on when its interval is."""
    settings = app[SETTINGS]
    canary = Canary(
        app[SNAPSHOT], app[POOL], app[ACTIVITY], app[METRICS], app[QUARANTINE], verdicts=app[VERDICTS]
    )
    rules = GateRules(
        settings.rollout_error_margin, settings.rollout_min_requests, settings.rollout_audit_tolerance
    )
    interval = settings.rollout_gate_interval
    shared = GateTable(app[TABLE], app[LEASES].gateway_id, ttl_ms=round(LEASE_INTERVALS * interval * 1000),
                       interval_ms=round(interval * 1000))  # fmt: skip
    gate = app[GATE] = Gate(
        app[SNAPSHOT], app[TABLE], canary, app[PROXY].rollouts, app[METRICS], rules, shared
    )
    async with contextlib.AsyncExitStack() as tasks:
        if interval:
            tasks.push_async_callback(gate.stop)  # runs last: once the gate's task stopped
        for name, period, step in (
            ("canary", settings.canary_interval, canary.run_round),
            ("rollout-gate", tick_of(interval), gate.run_round),  # one process's rounds an interval apart
        ):
            if period:
                rounds = functools.partial(periodically, period, step)
                await tasks.enter_async_context(app[SUPERVISOR].run(name, rounds, period=period))
        yield


async def kv_followers(app: web.Application) -> AsyncIterator[None]:
    """Each base's tokenizer looked for (first before serving, then at every poll: a base or a root seen
    for the first time); the KV indexer (``kv.indexer``, its own process) while this process owns the
    shared table (one process; with --workers the parent keeps it), told of each replica restart this
    process's poll sees and of each purge kvgate makes (that replica's view emptied); the routing trust
    gauges and the start line on predicted routing."""
    settings, pool, supervisor = app[SETTINGS], app[POOL], app[SUPERVISOR]
    reader, tokenizers = app.get(PRECISE_INDEX), app.get(TOKENIZERS)
    async with contextlib.AsyncExitStack() as stack:
        if reader is not None:
            await _follow_events(app, reader, stack)
        if tokenizers is not None:
            await tokenizers.learn(pool.replicas)
            learning = functools.partial(
                periodically, settings.poll_interval, functools.partial(tokenizers.learn, pool.replicas)
            )
            await stack.enter_async_context(
                supervisor.run("tokenizers", learning, period=settings.poll_interval)
            )
        routing = app.get(ROUTING_TRUST)
        if routing is not None:
            trust.track(app[METRICS], routing)
            stack.callback(trust.untrack, app[METRICS])  # its gauges read the shared table, closed after
        siblings = app.get(SIBLINGS)
        shared = settings.redis_url not in (None, embedded_redis_url(settings))  # not its own embedded one
        processes = _processes(shared, siblings.count if siblings else 1)
        if processes and (siblings is None or siblings.slot == 0):  # one line per kvgate, not per worker
            announce = trust.announce(routing, app[PROXY].replica_names, processes)
            stack.push_async_callback(_cancelled, asyncio.ensure_future(announce))
        yield


async def _follow_events(
    app: web.Application, reader: SharedReader, stack: contextlib.AsyncExitStack
) -> None:
    """The KV indexer's side of this process: purges and restarts told to it, and the indexer itself
    when this process made the shared table (``kept_indexer``)."""
    settings = app[SETTINGS]
    if PURGER in app:
        app[PURGER].on_purged = lambda replica: reader.purged(replica.url)
    seen = {replica.url: replica.incarnation for replica in app[POOL].replicas}

    async def restarts() -> None:
        """A restart this process's poll saw (not its first sight of the replica) is told to the indexer."""
        for replica in app[POOL].replicas:
            if seen[replica.url] and replica.incarnation != seen[replica.url]:
                reader.restarted(replica.url)
            seen[replica.url] = replica.incarnation

    watch = functools.partial(periodically, settings.poll_interval, restarts)
    await stack.enter_async_context(app[SUPERVISOR].run("kv-restarts", watch, period=settings.poll_interval))
    if reader.owner() == os.getpid():  # one process: it keeps the indexer (a worker's parent does)
        await stack.enter_async_context(kept_indexer(
            app[KV_INDEX_FD], settings.replicas, settings.kv_event_endpoints,
            settings.precise_index_entries, page_path(settings.data_dir, reader.region.tag),
            failure_limit=settings.background_failure_limit,
        ))  # fmt: skip


def _processes(shared_redis: bool, workers: int) -> str:
    """Who else routes this fleet on a prediction of their own, in words ("" when nobody does)."""
    if workers > 1:
        return f"this kvgate's {workers} workers" + (
            " and the other kvgates on its Redis" if shared_redis else ""
        )
    return "the kvgates sharing its Redis" if shared_redis else ""


async def _cancelled(task: asyncio.Future[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


TASKS = (
    snapshot_sync, caller_sync, replica_poller, lease_heartbeat, sweeper, canary_rounds, purger, kv_followers,
)  # fmt: skip
"""In start order (after the components): the snapshot and API keys are read before anything serves."""
