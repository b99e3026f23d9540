"""Many tenants on a small adapter budget (stub replica, real Redis, the official openai client): every
request is served, no eviction takes an adapter from under a request, here or in another kvgate process,
a full budget is a clear 503, and a replica that forgot a version is reloaded instead of blamed."""

from __future__ import annotations

import asyncio
import random
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import openai
import pytest
from aiohttp import web
from redis.asyncio import Redis

from gateway.adapters.store import AdapterStore
from gateway.app.keys import LOADER
from gateway.app.wiring import build_app
from gateway.core.identity import versioned_name
from gateway.core.wire import ADMIN_TOKEN_HEADER, PIN_HEADER, replica_id
from gateway.process.http_edge import free_port, running
from gateway.settings.model import Settings
from gateway.table import keys
from gateway.table.epoch_table import EpochTable
from gateway.table.redis_server import EmbeddedRedis
from gateway.telemetry.metrics import Metrics
from tests.support.adapter_files import MakeAdapter, Publish
from tests.support.conditions import eventually, until_healthy
from tests.support.stub_backend import StubState, build_stub

IDS = 1000
BUDGET = 64
CONCURRENCY = 16
ADMIN_TOKEN = "test-admin-token"
QUIET: dict[str, Any] = {"drain_grace": 0.2, "reconcile_interval": 30.0}
"""The IDs are all published before kvgate starts: no full re-read of the thousand (every second by
default) competes with the requests for this one-process machine's CPU."""


def client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


@asynccontextmanager
async def gateway(
    redis: Redis, store: AdapterStore, stub: str, metrics: Metrics | None = None, **overrides: Any
) -> AsyncIterator[str]:
    defaults: dict[str, Any] = {"replicas": [stub], "store": store.root, **QUIET}
    settings = Settings(**(defaults | overrides))
    async with running(build_app(settings, redis, metrics=metrics)) as url:
        yield url


