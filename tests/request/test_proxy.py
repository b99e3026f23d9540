"""The request path against fast stub backends (edge cases), real Redis and the official openai client."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import aiohttp
import openai
import pytest
from redis.asyncio import Redis

from gateway.adapters.store import AdapterStore
from gateway.app.wiring import build_app
from gateway.core.wire import replica_id
from gateway.process.http_edge import running
from gateway.settings.model import Settings
from gateway.table.epoch_table import EpochTable
from tests.support.conditions import eventually
from tests.support.stub_backend import StubState, build_stub

Gateway = Callable[..., AbstractAsyncContextManager[str]]


@pytest.fixture
def gateway(redis: Redis, store: AdapterStore) -> Gateway:
    @asynccontextmanager
    async def start(replicas: list[str], **overrides: Any) -> AsyncIterator[str]:
        settings = Settings(
            replicas=replicas,
            store=store.root,
            admin_token=overrides.pop("admin_token", ADMIN_TOKEN),
            reconcile_interval=0.1,
            poll_interval=overrides.pop("poll_interval", 0.1),
            drain_grace=overrides.pop("drain_grace", 0.2),
            **overrides,
        )
        async with running(build_app(settings, redis)) as url:
            yield url

    return start


STUB_DIES: dict[str, Any] = {"kv_events": False}
"""For the tests that stop a stub under a running kvgate: the connection of its KV event follower (on by
default; it asks each replica's /kv_event_sources at start) is left by the stopping stub's server to the
garbage collector (a ResourceWarning, an error here; not found why in the time I had). These tests are
about the proxy's retries, not KV events."""


@asynccontextmanager
async def stubs(count: int) -> AsyncIterator[list[tuple[str, StubState]]]:
    states = [StubState() for _ in range(count)]
    async with running(build_stub(states[0])) as a:
        if count == 1:
            yield [(a, states[0])]
            return
        async with running(build_stub(states[1])) as b:
            yield [(a, states[0]), (b, states[1])]


ADMIN_TOKEN = "test-admin-token"


async def snapshot_has(url: str, logical_id: str, **fields: object) -> bool:
    """Whether the gateway's snapshot shows ``logical_id`` with these fields (``/kvgate/status``)."""
    async with (
        aiohttp.ClientSession() as http,
        http.get(f"{url}/kvgate/status", headers={"x-kvgate-admin-token": ADMIN_TOKEN}) as response,
    ):
        current = (await response.json())["versions"].get(logical_id, {})
    return all(current.get(key) == value for key, value in fields.items())


def client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


async def test_completion_is_rewritten_both_ways(gateway: Gateway, publish: Any) -> None:
    async with stubs(2) as backends:
        v1 = await publish("tenant-42", b"v1")
        async with gateway([u for u, _ in backends]) as url:
            async with client(url) as api:
                raw = await api.completions.with_raw_response.create(
                    model="tenant-42",
                    prompt="hello",
                    max_tokens=1,
                    extra_body={"cache_salt": "client-chosen"},
                )
            completion = raw.parse()
    assert completion.model == "tenant-42"
    assert raw.headers["x-kvgate-version"] == v1
    assert raw.headers["x-kvgate-epoch"] == "1"
    served = next(state for u, state in backends if replica_id(u) == raw.headers["x-kvgate-replica"])
    sent = served.received[-1]
    assert sent["model"] == v1
    assert sent["cache_salt"].startswith("kvg-")
    assert sent["cache_salt"] != "client-chosen"
    assert served.loads == [v1]


async def test_streams_carry_the_logical_id_in_every_chunk(gateway: Gateway, publish: Any) -> None:
    async with stubs(1) as backends:
        await publish("tenant-42", b"v1")
        async with gateway([backends[0][0]]) as url, client(url) as api:
            text_chunks = [
                c async for c in await api.completions.create(model="tenant-42", prompt="p", stream=True)
            ]
            chat = await api.chat.completions.create(
                model="tenant-42", messages=[{"role": "user", "content": "hi"}], stream=True
            )
            chat_chunks = [c async for c in chat]
    assert len(text_chunks) == 4
    assert len(chat_chunks) == 4
    assert {c.model for c in text_chunks} | {c.model for c in chat_chunks} == {"tenant-42"}
    assert "".join(c.choices[0].text for c in text_chunks) == "t0t1t2t3"


async def test_new_version_replaces_old_and_old_is_unloaded(gateway: Gateway, publish: Any) -> None:
    async with stubs(1) as backends:
        (stub_url, stub) = backends[0]
        v1 = await publish("tenant-42", b"v1")
        async with gateway([stub_url]) as url, client(url) as api:
            first = await api.completions.with_raw_response.create(
                model="tenant-42", prompt="p", max_tokens=1
            )
            v2 = await publish("tenant-42", b"v2")
            await eventually(lambda: snapshot_has(url, "tenant-42", name=v2), "the snapshot serves v2")
            after = [
                await api.completions.with_raw_response.create(model="tenant-42", prompt="p", max_tokens=1)
                for _ in range(3)
            ]
            await eventually(lambda: list(stub.adapters) == [v2], "v1 unloaded after the drain")
    assert first.headers["x-kvgate-version"] == v1
    assert {r.headers["x-kvgate-version"] for r in after} == {v2}
    assert {r.headers["x-kvgate-epoch"] for r in after} == {"2"}
    assert list(stub.adapters) == [v2]


async def test_concurrent_first_requests_load_once(gateway: Gateway, publish: Any) -> None:
    async with stubs(1) as backends:
        v1 = await publish("tenant-42", b"v1")
        async with gateway([backends[0][0]]) as url, client(url) as api:
            await asyncio.gather(
                *(api.completions.create(model="tenant-42", prompt="p", max_tokens=1) for _ in range(10))
            )
    assert backends[0][1].loads == [v1]


async def test_adapter_budget_evicts_least_recently_used(gateway: Gateway, publish: Any) -> None:
    async with stubs(1) as backends:
        a = await publish("tenant-a", b"a")
        b = await publish("tenant-b", b"b")
        async with gateway([backends[0][0]], max_adapters_per_replica=1) as url, client(url) as api:
            await api.completions.create(model="tenant-a", prompt="p", max_tokens=1)
            await api.completions.create(model="tenant-b", prompt="p", max_tokens=1)
    assert backends[0][1].loads == [a, b]
    assert list(backends[0][1].adapters) == [b]


async def test_models_lists_logical_ids_never_versions(gateway: Gateway, publish: Any) -> None:
    async with stubs(1) as backends:
        await publish("tenant-42", b"v1")
        async with gateway([backends[0][0]]) as url, client(url) as api:
            models = await api.models.list()
    assert [m.id for m in models.data] == ["base", "tenant-42"]


async def test_base_model_passes_through(gateway: Gateway) -> None:
    async with stubs(1) as backends, gateway([backends[0][0]]) as url, client(url) as api:
        raw = await api.completions.with_raw_response.create(model="base", prompt="p", max_tokens=1)
    assert raw.parse().model == "base"
    assert "x-kvgate-version" not in raw.headers
    assert backends[0][1].received[-1]["model"] == "base"


async def test_bump_changes_the_cache_namespace(gateway: Gateway, publish: Any, table: EpochTable) -> None:
    async with stubs(1) as backends:
        await publish("tenant-42", b"v1")
        async with gateway([backends[0][0]]) as url, client(url) as api:
            await api.completions.create(model="tenant-42", prompt="p", max_tokens=1)
            await table.bump("tenant-42")
            await eventually(lambda: snapshot_has(url, "tenant-42", epoch=2), "the snapshot has epoch 2")
            await api.completions.create(model="tenant-42", prompt="p", max_tokens=1)
    salts = [body["cache_salt"] for body in backends[0][1].received]
    assert len(set(salts)) == 2


async def test_unknown_model_is_404_openai_style(gateway: Gateway) -> None:
    async with stubs(1) as backends, gateway([backends[0][0]]) as url:
        with pytest.raises(openai.NotFoundError) as caught:
            async with client(url) as api:
                await api.completions.create(model="tenant-404", prompt="p")
    assert caught.value.status_code == 404
    assert isinstance(caught.value.body, dict)
    assert caught.value.body["param"] == "model"


async def post(url: str, data: bytes) -> tuple[int, dict[str, Any]]:
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{url}/v1/completions", data=data) as response,
    ):
        return response.status, await response.json()


