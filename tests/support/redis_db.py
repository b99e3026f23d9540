"""A client of the session's redis-server on an empty database."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from redis.asyncio import Redis

from gateway.table.redis_server import EmbeddedRedis


@asynccontextmanager
async def flushed_client(server: EmbeddedRedis) -> AsyncIterator[Redis]:
    """A client of the session's redis-server, on an empty database (each test starts from nothing)."""
    client = Redis.from_url(server.url)
    await client.flushdb()
    try:
        yield client
    finally:
        await client.aclose()
