"""Quarantine: a replica listing a managed version from elsewhere is never trusted for it, is reported,
and is repaired once no kvgate leases it (stub replica, real Redis)."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from redis.asyncio import Redis

from gateway.adapters.store import AdapterStore
from gateway.app.wiring import build_app
from gateway.core.identity import versioned_name
from gateway.process.http_edge import running
from gateway.settings.model import Settings
from gateway.table.epoch_table import EpochTable
from gateway.table.leases import LeaseTable
from gateway.table.redis_server import EmbeddedRedis
from tests.support.adapter_files import MakeAdapter
from tests.support.conditions import eventually
from tests.support.stub_backend import StubState, build_stub

TOKEN = "admin-token"


async def test_a_foreign_root_is_quarantined_reported_and_repaired_once_unleased(
    redis: Redis,
    table: EpochTable,
    make_adapter: MakeAdapter,
    tmp_path: Path,
    redis_server: EmbeddedRedis,
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = AdapterStore(tmp_path / "store")
    artifact = store.ingest(make_adapter(b"v1"))
    v1 = versioned_name("tenant-42", artifact.digest)
    await table.publish("tenant-42", artifact.digest, v1, str(artifact.path), "base")
    state = StubState(adapters={v1: "/somewhere/else/v1", "tenant-42": "/by/hand"})  # loaded out of band
    other = LeaseTable(table, "gw-other", ttl_ms=60_000)
    caplog.set_level(logging.ERROR, logger="gateway.fleet.quarantine")
    async with running(build_stub(state)) as stub:
        await other.acquire(stub, v1)  # another kvgate streams on it: no repair yet
        settings = Settings(replicas=[stub], store=store.root, admin_token=TOKEN, poll_interval=0.1,
                            reconcile_interval=0.1, lease_ttl=1.0)  # fmt: skip
        async with running(build_app(settings, redis)) as url, aiohttp.ClientSession() as http:

            async def status() -> dict[str, Any]:
                headers = {"x-kvgate-admin-token": TOKEN}
                async with http.get(f"{url}/kvgate/status", headers=headers) as response:
                    doc: dict[str, Any] = await response.json()
                    return doc

            async def quarantined() -> set[tuple[str, str]]:
                return {(f["name"], f["reason"]) for f in (await status())["quarantined"]}

            async def reported() -> bool:
                return await quarantined() == {(v1, "foreign-root"), ("tenant-42", "unversioned")}

            await eventually(reported, "both findings reported")
            async with http.get(f"{url}/metrics", headers={"x-kvgate-admin-token": TOKEN}) as response:
                metrics = await response.text()
            assert 'kvgate_quarantines_total{reason="foreign-root",replica="' in metrics
            assert f"quarantined {v1} on {stub}: foreign-root" in caplog.text
            await asyncio.sleep(0.5)  # several sweeps: the lease holds the repair back
            assert state.adapters[v1] == "/somewhere/else/v1"

            fleet = await _kvgate_status(redis_server, store.root)
            findings = [f for doc in fleet["gateways"].values() for f in doc["quarantined"]]
            assert {(f["name"], f["reason"]) for f in findings} == await quarantined()

            await other.refresh(stub, {}, set(), since=other.now_ms() + 1)  # the other kvgate let go

            async def repaired() -> bool:
                return await quarantined() == {("tenant-42", "unversioned")}

            await eventually(repaired, "the foreign-root copy repaired (unloaded)")
            async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as api:
                await api.completions.create(model="tenant-42", prompt="p", max_tokens=1)
    assert state.adapters[v1] == str(artifact.path), "reloaded from the store"
    assert state.adapters["tenant-42"] == "/by/hand", "a bare name is reported, never unloaded"


async def _kvgate_status(redis_server: EmbeddedRedis, store: Path) -> dict[str, Any]:
    done = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway.cli", "status", "--json", "--redis-url", redis_server.url,
        "--store", str(store), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(done.communicate(), timeout=60)
    assert done.returncode == 0, err.decode()
    doc: dict[str, Any] = json.loads(out)
    return doc
