"""Redis that answers but refuses writes (``maxmemory`` reached: "OOM command not allowed") for a few
seconds is waited out, like an outage: the replica poll and the leases heartbeat go on, the kvgate is
alive in the fleet again after, and a peer never takes it for dead and unloads under its stream.

A real redis-server of its own per test (``CONFIG SET maxmemory 1`` with ``noeviction``, then back), a
stub replica, two kvgates in the second test.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
from redis.asyncio import Redis

from gateway.adapters.publish import publish_adapter
from gateway.adapters.store import AdapterStore
from gateway.app.keys import LEASES
from gateway.app.wiring import build_app
from gateway.process.http_edge import running
from gateway.settings.model import Settings
from gateway.table.epoch_table import EpochTable
from gateway.table.leases import live_gateways
from gateway.table.redis_server import EmbeddedRedis
from tests.support.adapter_files import MakeAdapter
from tests.support.conditions import eventually
from tests.support.stub_backend import StubState, build_stub

REFUSAL_S = 4.0  # as long as the refusal seen in the issue


@contextlib.asynccontextmanager
async def own_redis(tmp_path: Path) -> AsyncIterator[Redis]:
    """A redis-server for this test alone: its memory limit is changed."""
    with EmbeddedRedis(tmp_path / "redis-home") as server:
        client = Redis.from_url(server.url)
        try:
            yield client
        finally:
            await client.aclose()


@contextlib.asynccontextmanager
async def refusing_writes(redis: Redis) -> AsyncIterator[None]:
    await redis.config_set("maxmemory-policy", "noeviction")
    await redis.config_set("maxmemory", 1)
    try:
        yield
    finally:
        await redis.config_set("maxmemory", 0)


async def health(url: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as http, http.get(f"{url}/healthz") as response:
        doc: dict[str, Any] = await response.json()
        return doc


async def test_the_poll_and_the_heartbeat_wait_out_a_redis_refusing_writes(tmp_path: Path) -> None:
    state = StubState()
    async with own_redis(tmp_path) as redis, running(build_stub(state)) as stub_url:
        settings = Settings(replicas=[stub_url], store=tmp_path / "store", poll_interval=0.1,
                            reconcile_interval=0.1, lease_ttl=2)  # fmt: skip
        app = build_app(settings, redis)
        async with running(app) as url:
            table = EpochTable(redis)
            gateway_id = app[LEASES].gateway_id
            await eventually(lambda: _alive(table, gateway_id), "the kvgate is alive in the fleet")
            async with refusing_writes(redis):
                assert not await _writes(redis), "Redis refuses writes"
                await asyncio.sleep(REFUSAL_S)  # longer than the lease time to live: it expires meanwhile
                assert not await _alive(table, gateway_id)
            listings = state.listings
            await eventually(lambda: state.listings > listings + 5, "the replica is polled after the refusal")
            await eventually(lambda: _alive(table, gateway_id), "the kvgate is alive again after it")
            doc = await health(url)
            assert doc["failing"] == []
            assert doc["snapshot_flushed"] is False, "a write refusal is not an outage: the snapshot is kept"
            assert await _writes(redis)


async def test_a_peer_does_not_unload_under_a_running_stream_after_redis_refused_writes(
    tmp_path: Path, make_adapter: MakeAdapter
) -> None:
    """Seen in the issue: the refusal killed A's heartbeat, its lease expired, and B (a second kvgate)
    unloaded the version under A's running stream. Here A streams v1, Redis refuses writes for 4 s,
    then v2 is published: B may unload v1 only once A's stream is over."""
    hold = asyncio.Event()
    state = StubState(hold=hold)  # the stream waits after its first chunk
    store = AdapterStore(tmp_path / "store")
    async with own_redis(tmp_path) as redis, running(build_stub(state)) as stub_url:
        table = EpochTable(redis)
        v1 = await publish_adapter(table, store, "tenant-42", make_adapter(b"v1"), "base")
        settings = Settings(replicas=[stub_url], store=store.root, poll_interval=0.1, reconcile_interval=0.1,
                            lease_ttl=12, drain_grace=0.5)  # fmt: skip
        app_a, app_b = build_app(settings, redis), build_app(settings, redis)
        async with running(app_a) as url_a, running(app_b), aiohttp.ClientSession() as http:
            body = {"model": "tenant-42", "prompt": "p", "max_tokens": 8, "stream": True}
            async with http.post(f"{url_a}/v1/completions", json=body) as stream:
                assert stream.status == 200
                first = await stream.content.readline()
                assert first.startswith(b"data: "), first
                assert state.in_flight[v1.name] == 1
                async with refusing_writes(redis):
                    await asyncio.sleep(REFUSAL_S)
                await publish_adapter(table, store, "tenant-42", make_adapter(b"v2"), "base")  # v1 retired
                await asyncio.sleep(settings.lease_ttl + 2)  # A's lease would have expired by now
                assert state.unloads == [], "B unloaded v1 under A's running stream"
                assert v1.name in state.adapters
                hold.set()
                rest = await stream.read()
            assert rest.rstrip().endswith(b"data: [DONE]"), rest[-200:]
            await eventually(lambda: (v1.name, 0) in state.unloads, "v1 is unloaded once its stream is over")


async def _alive(table: EpochTable, gateway_id: str) -> bool:
    return gateway_id in await live_gateways(table)


async def _writes(redis: Redis) -> bool:
    try:
        await redis.set("kvg:test:write", json.dumps(1))
    except Exception:
        return False
    return True
