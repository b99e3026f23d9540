"""Shared fixtures: a real redis-server for the session, synthetic adapter directories.

The real-vLLM fixtures live in ``tests/vllm/conftest.py``; they start two replicas once per session.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import pytest_asyncio
from redis.asyncio import Redis

from gateway.adapters.store import AdapterStore
from gateway.core.identity import versioned_name
from gateway.table.epoch_table import EpochTable
from gateway.table.redis_server import EmbeddedRedis
from tests.support.adapter_files import MakeAdapter, Publish
from tests.support.redis_db import flushed_client
from tests.support.s3_server import S3Server, environment, s3_server
from tests.support.xdist_groups import make_scheduler


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist's: known only when it is installed
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """Under ``make test`` (xdist workers), each group of tests/support/xdist_groups.py in one worker."""
    return make_scheduler(config, log)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest_asyncio.fixture
async def redis(redis_server: EmbeddedRedis) -> AsyncIterator[Redis]:
    async with flushed_client(redis_server) as client:
        yield client


@pytest_asyncio.fixture
async def table(redis: Redis) -> EpochTable:
    return EpochTable(redis)


@pytest.fixture
def make_adapter(tmp_path: Path) -> MakeAdapter:
    """Write a small PEFT-shaped adapter directory; ``weights`` sets the bytes that make it a version."""
    counter = iter(range(1_000_000))

    def make(weights: bytes = b"weights-v1", *, extra: dict[str, bytes] | None = None) -> Path:
        root = tmp_path / f"adapter-{next(counter)}"
        root.mkdir()
        config = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}
        (root / "adapter_config.json").write_text(json.dumps(config))
        (root / "adapter_model.safetensors").write_bytes(weights)
        for name, data in (extra or {}).items():
            path = root / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
        return root

    return make


@pytest.fixture
def store(tmp_path: Path) -> AdapterStore:
    return AdapterStore(tmp_path / "store")


@pytest.fixture
def publish(store: AdapterStore, table: EpochTable, make_adapter: MakeAdapter) -> Publish:
    """Publish ``weights`` as the current version of a logical ID (for base ``base``); the versioned name."""

    async def do(logical_id: str, weights: bytes) -> str:
        artifact = store.ingest(make_adapter(weights))
        name = versioned_name(logical_id, artifact.digest)
        await table.publish(logical_id, artifact.digest, name, str(artifact.path), "base")
        return name

    return do


@pytest.fixture(scope="session")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """moto's standalone S3 server (a real process, the real protocol), the ``AWS_*`` environment set."""
    with s3_server(tmp_path_factory.mktemp("s3") / "moto.log") as server, environment(server.environment()):
        yield server


@pytest.fixture
def s3_url(s3: S3Server) -> str:
    """A fresh bucket's store location, ``s3://BUCKET/store``."""
    return f"s3://{s3.new_bucket()}/store"
