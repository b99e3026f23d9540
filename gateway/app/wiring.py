"""The aiohttp application: components wired with typed ``AppKey``s (``keys.py``), each started by its
``cleanup_ctx``.

Start order: one shared ClientSession and the components (``_components``), then the background tasks of
``gateway.app.background``: epoch table and snapshot (first read before serving) → API keys (first read
before serving, when on) → replica poller (first poll before serving) → lease heartbeat → drain/unload
sweeper → canary and rollout gate → purger → KV event followers. Stopped in reverse (the leases are let go
on the way out). Every background task runs under one ``Supervisor`` (``app[SUPERVISOR]``; serve's also
runs its embedded Redis).

With ``admin_port`` set, ``/kvgate/status`` and ``/metrics`` leave the public app (404 there, and the
admin token is refused there) for a second app, ``app[ADMIN_LISTENER]``, which serves them beside the
whole API (audits pin through it); both apps' handlers read the one set of components of the first.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import asdict

import aiohttp
from aiohttp import web
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client.metrics_core import Metric

from gateway.adapters.stores import location_prefix, open_store
from gateway.app import background
from gateway.app.keys import (
    ACTIVITY,
    ADMIN,
    ADMIN_LISTENER,
    AUTH,
    BASE_PRINTS,
    CALLERS,
    DRAIN,
    GATE,
    KV_INDEX_FD,
    LEASES,
    LIVE_CHECK,
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
    TRACER,
    VERDICTS,
)  # fmt: skip
from gateway.core.scheduler import Scheduler
from gateway.fleet.backends import dialect_for, start_warnings
from gateway.fleet.base_bytes import CACHE_FILE as BASE_DIGESTS_FILE
from gateway.fleet.base_bytes import BaseBytes
from gateway.fleet.base_prints import BasePrints, disagreements, mismatch_report
from gateway.fleet.invalidation import VERSION_SCOPED
from gateway.fleet.leases import Leases
from gateway.fleet.loader import AdapterLoader
from gateway.fleet.quarantine import Quarantine
from gateway.fleet.replicas import ReplicaPool
from gateway.kv.indexer import page_path
from gateway.kv.live_check import LiveCheck
from gateway.kv.shared_index import SharedReader, SharedRegion, create, indexer_health
from gateway.kv.tokenizers import Tokenizers
from gateway.kv.trust import RoutingTrust
from gateway.process.http_edge import EDGE, EdgeLimits, session_timeout
from gateway.process.siblings import Siblings
from gateway.request.admin import ADMIN_SURFACE, Admin, list_models
from gateway.request.auth import Auth
from gateway.request.boundary import ServerLog, openai_errors
from gateway.request.drain import Drain
from gateway.request.health import Health, Views, add_tasks, age, staleness_reason
from gateway.request.proxy import Proxy, ProxyOptions
from gateway.request.routes import ROUTES, Route
from gateway.request.status_page import PATH as STATUS_PAGE
from gateway.request.status_page import operator_fields, status_page
from gateway.settings.flags import tenant_warnings
from gateway.settings.model import Settings
from gateway.table.callers import Callers
from gateway.table.connection import RedisClient
from gateway.table.epoch_table import EpochTable
from gateway.table.leases import LeaseTable
from gateway.table.reseed import Reseeder
from gateway.table.snapshot import Snapshot
from gateway.tasks.supervisor import Supervisor
from gateway.telemetry.merge import PageCollector, merge_pages
from gateway.telemetry.metrics import CONTENT_TYPE_LATEST, Metrics
from gateway.telemetry.tracing import tracer_from

log = logging.getLogger(__name__)


def build_app(
    settings: Settings,
    redis: RedisClient,
    *,
    tracer_provider: TracerProvider | None = None,
    metrics: Metrics | None = None,
    supervisor: Supervisor | None = None,
    siblings: Siblings | None = None,
    kv_index_fd: int | None = None,
) -> web.Application:
    app = web.Application(
        client_max_size=settings.max_body_bytes,
        middlewares=[openai_errors],
        handler_args={"logger": ServerLog(logging.getLogger("aiohttp.server"))},
    )
    app[SETTINGS] = settings
    app[EDGE] = EdgeLimits.of(settings)  # deadlines and limits on client connections (process/http_edge.py)
    app[METRICS] = metrics = metrics or Metrics(
        top_k=settings.metrics_top_k, rerank_interval=settings.metrics_rerank_interval
    )
    app[TRACER] = tracer_from(tracer_provider)
    app[SUPERVISOR] = supervisor or Supervisor(failure_limit=settings.background_failure_limit)
    metrics.track_restarts(app[SUPERVISOR].restart_counts)
    app[SNAPSHOT] = Snapshot(on_epoch_change=lambda logical_id: _epoch_changed(app, logical_id))
    metrics.track_staleness(app[SNAPSHOT].staleness)
    app[TABLE] = EpochTable(
        redis, tracer=app[TRACER], ack_timeout=settings.ack_within, log_kept=settings.change_log_length
    )
    app[RESEEDER] = Reseeder(app[TABLE], open_store(settings.store).proves, metrics)
    app[ACTIVITY] = {}
    app[VERDICTS] = {}
    app[DRAIN] = Drain()
    if siblings is not None:
        app[SIBLINGS] = siblings
    if kv_index_fd is not None:  # a worker: the parent made the shared KV index and keeps its indexer
        app[KV_INDEX_FD] = kv_index_fd
    if settings.auth == "api-keys":
        app[CALLERS] = Callers(max_staleness=settings.auth_max_staleness, metrics=metrics)
    for component in (_components, *background.TASKS):
        app.cleanup_ctx.append(component)

    # Handlers read `app`'s components (not `request.app`): the admin listener's app serves them too.
    def proxy_handler(route: Route) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        async def handler(request: web.Request) -> web.StreamResponse:
            drain = app[DRAIN]
            drain.begin()
            try:
                return await app[PROXY].handle(request, route)
            finally:
                drain.end()

        return handler

    async def models_handler(request: web.Request) -> web.StreamResponse:
        bases = {app[SETTINGS].base_model, *app[POOL].base_identities()}
        return list_models(app[SNAPSHOT], sorted(bases), app[AUTH].caller(request))

    async def status_handler(request: web.Request) -> web.StreamResponse:
        return await app[ADMIN].status(request)

    async def metrics_handler(request: web.Request) -> web.StreamResponse:
        app[ADMIN].check_scrape(request, public=ADMIN_LISTENER not in app)
        body = app[METRICS].exposition()
        if SIBLINGS in app:
            body = app[SIBLINGS].metrics(body)
        if SIBLINGS in app and PRECISE_INDEX in app:  # the KV indexer's page, once whichever worker answers
            with contextlib.suppress(OSError):
                page = page_path(app[SETTINGS].data_dir, app[PRECISE_INDEX].region.tag).read_bytes()
                body = merge_pages([body, page])
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def health_handler(request: web.Request) -> web.StreamResponse:
        health = local_health(app)
        if SIBLINGS in app:
            health = await app[SIBLINGS].health(health)
        detailed = request.app is not app or app[ADMIN].allows(request)  # the admin listener, or the token
        return web.json_response(health.view(detailed), status=200 if health.ready else 503)

    def api_routes(target: web.Application) -> None:
        target.router.add_get("/v1/models", models_handler)
        for route in ROUTES:  # every vLLM model route; nothing else reaches a replica
            target.router.add_route(route.method, route.path, proxy_handler(route))
        target.router.add_get("/healthz", health_handler)

    api_routes(app)
    admin = app
    if settings.admin_port is not None:  # the admin surface on a listener of its own
        app[ADMIN_SURFACE] = False
        admin = web.Application(client_max_size=settings.max_body_bytes, middlewares=[openai_errors])
        api_routes(admin)
        app[ADMIN_LISTENER] = admin
    admin.router.add_get("/metrics", metrics_handler)
    admin.router.add_get("/kvgate/status", status_handler)
    admin.router.add_get(STATUS_PAGE, status_page)  # HTML, no data: it fetches /kvgate/status with the token
    return app


def local_health(app: web.Application) -> Health:
    """This process's /healthz: readiness, its reasons and both views (``request.health``; with
    --workers, a worker's own: siblings.py merges)."""
    settings, pool, snapshot, drain = app[SETTINGS], app[POOL], app[SNAPSHOT], app[DRAIN]
    views, unready = Views(), []
    healthy = len(pool.healthy())
    views.add("replicas_healthy", healthy)
    views.add("replicas", len(pool.replicas))
    views.add("base_disagreements", len(disagreements(pool)))  # which, and why: /kvgate/status
    if not healthy:
        unready.append(f"no healthy replica (of {len(pool.replicas)}): no base is served")
    views.add("snapshot_flushed", snapshot.flushed)
    views.add("logical_ids", len(snapshot.current_names()))
    table = views.section("table")
    table.add("generation", snapshot.generation)
    table.add("age_s", age(snapshot.staleness()))  # since the snapshot was last confirmed current
    table.add("followed", not snapshot.flushed)  # the change log is followed (Redis answers)
    table.add("max_age_s", settings.table_max_staleness)
    for key, value in app[RESEEDER].health().items():
        table.add(key, value)
    table.add("malformed_rows", len(snapshot.malformed), detail=dict(snapshot.malformed))
    if settings.table_max_staleness is not None and (
        why := staleness_reason("the epoch table", snapshot.staleness(), "table_max_staleness",
                                settings.table_max_staleness)
    ):  # fmt: skip
        unready.append(why)
    views.add("draining", drain.draining)
    if drain.draining:
        unready.append("draining (shutting down): send requests to another kvgate")
    if CALLERS in app:
        callers, keys = app[CALLERS], views.section("api_keys")
        for key, value in callers.health().items():
            if key == "malformed":  # key id -> why: the ids for the detail view only
                keys.add(key, len(value), detail=value)
            else:
                keys.add(key, value)
        keys.add("age_s", age(callers.staleness()))
        keys.add("max_age_s", callers.max_staleness)
        if why := staleness_reason("API keys", callers.staleness(), "auth_max_staleness",
                                   callers.max_staleness, ": every keyed request gets 503"):  # fmt: skip
            unready.append(why)
    failing = add_tasks(views, app[SUPERVISOR])  # a task that keeps failing: its state no longer moves
    unready += [f"background task {name} keeps failing" for name in failing]
    if ROUTING_TRUST in app:  # each replica's events (the KV indexer's record) and this process's trust
        counts, streams = app[ROUTING_TRUST].health(app[PROXY].replica_names)  # names replicas
        views.add("kv_events", counts, detail=streams)
        views.add("kv_indexer", indexer_health(app[ROUTING_TRUST].events))
    else:
        views.add("kv_events", {"streams": 0}, detail={})
    if TOKENIZERS in app:  # per base: where its tokenizer was read, or why it has none
        bases = app[TOKENIZERS].health()
        found = sum(how.startswith("from ") for how in bases.values())
        views.add("tokenizers", {"found": found, "missing": len(bases) - found}, detail=bases)
    views.add("unready", unready)
    return Health(not unready, views.public, views.detail)


