"""Graceful drain on SIGTERM: /healthz 503 at once, new requests refused, running streams finish,
leases let go, exit 0 (``kvgate serve`` as a process, stub replica, real Redis)."""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path

import aiohttp
import openai
import pytest
from redis.asyncio import Redis

from gateway.adapters.publish import publish_adapter
from gateway.adapters.store import AdapterStore
from gateway.serving import free_port, running
from gateway.table import keys
from gateway.table.epoch_table import EpochTable
from gateway.table.redis_server import EmbeddedRedis
from tests.conftest import MakeAdapter, eventually, until_healthy
from tests.stub_backend import StubState, build_stub


async def test_sigterm_drains_then_exits_0(
    redis: Redis, table: EpochTable, redis_server: EmbeddedRedis, make_adapter: MakeAdapter, tmp_path: Path
) -> None:
    store = AdapterStore(tmp_path / "store")
    await publish_adapter(table, store, "tenant-42", make_adapter(b"v1"), "base")
    state = StubState(chunks=20, chunk_delay=0.1)
    async with running(build_stub(state)) as stub, aiohttp.ClientSession() as http:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        command = [sys.executable, "-m", "gateway.cli", "serve", "--replica", stub, "--port", str(port),
                   "--redis-url", redis_server.url, "--store", str(store.root), "--gateway-id", "gw-drain",
                   "--shutdown-timeout", "30"]  # fmt: skip
        server = await asyncio.create_subprocess_exec(*command, stderr=asyncio.subprocess.PIPE)
        try:
            await until_healthy(url)
            async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as api:
                stream = await api.completions.create(
                    model="tenant-42", prompt="p", max_tokens=20, stream=True
                )
                texts = [(await anext(aiter(stream))).choices[0].text]
                assert await redis.hkeys(keys.leases(stub)), "the running stream holds a lease"
                server.send_signal(signal.SIGTERM)

                async def draining() -> bool:  # as soon as the process has taken the signal
                    async with http.get(f"{url}/healthz") as health:
                        return health.status == 503 and (await health.json())["draining"] is True

                await eventually(draining, "/healthz answers 503 draining", within=5)
                with pytest.raises(openai.APIStatusError) as refused:
                    await api.completions.create(model="tenant-42", prompt="p", max_tokens=1)
                texts += [chunk.choices[0].text async for chunk in stream]
            _, err = await asyncio.wait_for(server.communicate(), timeout=60)
        finally:
            if server.returncode is None:
                server.kill()
                await server.wait()
    assert refused.value.status_code == 503
    assert "shutting down" in str(refused.value.body)
    assert texts == [f"t{i}" for i in range(20)], "the running stream finished"
    assert server.returncode == 0, err.decode()[-2000:]
    assert await redis.hkeys(keys.leases(stub)) == [], "its leases were let go"