async def test_malformed_bodies_are_400_and_oversized_413(gateway: Gateway) -> None:
    async with stubs(1) as backends, gateway([backends[0][0]], max_body_bytes=2048) as url:
        bad_json = await post(url, b"{not json")
        no_model = await post(url, json.dumps({"model": 5, "prompt": "p"}).encode())  # no model: the base
        array = await post(url, b"[1]")
        huge = await post(url, json.dumps({"model": "base", "prompt": "x" * 4096}).encode())
    assert bad_json[0] == no_model[0] == array[0] == 400
    assert no_model[1]["error"]["param"] == "model"
    assert huge[0] == 413
    assert huge[1]["error"]["type"] == "invalid_request_error"
    assert backends[0][1].received == []


async def test_failed_load_is_503_with_backend_reason(gateway: Gateway, publish: Any) -> None:
    async with stubs(1) as backends:
        backends[0][1].fail_loads = "No adapter found for /nowhere"
        await publish("tenant-42", b"v1")
        async with gateway([backends[0][0]]) as url:
            with pytest.raises(openai.InternalServerError) as caught:
                async with client(url) as api:
                    await api.completions.create(model="tenant-42", prompt="p")
    assert caught.value.status_code == 503
    assert "No adapter found for /nowhere" in caught.value.message