def _epoch_changed(app: web.Application, logical_id: str) -> None:
    metrics = app[METRICS]
    metrics.epoch_changes.labels(metrics.for_id(logical_id)).inc()
    if PURGER in app:
        app[PURGER].changed(logical_id)


def _indexer_page(app: web.Application) -> Iterable[Metric] | None:
    """A worker's view of the KV indexer's series (its page); None: this registry holds them."""
    if SIBLINGS not in app or PRECISE_INDEX not in app:
        return None
    settings = app[SETTINGS]
    return PageCollector(
        functools.partial(page_path, settings.data_dir, app[PRECISE_INDEX].region.tag)
    ).collect()


def _kv_index(app: web.Application) -> SharedReader:
    """The shared KV index this process reads: its parent's (a worker), else one it makes (its
    ``kv_followers`` task then keeps the indexer that writes it)."""
    settings = app[SETTINGS]
    if KV_INDEX_FD not in app:
        app[KV_INDEX_FD] = create(settings.precise_index_entries, settings.replicas)
    app[PRECISE_INDEX] = reader = SharedReader(SharedRegion(app[KV_INDEX_FD], settings.replicas))
    if SIBLINGS not in app:  # one process: the indexer's page in its own registry (workers merge it)
        page = functools.partial(page_path, settings.data_dir, reader.region.tag)
        app[METRICS].without_kv_events()
        app[METRICS].registry.register(PageCollector(page))
    return reader


