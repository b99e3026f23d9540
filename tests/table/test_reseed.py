"""A table that comes back empty is an event: logged, counted, on /healthz, and re-seeded from the snapshot.

Against a real redis-server: FLUSHALL under a running gateway, and the reseed script run side by side.
"""

from __future__ import annotations

import asyncio
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import aiohttp
from redis.asyncio import Redis

from gateway.adapters.publish import publish_adapter
from gateway.adapters.store import AdapterStore
from gateway.app.wiring import build_app
from gateway.core.model import Change, VersionState
from gateway.process.http_edge import running
from gateway.settings.model import Settings
from gateway.table import keys
from gateway.table.epoch_table import EpochTable
from gateway.table.reseed import PROVING_AT_ONCE, Reseeder
from gateway.telemetry.metrics import Metrics
from tests.support.adapter_files import MakeAdapter
from tests.support.conditions import eventually
from tests.support.stub_backend import StubState, build_stub
from tests.table.test_epoch_table import logged

TOKEN = "admin-token"  # /metrics on the public listener takes the admin token

BODY = {"prompt": "p", "max_tokens": 1}


async def answer(http: aiohttp.ClientSession, url: str, logical_id: str) -> tuple[int, str | None]:
    async with http.post(f"{url}/v1/completions", json={"model": logical_id, **BODY}) as response:
        return response.status, response.headers.get("x-kvgate-version")


