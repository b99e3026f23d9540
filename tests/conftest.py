"""Shared fixtures: a real redis-server for the session, synthetic adapter directories.

The real-vLLM fixtures live in ``tests/vllm/conftest.py``; they start two replicas once per session.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import pytest_asyncio
from redis.asyncio import Redis

from gateway.table.epoch_table import EpochTable
from gateway.table.redis_server import EmbeddedRedis


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis(tmp_path_factory.mktemp("redis")) as server:
        yield server


@asynccontextmanager
async def flushed_client(server: EmbeddedRedis) -> AsyncIterator[Redis]:
    """A client of the session's redis-server, on an empty database (each test starts from nothing)."""
    client = Redis.from_url(server.url)
    await client.flushdb()
    try:
        yield client
    finally:
        await client.aclose()


@pytest_asyncio.fixture
async def redis(redis_server: EmbeddedRedis) -> AsyncIterator[Redis]:
    async with flushed_client(redis_server) as client:
        yield client


@pytest_asyncio.fixture
async def table(redis: Redis) -> EpochTable:
    return EpochTable(redis)


MakeAdapter = Callable[..., Path]


@pytest.fixture
def make_adapter(tmp_path: Path) -> MakeAdapter:
    """Write a small PEFT-shaped adapter directory; ``weights`` sets the bytes that make it a version."""
    counter = iter(range(1_000_000))

    def make(weights: bytes = b"weights-v1", *, extra: dict[str, bytes] | None = None) -> Path:
        root = tmp_path / f"adapter-{next(counter)}"
        root.mkdir()
        config = {"peft_type": "LORA", "r": 8, "target_modules": ["q_proj", "v_proj"]}
        (root / "adapter_config.json").write_text(json.dumps(config))
        (root / "adapter_model.safetensors").write_bytes(weights)
        for name, data in (extra or {}).items():
            path = root / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
        return root

    return make
