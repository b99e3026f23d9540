"""The aiohttp application: components wired with typed ``AppKey``s, each started by its ``cleanup_ctx``.

Start order: one shared ClientSession → epoch table and snapshot (first full read before serving) →
replica poller (first poll before serving) → drain/unload sweeper. Stopped in reverse.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
from aiohttp import web
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import Tracer

from gateway.config import Settings
from gateway.core.errors import BodyTooLarge, KvgateError
from gateway.core.scheduler import Scheduler
from gateway.fleet.backends import dialect_for
from gateway.fleet.invalidation import PURGE_ALL, VERSION_SCOPED, PurgeAll
from gateway.fleet.loader import AdapterLoader
from gateway.fleet.replicas import ReplicaPool
from gateway.periodic import periodically
from gateway.proof.canary import Canary
from gateway.request.admin import Admin, list_models
from gateway.request.proxy import Proxy, ProxyOptions
from gateway.table.connection import RedisClient
from gateway.table.epoch_table import EpochTable
from gateway.table.snapshot import Snapshot, SnapshotSync
from gateway.telemetry.metrics import CONTENT_TYPE_LATEST, Metrics
from gateway.telemetry.tracing import tracer_from

log = logging.getLogger(__name__)

SETTINGS = web.AppKey("settings", Settings)
SNAPSHOT = web.AppKey("snapshot", Snapshot)
TABLE = web.AppKey("table", EpochTable)
POOL = web.AppKey("pool", ReplicaPool)
LOADER = web.AppKey("loader", AdapterLoader)
PROXY = web.AppKey("proxy", Proxy)
METRICS = web.AppKey("metrics", Metrics)
TRACER = web.AppKey("tracer", Tracer)
PURGER = web.AppKey("purger", PurgeAll)
ADMIN = web.AppKey("admin", Admin)
ACTIVITY = web.AppKey("activity", dict[str, float])

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def openai_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error leaves as an OpenAI-style JSON body with its own status."""
    try:
        return await handler(request)
    except KvgateError as exc:
        return _error_response(exc)
    except web.HTTPRequestEntityTooLarge:
        return _error_response(BodyTooLarge("request body is over the configured limit"))
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _error_response(_http_error(exc))


def _http_error(exc: web.HTTPException) -> KvgateError:
    error = KvgateError(exc.reason)
    error.status = exc.status  # aiohttp's own errors (404 route, 405 method) keep their status
    return error


def _error_response(exc: KvgateError) -> web.Response:
    return web.Response(body=exc.json_bytes(), status=exc.status, content_type="application/json")


def session_timeout(settings: Settings) -> aiohttp.ClientTimeout:
    """No total limit (SSE streams run long); bounded connect, and a bound between bytes."""
    return aiohttp.ClientTimeout(
        total=None, connect=settings.connect_timeout, sock_read=settings.read_timeout
    )


def build_app(
    settings: Settings,
    redis: RedisClient,
    *,
    tracer_provider: TracerProvider | None = None,
    metrics: Metrics | None = None,
) -> web.Application:
    app = web.Application(client_max_size=settings.max_body_bytes, middlewares=[openai_errors])
    app[SETTINGS] = settings
    app[METRICS] = metrics = metrics or Metrics()
    app[TRACER] = tracer_from(tracer_provider)
    app[SNAPSHOT] = Snapshot(on_epoch_change=lambda logical_id: _epoch_changed(app, logical_id))
    metrics.track_staleness(app[SNAPSHOT].staleness)
    app[TABLE] = EpochTable(redis, tracer=app[TRACER], ack_timeout=settings.redis_ack_timeout)
    app[ACTIVITY] = {}
    app.cleanup_ctx.append(_components)
    app.cleanup_ctx.append(_snapshot_sync)
    app.cleanup_ctx.append(_replica_poller)
    app.cleanup_ctx.append(_sweeper)
    app.cleanup_ctx.append(_canary)
    app.cleanup_ctx.append(_purger)

    async def proxy_handler(request: web.Request) -> web.StreamResponse:
        return await request.app[PROXY].handle(request)

    async def models_handler(request: web.Request) -> web.StreamResponse:
        return list_models(request.app[SNAPSHOT], request.app[SETTINGS].base_model)

    async def status_handler(request: web.Request) -> web.StreamResponse:
        return await request.app[ADMIN].status(request)

    async def metrics_handler(request: web.Request) -> web.StreamResponse:
        body = request.app[METRICS].exposition()
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def health_handler(request: web.Request) -> web.StreamResponse:
        pool, snapshot = request.app[POOL], request.app[SNAPSHOT]
        body = {
            "replicas_healthy": len(pool.healthy()),
            "replicas": len(pool.replicas),
            "snapshot_flushed": snapshot.flushed,
            "logical_ids": len(snapshot.current_names()),
        }
        return web.json_response(body, status=200 if pool.healthy() else 503)

    app.router.add_post("/v1/completions", proxy_handler)
    app.router.add_post("/v1/chat/completions", proxy_handler)
    app.router.add_get("/v1/models", models_handler)
    app.router.add_get("/healthz", health_handler)
    app.router.add_get("/metrics", metrics_handler)
    app.router.add_get("/kvgate/status", status_handler)
    return app


