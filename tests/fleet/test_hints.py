"""The hint path: with reconcile and poll intervals far longer than the test, every kvgate still sees a
publish, a bump, and another kvgate's load or unload through pub/sub (stub replica, real Redis)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import openai
from redis.asyncio import Redis

from gateway.adapters.store import AdapterStore
from gateway.app.wiring import build_app
from gateway.core.identity import versioned_name
from gateway.process.http_edge import running
from gateway.settings.model import Settings
from gateway.table import keys
from gateway.table.epoch_table import EpochTable
from tests.support.adapter_files import MakeAdapter
from tests.support.conditions import eventually
from tests.support.stub_backend import StubState, build_stub

TOKEN = "admin-token"
SLOW = 600.0  # seconds: no periodic read or poll happens during a test


async def test_publish_bump_load_and_unload_reach_every_kvgate_by_hints(
    redis: Redis, table: EpochTable, make_adapter: MakeAdapter, tmp_path: Path
) -> None:
    store = AdapterStore(tmp_path / "store")

    async def publish(weights: bytes) -> str:
        artifact = store.ingest(make_adapter(weights))
        name = versioned_name("tenant-42", artifact.digest)
        await table.publish("tenant-42", artifact.digest, name, str(artifact.path), "base")
        return name

    state = StubState()
    async with running(build_stub(state)) as stub:
        settings = Settings(replicas=[stub], store=store.root, admin_token=TOKEN, reconcile_interval=SLOW,
                            poll_interval=SLOW, max_adapters_per_replica=1)  # fmt: skip
        async with (
            running(build_app(settings, redis)) as url_a,
            running(build_app(settings, redis)) as url_b,
            aiohttp.ClientSession() as http,
        ):

            async def status_b() -> dict[str, Any]:
                async with http.get(f"{url_b}/kvgate/status", headers={"x-kvgate-admin-token": TOKEN}) as r:
                    doc: dict[str, Any] = await r.json()
                    return doc

            async def b_serves(**fields: object) -> bool:
                current = (await status_b())["versions"].get("tenant-42", {})
                return all(current.get(k) == v for k, v in fields.items())

            async def b_sees_loaded() -> set[str]:
                return set((await status_b())["replicas"][0]["adapters"])

            v1 = await publish(b"v1")
            await eventually(lambda: b_serves(name=v1, epoch=1), "B serves the publish")
            await table.bump("tenant-42")
            await eventually(lambda: b_serves(name=v1, epoch=2), "B has the bump")
            async with openai.AsyncOpenAI(base_url=f"{url_a}/v1", api_key="unused", max_retries=0) as api:
                await api.completions.create(model="tenant-42", prompt="p", max_tokens=1)  # A loads v1

            async def b_sees(names: set[str]) -> bool:
                return await b_sees_loaded() == names

            await eventually(lambda: b_sees({v1}), "B sees A's load")
            await publish(b"v2")
            async with openai.AsyncOpenAI(base_url=f"{url_a}/v1", api_key="unused", max_retries=0) as api:
                raw = await api.completions.with_raw_response.create(
                    model="tenant-42", prompt="p", max_tokens=1
                )
            v2 = raw.headers["x-kvgate-version"]
            await eventually(lambda: b_sees({v2}), "B sees A's unload (budget 1) and load")


async def test_a_stalled_replica_listing_does_not_hold_back_the_tables_hints(
    redis: Redis, table: EpochTable, make_adapter: MakeAdapter, tmp_path: Path
) -> None:
    """Seen while measuring the chaos run: the hint listener re-read a hinted replica's listing inline, so
    while a busy replica took its time to answer ``/v1/models`` (up to 0.7 s there), the table's hints
    (publishes, bumps) waited behind it; a replica that stalls held them back for good."""
    store = AdapterStore(tmp_path / "store")
    artifact = store.ingest(make_adapter(b"v1"))
    name = versioned_name("tenant-42", artifact.digest)
    await table.publish("tenant-42", artifact.digest, name, str(artifact.path), "base")
    state = StubState()
    async with running(build_stub(state)) as stub:
        settings = Settings(replicas=[stub], store=store.root, admin_token=TOKEN, reconcile_interval=SLOW,
                            poll_interval=SLOW)  # fmt: skip
        async with running(build_app(settings, redis)) as url, aiohttp.ClientSession() as http:

            async def epoch() -> int:
                async with http.get(f"{url}/kvgate/status", headers={"x-kvgate-admin-token": TOKEN}) as r:
                    return int((await r.json())["versions"]["tenant-42"]["epoch"])

            state.listing_gate = gate = asyncio.Event()
            try:
                listed = state.listings
                await redis.publish(keys.HINTS, keys.REPLICA_HINT_PREFIX + stub)  # another kvgate's load

                async def hinted_listing_started() -> bool:
                    return state.listings > listed

                await eventually(hinted_listing_started, "the replica hint asks the replica for its listing")
                await table.bump("tenant-42")

                async def bumped() -> bool:
                    return await epoch() == 2

                await eventually(bumped, "the bump's hint lands while the replica's listing is stalled")
            finally:
                gate.set()
