"""How a command reaches the epoch table: the configured Redis (one server, Sentinel or a Cluster), or the
embedded one under ``--data-dir``."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from opentelemetry.sdk.trace import TracerProvider
from redis.exceptions import RedisError

from gateway.core.errors import TableUnavailable
from gateway.settings.model import Settings
from gateway.table.connection import connect
from gateway.table.epoch_table import EpochTable
from gateway.table.redis_server import EmbeddedRedis
from gateway.tasks.supervisor import Supervisor
from gateway.telemetry.tracing import tracer_from

REVIVE_PERIOD_S = 2.0
"""The embedded Redis's supervision is judged over this period: restarts of the server that keep failing
for ``background_failure_limit`` periods (10 s by default) end ``kvgate serve`` (exit 1)."""


@contextlib.asynccontextmanager
async def open_table(
    settings: Settings, tracing: TracerProvider | None, *, supervisor: Supervisor | None = None
) -> AsyncIterator[EpochTable]:
    """The configured Redis, or the embedded one under ``--data-dir``: with a ``supervisor`` (serve) this
    process owns it and restarts it if it dies (a server that cannot be restarted is fatal); otherwise the
    running one is used (or, when nobody owns the directory, one is started for this command). A Redis
    that fails is ``TableUnavailable``: one line."""
    async with contextlib.AsyncExitStack() as stack:
        url = settings.redis_url
        if url is None:
            server = EmbeddedRedis(settings.data_dir, answer_timeout=settings.redis_timeout)
            if supervisor is not None:
                stack.enter_context(server)
                revive = supervisor.run(
                    "embedded-redis", server.supervise, period=REVIVE_PERIOD_S, fatal=True
                )
                await stack.enter_async_context(revive)
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