async def _components(app: web.Application) -> AsyncIterator[None]:
    settings = app[SETTINGS]
    kv_inherited = app.get(KV_INDEX_FD)
    # No pool limit here: kvgate limits connections per replica itself (max_connections_per_replica)
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=60)
    async with aiohttp.ClientSession(connector=connector, timeout=session_timeout(settings)) as session:
        dialect = dialect_for(settings.backend)
        with_root = settings.base_model_root is not None
        app[POOL] = ReplicaPool(
            settings.replicas, dialect, session, base_with_root=with_root,
            max_connections=settings.max_connections_per_replica, pool_wait=settings.pool_wait_timeout,
            agents=settings.agent_map,
        )  # fmt: skip
        app[BASE_PRINTS] = BasePrints(
            app[POOL],
            floor=settings.base_print_tolerance,
            model_dirs=settings.base_model_dir_map,
            bytes_=BaseBytes(settings.data_dir / BASE_DIGESTS_FILE),
        )
        pool, snapshot = app[POOL], app[SNAPSHOT]
        app[BASE_PRINTS].watch(app[METRICS], snapshot)
        gateway_id = settings.gateway_id or f"gw-{secrets.token_hex(6)}"
        app[QUARANTINE] = quarantine = Quarantine(app[POOL], app[METRICS])
        app[LEASES] = Leases(
            LeaseTable(app[TABLE], gateway_id, ttl_ms=int(settings.lease_ttl * 1000)),
            report=lambda: {"quarantined": [asdict(finding) for finding in quarantine.findings()],
                            "base_mismatches": mismatch_report(pool, snapshot),
                            "base_disagreements": disagreements(pool)},
        )  # fmt: skip
        app[LOADER] = AdapterLoader(
            app[POOL],
            app[TABLE],
            app[SNAPSHOT],
            store_prefix=location_prefix(open_store(settings.store)),
            budget=settings.max_adapters_per_replica,
            drain_grace=settings.drain_grace,
            max_drain=settings.max_drain,
            load_timeout=settings.load_timeout,
            lock_ttl=settings.lock_ttl,
            slot_wait=settings.slot_wait_timeout,
            leases=app[LEASES],
            quarantine=app[QUARANTINE],
            metrics=app[METRICS],
            tracer=app[TRACER],
            agent_token=settings.agent_token.get_secret_value() if settings.agent_token else "",
        )
        precise = tokens = live = None
        if settings.kv_events:  # the KV indexer's table (shared), each base's tokenizers, the live check
            app[TOKENIZERS] = tokens = Tokenizers.at_start(
                settings.base_model, settings.tokenizer, settings.base_model_dir_map
            )  # an explicit tokenizer that cannot be read stops the start (config fails closed)
            precise = _kv_index(app)
            app[LIVE_CHECK] = live = LiveCheck(
                app[METRICS], precise.block_size,
                window=settings.token_check_window, max_mismatch=settings.token_check_max_mismatch,
            )  # fmt: skip
            app[ROUTING_TRUST] = RoutingTrust(precise, app[POOL].replicas, tokens, live)
        scheduler = Scheduler(settings.prefix_index_entries, precise=precise, trust=live)
        token = settings.admin_token.get_secret_value() if settings.admin_token else None
        app[ADMIN] = Admin(
            token, app[SNAPSHOT], app[POOL], scheduler.index, leases=app[LEASES], quarantine=app[QUARANTINE],
            extra_fields=lambda: {**operator_fields(app[METRICS], app[VERDICTS], kv=_indexer_page(app)),
                                  "rollouts": app[GATE].report() if GATE in app else {}},
        )  # fmt: skip
        app[AUTH] = Auth(app.get(CALLERS), app[ADMIN])
        for warning in [*start_warnings(dialect), *tenant_warnings(settings, dialect.cache_namespaces)]:
            log.warning("%s", warning)
        options = ProxyOptions(
            base_model=settings.base_model,
            base_identity=settings.base_identity,
            max_body_bytes=settings.max_body_bytes,
            namespaces=settings.invalidation == VERSION_SCOPED and dialect.cache_namespaces,
            expose_replica_urls=settings.expose_replica_urls,
            tokens=tokens,
            connect_timeout=settings.connect_timeout,
            read_timeout=settings.read_timeout,
        )
        app[PROXY] = Proxy(
            app[SNAPSHOT], app[POOL], app[LOADER], app[LEASES], scheduler, app[ADMIN], dialect, options,
            auth=app[AUTH], activity=app[ACTIVITY], metrics=app[METRICS], tracer=app[TRACER], live=live,
        )  # fmt: skip
        yield
        app[PROXY].upstream.close()
        app[PROXY].intake.close()  # its body lane
        if precise is not None:
            precise.region.close()
            if app[KV_INDEX_FD] != kv_inherited:
                os.close(app[KV_INDEX_FD])
        await app[LOADER].stop()  # loads in flight, before the session they use closes