async def health(http: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with http.get(f"{url}/healthz") as response:
        doc: dict[str, Any] = await response.json()
        return doc


async def test_flushall_is_an_event_and_every_id_is_reseeded(
    redis: Redis, table: EpochTable, make_adapter: MakeAdapter, tmp_path: Path
) -> None:
    store = AdapterStore(tmp_path / "store")
    a = await publish_adapter(table, store, "tenant-a", make_adapter(b"a1"), "base")
    await table.bump("tenant-a")  # epoch 2: the reseed keeps the epoch the snapshot had
    b = await publish_adapter(table, store, "tenant-b", make_adapter(b"b1"), "base")
    async with running(build_stub(StubState())) as stub_url:
        settings = Settings(
            replicas=[stub_url],
            store=store.root,
            reconcile_interval=0.1,
            poll_interval=0.1,
            admin_token=TOKEN,
        )
        async with running(build_app(settings, redis)) as url, aiohttp.ClientSession() as http:
            assert await answer(http, url, "tenant-a") == (200, a.name)
            assert await answer(http, url, "tenant-b") == (200, b.name)
            before = await health(http, url)

            await redis.flushall()

            async def reseeded() -> bool:  # counted, then the snapshot replaced (a moment later)
                doc = (await health(http, url)).get("table", {})
                return bool(doc.get("new_generations")) and doc["generation"] != before["table"]["generation"]

            await eventually(reseeded, "/healthz reports the new table generation")
            for logical_id, name in (("tenant-a", a.name), ("tenant-b", b.name)):
                assert await answer(http, url, logical_id) == (200, name)
            after = await health(http, url)
            async with http.get(f"{url}/metrics", headers={"x-kvgate-admin-token": TOKEN}) as response:
                metrics = await response.text()
    assert after["table"]["generation"] != before["table"]["generation"]
    assert after["table"]["reseeded"] == 2
    assert after["table"]["unproven"] == 0
    assert after["table"]["last_new_generation_at"] is not None
    assert "kvgate_table_new_generations_total 1.0" in metrics
    assert 'kvgate_table_reseeded_versions_total{outcome="reseeded"} 2.0' in metrics
    state_a = await table.read_state("tenant-a")
    assert state_a is not None
    assert (state_a.digest, state_a.name, state_a.path, state_a.epoch) == (a.digest, a.name, str(a.path), 2)
    (event,) = await table.read_history("tenant-a")
    assert (event["action"], event["digest"], event["epoch"]) == ("reseeded", a.digest, 2)
    assert await redis.smembers(keys.IDS) == {b"tenant-a", b"tenant-b"}


async def test_a_version_the_store_cannot_prove_is_not_reseeded(
    redis: Redis, table: EpochTable, make_adapter: MakeAdapter, tmp_path: Path
) -> None:
    store = AdapterStore(tmp_path / "store")
    kept = await publish_adapter(table, store, "tenant-a", make_adapter(b"a1"), "base")
    lost = await publish_adapter(table, store, "tenant-b", make_adapter(b"b1"), "base")
    async with running(build_stub(StubState())) as stub_url:
        settings = Settings(
            replicas=[stub_url],
            store=store.root,
            reconcile_interval=0.1,
            poll_interval=0.1,
            admin_token=TOKEN,
        )
        async with running(build_app(settings, redis)) as url, aiohttp.ClientSession() as http:
            assert (await answer(http, url, "tenant-b"))[0] == 200
            shutil.rmtree(lost.path)  # its bytes are gone: nothing proves that version any more
            await redis.flushall()

            async def counted() -> bool:  # the new generation, and both IDs' outcomes
                doc = (await health(http, url)).get("table", {})
                return bool(doc.get("new_generations")) and doc["reseeded"] + doc["unproven"] == 2

            await eventually(counted, "/healthz reports the new table generation")
            doc = (await health(http, url))["table"]
            assert (doc["reseeded"], doc["unproven"]) == (1, 1)
            assert await answer(http, url, "tenant-a") == (200, kept.name)

            async def forgotten() -> bool:  # the counts are in before the snapshot is replaced
                return (await answer(http, url, "tenant-b"))[0] == 404

            await eventually(forgotten, "the snapshot drops the version it could not prove")
    assert await table.read_state("tenant-b") is None


async def test_concurrent_reseeds_end_at_the_freshest_version_each_written_once(
    redis: Redis, table: EpochTable
) -> None:
    """Three kvgates held three versions (a lagging snapshot holds an older one, at a lower epoch)."""
    held = {epoch: str(epoch) * 64 for epoch in (3, 5, 7)}
    results = await asyncio.gather(*(reseed(table, digest, epoch) for epoch, digest in held.items()))
    assert results[-1].changed, "the freshest always lands"
    state = await table.read_state("tenant-42")
    assert state is not None
    assert (state.digest, state.epoch) == (held[7], 7)
    history = await table.read_history("tenant-42")
    assert [e["action"] for e in history] == ["reseeded"] * sum(change.changed for change in results)
    assert history[0]["epoch"] == 7
    entries = [(e[b"id"], e[b"action"], int(e[b"epoch"])) for _, e in await logged(redis)]
    assert entries == [(b"tenant-42", b"reseeded", event["epoch"]) for event in reversed(history)]


async def test_a_reseed_changes_nothing_after_a_lower_epoch_or_any_other_write(table: EpochTable) -> None:
    assert (await reseed(table, "5" * 64, 5)).changed
    lower = await reseed(table, "3" * 64, 3)
    assert (lower.changed, lower.epoch) == (False, 5)
    again = await reseed(table, "5" * 64, 5)
    assert (again.changed, again.epoch) == (False, 5), "the same reseed twice writes once"
    await table.bump("tenant-42")  # a write in the new generation: epoch 6, no longer only reseeded
    later = await reseed(table, "9" * 64, 9)
    assert (later.changed, later.epoch) == (False, 6)
    state = await table.read_state("tenant-42")
    assert state is not None
    assert (state.digest, state.epoch) == ("5" * 64, 6)
    assert [e["action"] for e in await table.read_history("tenant-42")] == ["bump", "reseeded"]


async def reseed(table: EpochTable, digest: str, epoch: int) -> Change:
    name, path = f"tenant-42@{digest[:16]}", f"/store/{digest}"
    return await table.reseed("tenant-42", digest, name, path, "base", epoch)


async def test_proving_runs_off_the_event_loop_in_parallel_batches(redis: Redis, table: EpochTable) -> None:
    """An object store proves a version with a HEAD request: never on the loop that serves requests."""
    loop_thread = threading.get_ident()
    threads: list[int] = []
    at_once, most = 0, 0
    lock = threading.Lock()

    def proves(digest: str, path: str) -> bool:
        nonlocal at_once, most
        with lock:
            at_once += 1
            most = max(most, at_once)
        time.sleep(0.05)  # a slow store: the batch's threads overlap
        with lock:
            at_once -= 1
            threads.append(threading.get_ident())
        return digest != "0" * 64

    held = [VersionState(f"tenant-{i}", str(i % 10) * 64, f"tenant-{i}@{str(i % 10) * 16}",
                         f"/store/{i}", "base", 1) for i in range(20)]  # fmt: skip
    reseeder = Reseeder(table, proves, Metrics())
    assert await reseeder.reseed(held, "generation-2")
    assert len(threads) == 20
    assert loop_thread not in threads
    assert 1 < most <= PROVING_AT_ONCE
    outcomes = reseeder.health()
    assert (outcomes["reseeded"], outcomes["unproven"]) == (18, 2)  # tenant-0 and tenant-10: digest 0…0
