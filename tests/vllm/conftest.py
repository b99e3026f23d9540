"""Two real vLLM CPU replicas serving the tiny local model, started once per test session.

``make test`` builds the fixture and the vLLM virtualenv and passes their paths in
``KVGATE_VLLM_PYTHON`` and ``KVGATE_FIXTURE_DIR``. Without them these tests fail: they never skip.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio
from redis.asyncio import Redis

from gateway.redis_server import EmbeddedRedis
from gateway.vllm_process import VllmProcess, VllmReplicaSpec, free_port, start_replicas


def _required_path(variable: str) -> Path:
    value = os.environ.get(variable)
    if not value or not Path(value).exists():
        pytest.fail(f"{variable} is not set to an existing path: run the suite with `make test`")
    return Path(value)


@pytest.fixture(scope="session")
def fixture_dir() -> Path:
    return _required_path("KVGATE_FIXTURE_DIR")


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def vllm_replicas(
    fixture_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[list[VllmProcess]]:
    python = _required_path("KVGATE_VLLM_PYTHON")
    logs = tmp_path_factory.mktemp("vllm-logs")
    specs = [
        VllmReplicaSpec(python, fixture_dir / "model", free_port(), logs / f"replica-{i}.log") for i in (0, 1)
    ]
    replicas = await start_replicas(specs)
    try:
        yield replicas
    finally:
        for replica in replicas:
            await replica.stop()


@pytest_asyncio.fixture(loop_scope="session")
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


@pytest_asyncio.fixture(loop_scope="session")
async def session_redis(redis_server: EmbeddedRedis) -> AsyncIterator[Redis]:
    client = Redis.from_url(redis_server.url)
    await client.flushdb()
    try:
        yield client
    finally:
        await client.aclose()


async def post_json(http: aiohttp.ClientSession, url: str, body: dict[str, object]) -> str:
    async with http.post(url, json=body) as response:
        text = await response.text()
        assert response.status == 200, f"{url} answered {response.status}: {text}"
        return text


async def listed(http: aiohttp.ClientSession, url: str) -> dict[str, str]:
    """What a replica lists as loaded: adapter name -> root."""
    async with http.get(f"{url}/v1/models") as response:
        doc = await response.json()
    return {m["id"]: m["root"] for m in doc["data"] if m.get("parent")}
