"""Redis down means serve from the last snapshot; Redis back means a wholesale rebuild."""

from __future__ import annotations

from pathlib import Path

import aiohttp
from redis.asyncio import Redis

from gateway.adapters.publish import publish_adapter
from gateway.adapters.store import AdapterStore
from gateway.app.wiring import build_app
from gateway.process.http_edge import running
from gateway.settings.model import Settings
from gateway.table.epoch_table import EpochTable
from gateway.table.redis_server import EmbeddedRedis
from tests.support.adapter_files import MakeAdapter
from tests.support.conditions import eventually
from tests.support.stub_backend import StubState, build_stub


async def health(http: aiohttp.ClientSession, url: str) -> dict[str, object]:
    async with http.get(f"{url}/healthz") as response:
        doc: dict[str, object] = await response.json()
        return doc


async def test_requests_keep_flowing_while_redis_is_down(make_adapter: MakeAdapter, tmp_path: Path) -> None:
    server = EmbeddedRedis(tmp_path / "redis-home")
    server.start()
    redis = Redis.from_url(server.url, socket_timeout=1.0, socket_connect_timeout=1.0)
    store = AdapterStore(tmp_path / "store")
    published = await publish_adapter(EpochTable(redis), store, "tenant-42", make_adapter(b"v1"), "base")
    body = {"model": "tenant-42", "prompt": "p", "max_tokens": 1}
    try:
        async with running(build_stub(StubState())) as stub_url:
            settings = Settings(
                replicas=[stub_url], store=store.root, reconcile_interval=0.1, poll_interval=0.1
            )
            async with running(build_app(settings, redis)) as url, aiohttp.ClientSession() as http:
                async with http.post(f"{url}/v1/completions", json=body) as response:
                    assert response.status == 200  # loads v1 (the load lock needs Redis)

                server.stop()

                async def flushed() -> bool:
                    return bool((await health(http, url))["snapshot_flushed"])

                await eventually(flushed, "the snapshot flushed when Redis went away")
                for _ in range(5):
                    async with http.post(f"{url}/v1/completions", json=body) as response:
                        assert response.status == 200
                        assert response.headers["x-kvgate-version"] == published.name

                server.start()  # same data directory: the append-only file brings the table back

                async def confirmed() -> bool:
                    return not await flushed()

                await eventually(confirmed, "the snapshot confirmed again (the append-only file's table)")
                async with http.post(f"{url}/v1/completions", json=body) as response:
                    assert response.status == 200
    finally:
        await redis.aclose()
        server.stop()


async def test_no_eviction_while_the_fleets_leases_are_unreadable(
    make_adapter: MakeAdapter, tmp_path: Path
) -> None:
    """Seen in the chaos run ("unloading ... without the fleet's leases (Redis unreachable)"): with Redis
    down, the loader unloaded anyway, so another kvgate's stream on that adapter was not protected. A
    load that needs room then goes over budget instead, until the leases can be read again."""
    server = EmbeddedRedis(tmp_path / "redis-home")
    server.start()
    redis = Redis.from_url(server.url, socket_timeout=1.0, socket_connect_timeout=1.0)
    store = AdapterStore(tmp_path / "store")
    table = EpochTable(redis)
    a = await publish_adapter(table, store, "tenant-a", make_adapter(b"a"), "base")
    b = await publish_adapter(table, store, "tenant-b", make_adapter(b"b"), "base")
    state = StubState()
    try:
        async with running(build_stub(state)) as stub_url:
            settings = Settings(replicas=[stub_url], store=store.root, max_adapters_per_replica=1,
                                reconcile_interval=0.1, poll_interval=0.1)  # fmt: skip
            async with running(build_app(settings, redis)) as url, aiohttp.ClientSession() as http:
                body = {"model": "tenant-a", "prompt": "p", "max_tokens": 1}
                async with http.post(f"{url}/v1/completions", json=body) as response:
                    assert response.status == 200  # tenant-a loaded: the budget is full
                server.stop()
                async with http.post(f"{url}/v1/completions", json=body | {"model": "tenant-b"}) as response:
                    assert response.status == 200, await response.text()
                assert {a.name, b.name} <= set(state.adapters), "tenant-a was evicted without its leases"
    finally:
        await redis.aclose()
        server.stop()