async def test_unreachable_backend_is_502(gateway: Gateway) -> None:
    state = StubState()
    async with running(build_stub(state)) as stub_url:
        gateway_cm = gateway([stub_url], poll_interval=60, **STUB_DIES)
        url = await gateway_cm.__aenter__()
    try:  # the stub is gone, the pool still thinks it is healthy until its next poll
        with pytest.raises(openai.APIStatusError) as caught:
            async with client(url) as api:
                await api.completions.create(model="base", prompt="p")
        assert caught.value.status_code == 502
    finally:
        await gateway_cm.__aexit__(None, None, None)


async def test_stream_broken_midway_ends_with_an_sse_error(gateway: Gateway, publish: Any) -> None:
    async with stubs(1) as backends:
        backends[0][1].break_stream_after = 2
        await publish("tenant-42", b"v1")
        async with gateway([backends[0][0]]) as url:
            body = json.dumps({"model": "tenant-42", "prompt": "p", "stream": True}).encode()
            async with (
                aiohttp.ClientSession() as session,
                session.post(f"{url}/v1/completions", data=body) as response,
            ):
                text = await response.text()
    events = [line.removeprefix("data: ") for line in text.splitlines() if line.startswith("data: ")]
    assert len(events) == 3
    assert json.loads(events[-1])["error"]["type"] == "upstream_error"


async def test_same_name_from_another_root_is_replaced(gateway: Gateway, publish: Any) -> None:
    async with stubs(1) as backends:
        stub_url, stub = backends[0]
        v1 = await publish("tenant-42", b"v1")
        stub.adapters[v1] = "/somewhere/else"  # loaded by hand, or by a pool with another store
        async with gateway([stub_url]) as url, client(url) as api:
            raw = await api.completions.with_raw_response.create(model="tenant-42", prompt="p", max_tokens=1)
    assert raw.headers["x-kvgate-version"] == v1
    assert stub.adapters[v1] != "/somewhere/else"
    assert stub.loads == [v1]


async def test_purge_all_resets_every_replica_and_retries_while_busy(
    gateway: Gateway, publish: Any, table: EpochTable
) -> None:
    async with stubs(2) as backends:
        backends[0][1].busy_resets = 3  # blocks still in use: vLLM answers {"success": false}
        await publish("tenant-42", b"v1")
        async with gateway([u for u, _ in backends], invalidation="purge-all") as url, client(url) as api:
            await api.completions.create(model="tenant-42", prompt="p", max_tokens=1)
            await publish("tenant-42", b"v2")
            await eventually(lambda: all(state.resets for _, state in backends), "both purged")
    assert [state.resets for _, state in backends] == [1, 1]
    assert backends[0][1].busy_resets == 0
    (sent,) = [body for _, state in backends for body in state.received]
    assert "cache_salt" not in sent, "purge-all pools send no cache namespace"


async def test_a_replica_with_another_base_is_never_eligible(gateway: Gateway, publish: Any) -> None:
    async with stubs(2) as backends:
        (other_url, other), (good_url, good) = backends
        other.base = "another-base"  # published versions record base "base"
        v1 = await publish("tenant-42", b"v1")
        async with gateway([other_url, good_url]) as url, client(url) as api:
            for _ in range(4):
                raw = await api.completions.with_raw_response.create(
                    model="tenant-42", prompt="p", max_tokens=1
                )
                assert raw.headers["x-kvgate-replica"] == replica_id(good_url)
    assert (other.loads, good.loads) == ([], [v1])
    async with stubs(1) as only_other:
        only_other[0][1].base = "another-base"
        async with gateway([only_other[0][0]]) as url, client(url) as api:
            with pytest.raises(openai.InternalServerError) as caught:
                await api.completions.create(model="tenant-42", prompt="p", max_tokens=1)
    assert caught.value.status_code == 503
    assert "base 'base'" in caught.value.message


