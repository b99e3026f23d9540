"""Two real vLLM CPU replicas serving the tiny local model, started once per test session.

``make test`` builds the fixture and the vLLM virtualenv and passes their paths in
``KVGATE_VLLM_PYTHON`` and ``KVGATE_FIXTURE_DIR``. Without them these tests fail: they never skip.

Under pytest-xdist (``make test`` runs ``-n``) every test here is in one group, ``vllm``
(tests/support/xdist_groups.py): one worker runs them all, so the replicas start once, in that worker.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from redis.asyncio import Redis

from gateway.app.keys import ADMIN_LISTENER
from gateway.app.wiring import build_app
from gateway.core.wire import ADMIN_TOKEN_HEADER
from gateway.dev.vllm_process import VllmProcess, VllmReplicaSpec, kv_events_args, start_replicas
from gateway.process.http_edge import free_port, running
from gateway.settings.model import Settings
from gateway.table.redis_server import EmbeddedRedis
from gateway.telemetry.metrics import Metrics
from tests.support.conditions import eventually
from tests.support.redis_db import flushed_client


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
        VllmReplicaSpec(
            python,
            fixture_dir / "model",
            free_port(),
            logs / f"replica-{i}.log",
            # request templates: tests/vllm/test_render_vllm.py compares kvgate's tokens per template
            extra_args=(*kv_events_args(), "--trust-request-chat-template", "--enable-log-requests"),
        )
        for i in (0, 1)
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
    """Like ``redis``, on the session's event loop (the loop the vLLM replicas were started on)."""
    async with flushed_client(redis_server) as client:
        yield client


ADMIN_TOKEN = "test-admin-token"


@dataclass(frozen=True)
class Gateway:
    url: str
    store: Path
    spans: InMemorySpanExporter
    metrics: Metrics
    admin_url: str | None = None  # the admin listener, when ``admin_port`` is set


GatewayFactory = Callable[..., AbstractAsyncContextManager[Gateway]]


@pytest.fixture
def make_gateway(vllm_replicas: list[VllmProcess], session_redis: Redis, tmp_path: Path) -> GatewayFactory:
    """kvgate in this process, in front of both real replicas, with an in-memory span exporter.

    Its store is ``tmp_path / "store"``, so a test can publish before starting it.
    """

    @asynccontextmanager
    async def start(**overrides: Any) -> AsyncIterator[Gateway]:
        defaults: dict[str, Any] = {
            "replicas": [replica.url for replica in vllm_replicas],
            "store": tmp_path / "store",
            "reconcile_interval": 0.2,
            "poll_interval": 0.3,
            "drain_grace": 1.0,
            "admin_token": ADMIN_TOKEN,
        }
        settings = Settings(**(defaults | overrides))
        spans = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(spans))
        metrics = Metrics()
        app = build_app(settings, session_redis, tracer_provider=provider, metrics=metrics)
        try:
            async with running(app) as url:
                if ADMIN_LISTENER not in app:
                    yield Gateway(url, Path(settings.store), spans, metrics)
                    return
                async with running(app[ADMIN_LISTENER]) as admin_url:
                    yield Gateway(url, Path(settings.store), spans, metrics, admin_url)
        finally:
            provider.shutdown()

    return start


@pytest_asyncio.fixture(loop_scope="session")
async def gateway(make_gateway: GatewayFactory) -> AsyncIterator[Gateway]:
    async with make_gateway() as started:
        yield started


async def run_kvgate(*args: str, redis_url: str, store: Path) -> tuple[int, str, str]:
    """The real CLI in a child process, without blocking this event loop (the gateway keeps serving)."""
    command = [sys.executable, "-m", "gateway.cli", *args, "--redis-url", redis_url, "--store", str(store)]
    process = await asyncio.create_subprocess_exec(
        *command, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await asyncio.wait_for(process.communicate(), timeout=240)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


async def kvgate_json(*args: str, redis_url: str, store: Path) -> dict[str, Any]:
    code, out, err = await run_kvgate(*args, "--json", redis_url=redis_url, store=store)
    assert code == 0, err
    result: dict[str, Any] = json.loads(out)
    return result


async def until_serves(
    http: aiohttp.ClientSession, url: str, logical_id: str, within: float = 10.0, **fields: object
) -> None:
    """Wait until the kvgate at ``url`` serves ``logical_id`` with these ``fields`` (``name=``, ``epoch=``:
    its snapshot, as ``/kvgate/status`` shows it): a change's hint, or a reconcile, has reached it."""

    async def serves() -> bool:
        async with http.get(f"{url}/kvgate/status", headers={ADMIN_TOKEN_HEADER: ADMIN_TOKEN}) as response:
            version = (await response.json())["versions"].get(logical_id, {})
        return all(version.get(field) == value for field, value in fields.items())

    await eventually(serves, f"{url} serves {logical_id} with {fields}", within)


async def post_json(http: aiohttp.ClientSession, url: str, body: dict[str, object]) -> str:
    async with http.post(url, json=body) as response:
        text = await response.text()
        assert response.status == 200, f"{url} answered {response.status}: {text}"
        return text