def _epoch_changed(app: web.Application, logical_id: str) -> None:
    app[METRICS].epoch_changes.labels(logical_id).inc()
    if PURGER in app:
        app[PURGER].changed(logical_id)


async def _components(app: web.Application) -> AsyncIterator[None]:
    settings = app[SETTINGS]
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=256, keepalive_timeout=60)
    async with aiohttp.ClientSession(connector=connector, timeout=session_timeout(settings)) as session:
        dialect = dialect_for(settings.backend)
        with_root = settings.base_model_root is not None
        app[POOL] = ReplicaPool(settings.replicas, dialect, session, base_with_root=with_root)
        app[LOADER] = AdapterLoader(
            app[POOL],
            app[TABLE],
            app[SNAPSHOT],
            store_root=settings.store,
            budget=settings.max_adapters_per_replica,
            drain_grace=settings.drain_grace,
            load_timeout=settings.load_timeout,
            lock_ttl=settings.lock_ttl,
            metrics=app[METRICS],
            tracer=app[TRACER],
        )
        scheduler = Scheduler(settings.prefix_index_entries)
        token = settings.admin_token.get_secret_value() if settings.admin_token else None
        app[ADMIN] = Admin(token, app[SNAPSHOT], app[POOL], scheduler.index)
        options = ProxyOptions(
            base_model=settings.base_model,
            base_identity=settings.base_identity,
            max_body_bytes=settings.max_body_bytes,
            namespaces=settings.invalidation == VERSION_SCOPED and dialect.cache_namespaces,
        )
        app[PROXY] = Proxy(
            app[SNAPSHOT],
            app[POOL],
            app[LOADER],
            scheduler,
            app[ADMIN],
            dialect,
            options,
            activity=app[ACTIVITY],
            metrics=app[METRICS],
            tracer=app[TRACER],
        )
        yield


async def _snapshot_sync(app: web.Application) -> AsyncIterator[None]:
    sync = SnapshotSync(app[TABLE], app[SNAPSHOT], interval=app[SETTINGS].reconcile_interval)
    await sync.reconcile()
    async with _background(sync.run()):
        yield


async def _replica_poller(app: web.Application) -> AsyncIterator[None]:
    await app[POOL].refresh_all()
    async with _background(app[POOL].poll_forever(app[SETTINGS].poll_interval, app[TABLE])):
        yield


async def _sweeper(app: web.Application) -> AsyncIterator[None]:
    async with _background(app[LOADER].sweep_forever(app[SETTINGS].poll_interval)):
        yield


async def _purger(app: web.Application) -> AsyncIterator[None]:
    settings = app[SETTINGS]
    if settings.invalidation != PURGE_ALL:
        yield
        return
    app[PURGER] = PurgeAll(app[POOL], app[SNAPSHOT], app[METRICS], drain_grace=settings.drain_grace)
    async with _background(app[PURGER].run()):
        yield


async def _canary(app: web.Application) -> AsyncIterator[None]:
    interval = app[SETTINGS].canary_interval
    if not interval:
        yield
        return
    canary = Canary(app[SNAPSHOT], app[POOL], app[ACTIVITY], app[METRICS])
    async with _background(periodically(interval, canary.run_round)):
        yield


@contextlib.asynccontextmanager
async def _background(work: Awaitable[None]) -> AsyncIterator[None]:
    """Run ``work`` beside the app; a failure is logged at once (never silent), a stop cancels it."""
    task = asyncio.ensure_future(work)
    task.add_done_callback(_log_failure)
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def _log_failure(task: asyncio.Future[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("background task failed and stopped: %r", task.exception(), exc_info=task.exception())