async def test_a_replica_dead_before_the_first_byte_is_retried_elsewhere(
    gateway: Gateway, publish: Any, table: EpochTable
) -> None:
    await publish("tenant-42", b"v1")
    state = await table.read_state("tenant-42")
    assert state is not None
    survivor, doomed = StubState(), StubState()
    survivor.adapters[state.name] = doomed.adapters[state.name] = state.path  # eligible on both
    async with running(build_stub(survivor)) as survivor_url:
        doomed_app = running(build_stub(doomed))
        doomed_url = await doomed_app.__aenter__()
        async with (
            gateway([doomed_url, survivor_url], poll_interval=60, **STUB_DIES) as url,
            client(url) as api,
        ):
            await doomed_app.__aexit__(None, None, None)  # gone; the pool still thinks it is healthy
            served = [
                await api.completions.with_raw_response.create(model="tenant-42", prompt="p", max_tokens=1)
                for _ in range(3)
            ]
    assert {raw.headers["x-kvgate-replica"] for raw in served} == {replica_id(survivor_url)}
    assert len(survivor.received) == 3


async def test_a_replica_dead_at_load_time_is_skipped(gateway: Gateway, publish: Any) -> None:
    v1 = await publish("tenant-42", b"v1")
    survivor, doomed = StubState(), StubState()
    async with running(build_stub(survivor)) as survivor_url:
        doomed_app = running(build_stub(doomed))
        doomed_url = await doomed_app.__aenter__()
        async with (
            gateway([doomed_url, survivor_url], poll_interval=60, **STUB_DIES) as url,
            client(url) as api,
        ):
            await doomed_app.__aexit__(None, None, None)  # the first pick for the load, now gone
            raw = await api.completions.with_raw_response.create(model="tenant-42", prompt="p", max_tokens=1)
    assert raw.headers["x-kvgate-replica"] == replica_id(survivor_url)
    assert (doomed.loads, survivor.loads) == ([], [v1])


async def test_admin_surface_refuses_missing_or_wrong_tokens(gateway: Gateway, publish: Any) -> None:
    await publish("tenant-42", b"v1")
    body = json.dumps({"model": "tenant-42", "prompt": "p", "max_tokens": 1}).encode()
    async with stubs(1) as backends:
        stub_url = backends[0][0]
        async with gateway([stub_url], admin_token="right") as url, aiohttp.ClientSession() as http:

            async def status(path: str, method: str = "GET", **headers: str) -> tuple[int, dict[str, Any]]:
                async with http.request(method, f"{url}{path}", headers=headers, data=body) as response:
                    return response.status, await response.json()

            no_token = await status("/kvgate/status")
            wrong = await status("/kvgate/status", **{"x-kvgate-admin-token": "wrong"})
            pin_wrong = await status("/v1/completions", "POST", **{"x-kvgate-pin": stub_url})
            cold_wrong = await status("/v1/completions", "POST", **{"x-kvgate-namespace": "cold"})
            pin_unknown = await status(
                "/v1/completions",
                "POST",
                **{"x-kvgate-pin": "http://elsewhere:1", "x-kvgate-admin-token": "right"},
            )
            ok = await status("/kvgate/status", **{"x-kvgate-admin-token": "right"})
    for code, doc in (no_token, wrong, pin_wrong, cold_wrong):
        assert code == 401
        assert doc["error"]["type"] == "authentication_error"
    assert pin_unknown[0] == 400
    assert "not one of this pool's replicas" in pin_unknown[1]["error"]["message"]
    assert ok[0] == 200
    assert list(ok[1]["versions"]) == ["tenant-42"]
    assert backends[0][1].received == [], "refused requests never reach a replica"


async def test_admin_surface_is_off_without_a_configured_token(gateway: Gateway) -> None:
    async with stubs(1) as backends, gateway([backends[0][0]]) as url, aiohttp.ClientSession() as http:
        headers = {"x-kvgate-admin-token": ""}
        async with http.get(f"{url}/kvgate/status", headers=headers) as response:
            assert response.status == 401
