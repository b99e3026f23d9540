"""How a command reaches the epoch table: the configured Redis (one server, Sentinel or a Cluster), or the
embedded one under ``--data-dir``."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from opentelemetry.sdk.trace import TracerProvider
from redis.exceptions import RedisError

from gateway.config import Settings
from gateway.core.errors import TableUnavailable
from gateway.periodic import background
from gateway.table.connection import connect
from gateway.table.epoch_table import EpochTable
from gateway.table.redis_server import EmbeddedRedis
from gateway.telemetry.tracing import tracer_from


@contextlib.asynccontextmanager
async def open_table(
    settings: Settings, tracing: TracerProvider | None, *, own: bool = False
) -> AsyncIterator[EpochTable]:
    """The configured Redis, or the embedded one under ``--data-dir``: with ``own`` (serve) this process
    owns it and restarts it if it dies; otherwise the running one is used (or, when nobody owns the
    directory, one is started for this command). A Redis that fails is ``TableUnavailable``: one line."""
    async with contextlib.AsyncExitStack() as stack:
        url = settings.redis_url
        if url is None:
            server = EmbeddedRedis(settings.data_dir, answer_timeout=settings.redis_timeout)
            if own:
                stack.enter_context(server)
                await stack.enter_async_context(background(server.supervise()))
            else:
                stack.enter_context(server.using())
            url = server.url
        try:
            async with connect(
                url, answer_within=settings.redis_timeout
            ) as redis:  # a server, Sentinel, a Cluster
                yield EpochTable(
                    redis,
                    tracer=tracer_from(tracing),
                    ack_timeout=settings.ack_within,
                    log_kept=settings.change_log_length,
                )
        except RedisError as exc:
            raise TableUnavailable(f"the epoch table's Redis failed: {exc}") from exc
