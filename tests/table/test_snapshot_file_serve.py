"""A restarted kvgate (the real app, the stub replica) starts from the snapshot file in its data dir.

A version published while it was down is what it serves after the start, a version rolled back while it
was down is not, no full read of the table was made, and ``/healthz`` says the snapshot is current.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
from redis.asyncio import Redis

from gateway.adapters.publish import publish_adapter
from gateway.adapters.store import AdapterStore
from gateway.app.wiring import build_app
from gateway.process.http_edge import running
from gateway.settings.model import Settings
from gateway.table.epoch_table import EpochTable
from gateway.table.snapshot_file import FILE_NAME
from tests.support.adapter_files import MakeAdapter
from tests.support.conditions import eventually
from tests.support.stub_backend import StubState, build_stub

TOKEN = "admin-token"


async def _served_model(http: aiohttp.ClientSession, url: str, stub: StubState, logical_id: str) -> str:
    body = {"model": logical_id, "prompt": "hello", "max_tokens": 1}
    async with http.post(f"{url}/v1/completions", json=body) as response:
        assert response.status == 200, await response.text()
    model: str = stub.received[-1]["model"]
    return model


async def _get(http: aiohttp.ClientSession, url: str, path: str) -> tuple[int, Any]:
    async with http.get(f"{url}{path}", headers={"x-kvgate-admin-token": TOKEN}) as response:
        return response.status, await (response.json() if path == "/healthz" else response.text())


async def test_a_restarted_kvgate_starts_from_its_file(
    redis: Redis, table: EpochTable, make_adapter: MakeAdapter, tmp_path: Path
) -> None:
    store = AdapterStore(tmp_path / "store")
    a1 = await publish_adapter(table, store, "tenant-a", make_adapter(b"a1"), "base")
    b1 = await publish_adapter(table, store, "tenant-b", make_adapter(b"b1"), "base")
    b2 = await publish_adapter(table, store, "tenant-b", make_adapter(b"b2"), "base")
    data = tmp_path / "data"
    stub = StubState()
    async with running(build_stub(stub)) as stub_url, aiohttp.ClientSession() as http:
        settings = Settings(
            replicas=[stub_url], store=store.root, data_dir=data, admin_token=TOKEN,
            snapshot_file_interval=0.1, reconcile_interval=0.1, poll_interval=0.1, drain_grace=0,
        )  # fmt: skip
        async with running(build_app(settings, redis)) as url:
            assert await _served_model(http, url, stub, "tenant-b") == b2.name
            await eventually(lambda: (data / FILE_NAME).exists(), "the file is written")
            await asyncio.sleep(0.3)  # a few writer rounds: nothing moved, nothing rewritten
        a2 = await publish_adapter(table, store, "tenant-a", make_adapter(b"a2"), "base")  # while down
        await table.rollback("tenant-b", "", "base")  # tenant-b@b2 revoked while down
        async with running(build_app(settings, redis)) as url:
            _, metrics = await _get(http, url, "/metrics")
            assert 'kvgate_snapshot_file_total{outcome="loaded"} 1.0' in metrics
            assert "kvgate_table_full_reads_total{" not in metrics, "no full read of the table"
            status, health = await _get(http, url, "/healthz")
            assert status == 200, health
            assert not health["snapshot_flushed"], "/healthz: the snapshot is confirmed by Redis"
            _, doc = await _get(http, url, "/kvgate/status")
            assert json.loads(doc)["snapshot_staleness_s"] < 5
            assert await _served_model(http, url, stub, "tenant-a") == a2.name != a1.name
            assert await _served_model(http, url, stub, "tenant-b") == b1.name
            async with http.post(f"{url}/v1/completions", json={"model": b2.name, "prompt": "x"}) as response:
                assert response.status == 404, "the version rolled back while down is not served"
