"""Fleet leases: what one kvgate's request uses, no other kvgate unloads (stub replica, real Redis)."""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import openai
import pytest
from redis.asyncio import Redis

from gateway.adapters.store import AdapterStore
from gateway.app.wiring import build_app
from gateway.fleet.leases import Leases
from gateway.process.http_edge import free_port, running
from gateway.settings.model import Settings
from gateway.table import keys
from gateway.table.epoch_table import EpochTable
from gateway.table.leases import LeaseTable
from gateway.table.redis_server import EmbeddedRedis
from gateway.table.replies import as_text
from tests.support.conditions import eventually, until_healthy
from tests.support.stub_backend import StubState, build_stub

Gateway = Callable[..., AbstractAsyncContextManager[str]]


@pytest.fixture
def gateway(redis: Redis, store: AdapterStore) -> Gateway:
    @asynccontextmanager
    async def start(replicas: list[str], **overrides: Any) -> AsyncIterator[str]:
        settings = Settings(
            replicas=replicas, store=store.root, reconcile_interval=0.1, poll_interval=0.1,
            drain_grace=0.2, lease_ttl=1.0, **overrides,
        )  # fmt: skip
        async with running(build_app(settings, redis)) as url:
            yield url

    return start


def client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


async def test_a_stream_through_b_survives_a_publish_and_sweep_by_a(gateway: Gateway, publish: Any) -> None:
    state = StubState(chunks=15, chunk_delay=0.1)
    v1 = await publish("tenant-42", b"v1")
    async with running(build_stub(state)) as stub, gateway([stub]) as url_a, gateway([stub]) as url_b:
        seen_while_streaming: list[tuple[str, bool]] = []
        async with client(url_b) as api:
            stream = await api.completions.create(model="tenant-42", prompt="p", max_tokens=15, stream=True)
            async for chunk in stream:
                if len(seen_while_streaming) == 1:
                    v2 = await publish("tenant-42", b"v2")  # A's sweeper retires v1 0.2 s later
                seen_while_streaming.append((chunk.choices[0].text, v1 in state.adapters))
        assert [text for text, _ in seen_while_streaming] == [f"t{i}" for i in range(15)]
        assert all(loaded for _, loaded in seen_while_streaming), "v1 stayed loaded while B streamed on it"
        async with client(url_a) as api:
            await api.completions.create(model="tenant-42", prompt="p", max_tokens=1)
        await eventually(lambda: v1 not in state.adapters, "v1 unloaded once B's lease was let go")
    assert v2 in state.adapters


async def test_an_eviction_waits_for_an_adapter_another_kvgate_is_using(
    gateway: Gateway, publish: Any, redis: Redis
) -> None:
    state = StubState(chunks=10, chunk_delay=0.1)
    a, b = await publish("tenant-a", b"a"), await publish("tenant-b", b"b")
    async with (
        running(build_stub(state)) as stub,
        gateway([stub], max_adapters_per_replica=1) as url_a,
        gateway([stub], max_adapters_per_replica=1) as url_b,
        client(url_a) as api_a,
        client(url_b) as api_b,
    ):
        stream = await api_b.completions.create(model="tenant-a", prompt="p", max_tokens=10, stream=True)
        texts = [(await anext(aiter(stream))).choices[0].text]

        async def leased() -> bool:  # B's first lease is written beside its request (one round trip)
            fields = await redis.hkeys(keys.leases(stub))  # name|gateway-id
            return any(as_text(field).split("|")[0] == a for field in fields)

        await eventually(leased, "B's lease on tenant-a is in Redis")
        needs_room = asyncio.create_task(api_a.completions.create(model="tenant-b", prompt="p", max_tokens=1))
        async for chunk in stream:
            texts.append(chunk.choices[0].text)
            assert a in state.adapters, "A evicted B's adapter mid-stream"
            assert b not in state.adapters, "A loaded over budget"
        answer = await needs_room  # A waited for B's lease to go, then took its slot
    assert texts == [f"t{i}" for i in range(10)], "B's stream ran to its end"
    assert answer.model == "tenant-b"
    assert list(state.adapters) == [b]


async def test_a_killed_gateways_leases_expire_within_their_time_to_live(
    gateway: Gateway, publish: Any, redis_server: EmbeddedRedis, store: AdapterStore
) -> None:
    state = StubState(chunks=400, chunk_delay=0.05)
    v1 = await publish("tenant-42", b"v1")
    async with running(build_stub(state)) as stub, gateway([stub]) as url_a:
        port = free_port()
        command = [sys.executable, "-m", "gateway.cli", "serve", "--replica", stub, "--port", str(port),
                   "--redis-url", redis_server.url, "--store", str(store.root), "--lease-ttl", "1",
                   "--poll-interval", "0.1", "--drain-grace", "0.2"]  # fmt: skip
        b = await asyncio.create_subprocess_exec(*command, stderr=asyncio.subprocess.DEVNULL)
        try:
            url_b = f"http://127.0.0.1:{port}"
            await until_healthy(url_b)
            async with client(url_b) as api:
                stream = await api.completions.create(
                    model="tenant-42", prompt="p", max_tokens=1, stream=True
                )
                await anext(aiter(stream))  # B streams on v1
                await publish("tenant-42", b"v2")
                async with client(url_a) as api_a:  # A now serves v2 (and its sweeper looks at v1)
                    await api_a.completions.create(model="tenant-42", prompt="p", max_tokens=1)
                for _ in range(10):
                    await anext(aiter(stream))
                assert v1 in state.adapters, "B's lease holds v1 while B lives"
                b.send_signal(signal.SIGKILL)
                await b.wait()
                await eventually(lambda: v1 not in state.adapters, "v1 unloaded once B's lease expired")
        finally:
            if b.returncode is None:
                b.kill()
                await b.wait()


async def test_a_first_use_does_not_wait_for_its_lease_a_refused_one_is_let_go(table: EpochTable) -> None:
    """``Leases.acquire`` counts at once and writes the lease beside the request (no await on the request
    path); the lease is in Redis a moment later, so another kvgate's unload claim is refused. A lease
    Redis refuses (another kvgate claimed the name first) leaves the pair not held, so the next use asks
    again."""
    mine, other = LeaseTable(table, "gw-a", ttl_ms=60_000), LeaseTable(table, "gw-b", ttl_ms=60_000)
    leases = Leases(mine)
    leases.acquire("http://r1", "t@1")  # no await: nothing of Redis ran yet
    assert ("http://r1", "t@1") in leases.held()

    async def recorded() -> bool:
        return await table.redis.hget(keys.leases("http://r1"), "t@1|gw-a") is not None

    await eventually(recorded, "the lease written beside the request")
    assert not (await other.begin_unload("http://r1", "t@1", force=False, claim_ms=60_000)).claimed
    assert (await other.begin_unload("http://r1", "t@2", force=False, claim_ms=60_000)).claimed
    leases.acquire("http://r1", "t@2")  # claimed by gw-b first: Redis refuses the lease
    await eventually(lambda: leases.refused == 1, "the refusal seen")
    leases.release("http://r1", "t@2")
    await leases.heartbeat()
    assert ("http://r1", "t@2") not in leases.held(), "a refused pair with nothing in flight is let go"
    assert ("http://r1", "t@1") in leases.held(), "a pair in flight stays held"