@asynccontextmanager
async def gateway_process(redis_server: EmbeddedRedis, store: AdapterStore, stub: str) -> AsyncIterator[str]:
    """``kvgate serve`` as its own process (its own event loop, its own leases), on the same Redis."""
    port = free_port()
    command = [sys.executable, "-m", "gateway.cli", "serve", "--replica", stub, "--port", str(port),
               "--redis-url", redis_server.url, "--store", str(store.root),
               "--max-adapters-per-replica", str(BUDGET), "--reconcile-interval", "30"]  # fmt: skip
    process = await asyncio.create_subprocess_exec(*command, stderr=asyncio.subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        await until_healthy(url)
        yield url
    finally:
        process.terminate()
        await process.wait()


async def publish_many(table: EpochTable, store: AdapterStore, make_adapter: MakeAdapter) -> dict[str, str]:
    """``IDS`` logical IDs: logical ID -> its versioned name. They share one artifact (storing a thousand
    durably takes most of a minute); each still has its own versioned name, which is all a replica sees."""
    artifact = store.ingest(make_adapter(b"shared"))
    versions = {}
    for i in range(IDS):
        name = versions[f"t{i}"] = versioned_name(f"t{i}", artifact.digest)
        await table.publish(f"t{i}", artifact.digest, name, str(artifact.path), "base")
    return versions


@dataclass
class Run:
    served: dict[str, str] = field(default_factory=dict)  # logical ID -> the version its headers named
    errors: list[str] = field(default_factory=list)


async def spread_over(urls: Sequence[str], ids: list[str], concurrency: int) -> Run:
    """One request per ID (in this order), ``concurrency`` at a time, round-robin over ``urls``."""
    run, queue = Run(), list(enumerate(ids))
    clients = [client(url) for url in urls]

    async def worker() -> None:
        while queue:
            i, logical_id = queue.pop()
            try:
                raw = await clients[i % len(clients)].completions.with_raw_response.create(
                    model=logical_id, prompt=f"hello {logical_id}", max_tokens=1
                )
                completion = raw.parse()
                assert completion.model == logical_id
                run.served[logical_id] = raw.headers["x-kvgate-version"]
            except openai.APIError as exc:
                run.errors.append(f"{logical_id}: {exc}")

    try:
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    finally:
        for api in clients:
            await api.close()
    return run


def report(what: str, state: StubState, run: Run) -> None:
    """The figures a run leaves (shown with ``pytest -s``)."""
    busy = [name for name, in_flight in state.unloads if in_flight]
    print(f"\n{what}: {len(run.served)} served, {len(run.errors)} errors, {len(state.loads)} loads, "
          f"{len(state.unloads)} unloads ({len(busy)} with a request in flight), "
          f"{len(state.adapters)} loaded at the end")  # fmt: skip


def assert_no_eviction_under_a_request(
    state: StubState, run: Run, versions: dict[str, str], slack: int
) -> None:
    """``slack``: adapters over the budget the replica may hold at the end (one kvgate counts its own
    loads in flight; kvgates racing to load on one replica can pass it until their next loads evict)."""
    assert run.errors == [], f"{len(run.errors)} errors, first: {run.errors[:3]}"
    assert run.served == versions, "every ID answered by its own version"
    assert len(state.loads) - len(state.unloads) == len(state.adapters)
    assert len(state.adapters) <= BUDGET + slack
    assert len(state.unloads) >= IDS - BUDGET - slack, "the budget made room (the test exercised evictions)"
    busy = [(name, n) for name, n in state.unloads if n]
    assert busy == [], f"unloaded with requests in flight: {busy[:5]}"


async def test_a_thousand_ids_on_a_budget_of_64_lose_no_request(
    redis: Redis, store: AdapterStore, table: EpochTable, make_adapter: MakeAdapter
) -> None:
    versions = await publish_many(table, store, make_adapter)
    ids = list(versions)
    random.Random(12).shuffle(ids)
    state, metrics = StubState(reply_delay=0.002), Metrics()
    async with (
        running(build_stub(state)) as stub,
        gateway(redis, store, stub, metrics, max_adapters_per_replica=BUDGET) as url,
    ):
        run = await spread_over([url], ids, CONCURRENCY)
    report("one kvgate", state, run)
    assert metrics.registry.get_sample_value(
        "kvgate_adapter_loads_total", {"replica": stub, "outcome": "loaded", "reason": "loaded"}
    ) == len(state.loads), "every load counted, as a miss"
    assert metrics.registry.get_sample_value(
        "kvgate_adapter_unloads_total", {"replica": stub, "reason": "budget"}
    ) == len(state.unloads)
    waits = (
        metrics.registry.get_sample_value("kvgate_adapter_slot_wait_seconds_count", {"replica": stub}) or 0
    )
    waited = metrics.registry.get_sample_value("kvgate_adapter_slot_wait_seconds_sum", {"replica": stub}) or 0
    print(f"slot waits: {waits:.0f} loads found the budget full, {waited:.3f} s to get a slot in all")
    assert 0 < waits <= len(state.loads) - BUDGET, (
        "loads past the first 64 found it full (one eviction may serve several)"
    )
    assert_no_eviction_under_a_request(state, run, versions, slack=0)


async def test_two_kvgate_processes_on_one_redis_lose_no_request(
    redis_server: EmbeddedRedis, store: AdapterStore, table: EpochTable, make_adapter: MakeAdapter
) -> None:
    versions = await publish_many(table, store, make_adapter)
    ids = list(versions)
    random.Random(13).shuffle(ids)
    state = StubState(reply_delay=0.002)
    async with running(build_stub(state)) as stub, AsyncExitStack() as stack:
        urls = [await stack.enter_async_context(gateway_process(redis_server, store, stub)) for _ in range(2)]
        run = await spread_over(urls, ids, CONCURRENCY)
    report("two kvgate processes", state, run)
    assert_no_eviction_under_a_request(state, run, versions, slack=CONCURRENCY)


async def test_a_full_budget_waits_then_answers_503_and_evicts_nothing_in_use(
    redis: Redis, store: AdapterStore, publish: Publish
) -> None:
    a, b = await publish("tenant-a", b"a"), await publish("tenant-b", b"b")
    hold = asyncio.Event()
    state = StubState(chunks=3, hold=hold)
    async with (
        running(build_stub(state)) as stub,
        gateway(redis, store, stub, max_adapters_per_replica=1, slot_wait_timeout=0.3) as url,
        client(url) as api,
    ):
        stream = await api.completions.create(model="tenant-a", prompt="p", stream=True)
        first = await anext(aiter(stream))  # tenant-a's stream holds after its first chunk
        with pytest.raises(openai.APIStatusError) as refused:
            await api.completions.create(model="tenant-b", prompt="p", max_tokens=1)
        assert list(state.adapters) == [a], "the adapter in use stayed"
        hold.set()
        rest = [chunk async for chunk in stream]
        after = await api.completions.create(model="tenant-b", prompt="p", max_tokens=1)  # a slot is free
    assert refused.value.status_code == 503
    error = refused.value.body
    assert isinstance(error, dict)
    assert error["code"] == "adapter_budget_full", error
    assert "adapter budget" in error["message"]
    assert "slot_wait_timeout" in error["message"]
    assert [first.choices[0].text] + [c.choices[0].text for c in rest] == ["t0", "t1", "t2"]
    assert after.model == "tenant-b"
    assert list(state.adapters) == [b]
    assert state.unloads == [(a, 0)]


async def test_a_replica_that_forgot_a_version_gets_it_back_and_the_request_succeeds(
    redis: Redis, store: AdapterStore, publish: Publish
) -> None:
    v1 = await publish("tenant-42", b"v1")
    state = StubState()
    async with (
        running(build_stub(state)) as stub,
        gateway(redis, store, stub, poll_interval=60) as url,  # kvgate keeps believing it is loaded
        client(url) as api,
    ):
        await api.completions.create(model="tenant-42", prompt="p", max_tokens=1)
        state.adapters.clear()  # the replica restarted (or someone unloaded it behind kvgate's back)
        raw = await api.completions.with_raw_response.create(model="tenant-42", prompt="p", max_tokens=1)
        state.adapters.clear()
        state.fail_loads = "disk gone"  # now the reload fails: a 503 that names no versioned name
        with pytest.raises(openai.APIStatusError) as failed:
            await api.completions.create(model="tenant-42", prompt="p", max_tokens=1)
    assert raw.headers["x-kvgate-version"] == v1
    assert raw.parse().model == "tenant-42"
    assert state.loads == [v1, v1], "loaded, forgotten, loaded again"
    assert failed.value.status_code == 503
    assert "disk gone" in failed.value.response.text
    assert "@" not in failed.value.response.text, "the error names the logical ID, not the versioned name"


async def test_error_bodies_from_a_replica_never_show_a_versioned_name(
    redis: Redis, store: AdapterStore, publish: Publish
) -> None:
    v1 = await publish("tenant-42", b"v1")
    state = StubState()
    async with running(build_stub(state)) as stub, gateway(redis, store, stub) as url, client(url) as api:
        await api.completions.create(model="tenant-42", prompt="p", max_tokens=1)
        state.echo_errors = True
        with pytest.raises(openai.BadRequestError) as refused:
            await api.completions.create(model="tenant-42", prompt="p", max_tokens=1)
    assert state.received[-1]["model"] == v1, "the replica was sent the versioned name"
    text = refused.value.response.text
    assert "`tenant-42` cannot take this request" in text
    assert "@" not in text, text


async def test_a_load_goes_to_a_replica_with_room_when_the_least_loaded_one_is_full(
    redis: Redis, store: AdapterStore, publish: Publish
) -> None:
    a, b = await publish("tenant-a", b"a"), await publish("tenant-b", b"b")
    hold_x, hold_y = asyncio.Event(), asyncio.Event()
    x, y = StubState(chunks=2, hold=hold_x), StubState(chunks=2, hold=hold_y)
    async with (
        running(build_stub(x)) as url_x,
        running(build_stub(y)) as url_y,
        gateway(
            redis,
            store,
            url_x,
            replicas=[url_x, url_y],
            max_adapters_per_replica=1,
            slot_wait_timeout=0.3,
            admin_token=ADMIN_TOKEN,
        ) as url,  # fmt: skip
        client(url) as api,
    ):

        def pinned(replica: str) -> dict[str, str]:
            return {PIN_HEADER: replica, ADMIN_TOKEN_HEADER: ADMIN_TOKEN}

        streams = [  # X: one request, on its one adapter; Y: two base-model requests, no adapter
            await api.completions.create(model=m, prompt="p", stream=True, extra_headers=pinned(r))
            for m, r in (("tenant-a", url_x), ("base", url_y), ("base", url_y))
        ]
        for stream in streams:
            await anext(aiter(stream))  # each holds after its first chunk
        raw = await api.completions.with_raw_response.create(model="tenant-b", prompt="p", max_tokens=1)
        hold_x.set()
        hold_y.set()
        for stream in streams:
            _ = [chunk async for chunk in stream]
    assert raw.headers["x-kvgate-replica"] == replica_id(url_y), "loaded where the budget had room"
    assert list(x.adapters) == [a], "X's adapter in use stayed"
    assert list(y.adapters) == [b]


async def test_loads_waiting_for_a_slot_get_it_in_the_order_they_came(
    redis: Redis, store: AdapterStore, publish: Publish
) -> None:
    """The churn loadtest (``loadtest.churn``: 2,000 IDs, budget 8) showed loads waiting seconds while
    slots came free every few milliseconds: each waiting load polled on its own, and the room one load
    made by evicting could go to any other, so a load could lose every race up to slot_wait_timeout (a
    503). Waiting loads are served in the order they came, one slot each."""
    names = [await publish(f"tenant-{i}", f"w{i}".encode()) for i in range(7)]
    hold = asyncio.Event()
    state = StubState(chunks=2, hold=hold)
    async with running(build_stub(state)) as stub:
        settings = Settings(replicas=[stub], store=store.root, max_adapters_per_replica=1, **QUIET)
        app = build_app(settings, redis)
        async with running(app) as url, client(url) as api:
            stream = await api.completions.create(model="tenant-0", prompt="p", stream=True)
            await anext(aiter(stream))  # tenant-0 holds the only slot
            waiting = []
            for i in range(1, 7):  # each one a load that must wait for the slot, started in this order
                waiting.append(asyncio.create_task(api.completions.create(model=f"tenant-{i}", prompt="p")))
                await eventually(
                    lambda: in_line(app) == len(waiting), f"tenant-{i}'s load waits for its turn"
                )
            hold.set()
            _ = [chunk async for chunk in stream]
            served = await asyncio.gather(*waiting)
    assert [answer.model for answer in served] == [f"tenant-{i}" for i in range(1, 7)]
    assert state.loads == names, "loaded in the order the requests came"


def in_line(app: web.Application) -> int:
    """Loads in line for a slot on the replica: the one whose turn it is, and those waiting for theirs."""
    return sum(app[LOADER].budget.in_line.values())


async def test_the_shared_last_use_keeps_only_what_a_replica_still_has(
    redis: Redis, store: AdapterStore, publish: Publish
) -> None:
    """The other half of the churn loadtest's finding: each heartbeat shared the last use of every name
    used since the last one, evicted ones included, after their unload had dropped it; the hash grew to
    every ID ever served there (734 names at budget 8, 2,000 IDs), and every load that made room read it
    whole. An evicted name stays out of it; the load path reads only the names the replica has."""
    for i in range(12):
        await publish(f"tenant-{i}", f"w{i}".encode())
    state = StubState()
    async with (
        running(build_stub(state)) as stub,
        gateway(redis, store, stub, max_adapters_per_replica=2, lease_ttl=4) as url,  # a beat a second
        client(url) as api,
    ):
        for i in range(12):  # used and evicted between two heartbeats, most of them
            await api.completions.create(model=f"tenant-{i}", prompt="p", max_tokens=1)

        async def shared_names() -> set[str]:
            return {n.decode() if isinstance(n, bytes) else n for n in await redis.hkeys(keys.last_use(stub))}

        async def beat() -> bool:  # a heartbeat since the last use: what it shares is in
            return set(state.adapters) <= await shared_names()

        await eventually(beat, "a heartbeat shared the last use of what the replica has")
        shared = await shared_names()
    assert len(state.unloads) == 10
    assert shared <= set(state.adapters), f"{len(shared)} names shared, {len(state.adapters)} loaded"
