"""Callers and tenants, against fast stubs, a real Redis and the official openai client: API keys, what a key
may use (and what it may not even learn exists), a base-model cache namespace per tenant, replica ids in
the evidence headers, kvgate's credential kept from replicas, and the admin surface on its own listener."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from redis.asyncio import Redis

from gateway.adapters.publish import publish_adapter
from gateway.adapters.store import AdapterStore
from gateway.app.keys import ADMIN_LISTENER
from gateway.app.wiring import build_app
from gateway.core.wire import replica_id
from gateway.process.http_edge import running
from gateway.settings.model import Settings
from gateway.table.callers import CallerTable
from gateway.table.epoch_table import EpochTable
from tests.request.test_proxy import ADMIN_TOKEN, stubs
from tests.support.adapter_files import MakeAdapter
from tests.support.conditions import eventually


@dataclass(frozen=True)
class Started:
    url: str
    admin_url: str | None  # the admin listener, when one is configured


StartGateway = Callable[..., AbstractAsyncContextManager[Started]]


@pytest.fixture
def gateway(redis: Redis, tmp_path: Path) -> StartGateway:
    @asynccontextmanager
    async def start(replicas: list[str], **overrides: Any) -> AsyncIterator[Started]:
        settings = Settings(
            replicas=replicas,
            store=tmp_path / "store",
            admin_token=overrides.pop("admin_token", ADMIN_TOKEN),
            reconcile_interval=0.1,
            poll_interval=0.1,
            **{"auth": "api-keys", **overrides},
        )
        app = build_app(settings, redis)
        async with running(app) as url:
            if ADMIN_LISTENER not in app:
                yield Started(url, None)
                return
            async with running(app[ADMIN_LISTENER]) as admin_url:
                yield Started(url, admin_url)

    return start


@pytest.fixture
def publish(table: EpochTable, make_adapter: MakeAdapter, tmp_path: Path) -> Callable[..., Any]:
    async def do(logical_id: str) -> str:
        store = AdapterStore(tmp_path / "store")
        done = await publish_adapter(table, store, logical_id, make_adapter(logical_id.encode()), "base")
        return done.name

    return do


def client(url: str, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)


async def call(
    url: str,
    path: str,
    *,
    method: str = "POST",
    body: dict[str, Any] | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, bytes, dict[str, str]]:
    async with (
        aiohttp.ClientSession() as http,
        http.request(method, f"{url}{path}", json=body, headers=headers) as response,
    ):
        return response.status, await response.read(), dict(response.headers)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


COMPLETION = {"model": "tenant-a", "prompt": "p", "max_tokens": 1}


async def test_a_request_without_a_valid_key_is_401(
    gateway: StartGateway, publish: Any, redis: Redis
) -> None:
    await publish("tenant-a")
    key, _ = await CallerTable(redis).create("acme", ["tenant-a"], base=True)
    async with stubs(1) as backends, gateway([backends[0][0]]) as started:
        url = started.url
        refused = [
            await call(url, "/v1/completions", body=COMPLETION),
            await call(url, "/v1/completions", body=COMPLETION, headers=bearer("kvg-not-a-key")),
            await call(url, "/v1/completions", body=COMPLETION, headers={"Authorization": f"Basic {key}"}),
            await call(url, "/v1/chat/completions", body=COMPLETION),
            await call(url, "/v1/models", method="GET"),
        ]
        with pytest.raises(openai.AuthenticationError) as wrong:
            async with client(url, "kvg-wrong") as api:
                await api.completions.create(model="tenant-a", prompt="p", max_tokens=1)
        async with client(url, key) as api:
            ok = await api.completions.create(model="tenant-a", prompt="p", max_tokens=1)
            healthz = await call(url, "/healthz", method="GET")
    assert [status for status, _, _ in refused] == [401] * 5
    for _, body, _ in refused:
        assert openai_error(body)["type"] == "authentication_error"
    assert wrong.value.status_code == 401
    assert ok.model == "tenant-a"
    assert healthz[0] == 200, "load balancers probe /healthz without a key"
    assert len(backends[0][1].received) == 1, "refused requests never reach a replica"


def openai_error(body: bytes) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(body)
    assert set(doc) == {"error"}
    assert set(doc["error"]) == {"message", "type", "param", "code"}
    return dict(doc["error"])


async def test_a_revoked_key_is_refused_within_the_reconcile_interval(
    gateway: StartGateway, publish: Any, redis: Redis
) -> None:
    await publish("tenant-a")
    callers = CallerTable(redis)
    key, caller = await callers.create("acme", ["tenant-a"], base=False)
    async with stubs(1) as backends, gateway([backends[0][0]]) as started:
        late_key, _ = await callers.create("late", ["tenant-a"], base=False)  # made while kvgate runs

        async def accepted(with_key: str) -> bool:
            status, _, _ = await call(
                started.url, "/v1/completions", body=COMPLETION, headers=bearer(with_key)
            )
            assert status in (200, 401)
            return status == 200

        assert await accepted(key)
        await eventually(lambda: accepted(late_key), "a key created while kvgate runs is accepted")
        await callers.revoke(caller.key_id)

        async def refused() -> bool:
            return not await accepted(key)

        await eventually(refused, "the revoked key is refused", within=5)
        assert await accepted(late_key)


async def test_another_tenants_logical_id_is_404_exactly_like_a_missing_one(
    gateway: StartGateway, publish: Any, redis: Redis
) -> None:
    await publish("tenant-a")
    await publish("tenant-b")
    key_a, _ = await CallerTable(redis).create("acme", ["tenant-a"], base=False)
    async with stubs(1) as backends, gateway([backends[0][0]]) as started:

        async def ask(model: str) -> tuple[int, bytes]:
            body = {**COMPLETION, "model": model}
            status, raw, _ = await call(started.url, "/v1/completions", body=body, headers=bearer(key_a))
            return status, raw.replace(model.encode(), b"MODEL")

        others, missing, base = await ask("tenant-b"), await ask("tenant-zz"), await ask("base")
        async with client(started.url, key_a) as api:
            with pytest.raises(openai.NotFoundError) as caught:
                await api.chat.completions.create(
                    model="tenant-b", messages=[{"role": "user", "content": "x"}]
                )
            mine = await api.completions.create(model="tenant-a", prompt="p", max_tokens=1)
    assert others == missing == base, "another tenant's ID and the base answer as if they did not exist"
    assert others[0] == 404
    assert openai_error(others[1])["param"] == "model"
    assert caught.value.status_code == 404
    assert mine.model == "tenant-a"
    assert [body["model"].split("@")[0] for body in backends[0][1].received] == ["tenant-a"]


async def test_models_lists_only_what_the_key_may_use(
    gateway: StartGateway, publish: Any, redis: Redis
) -> None:
    for logical_id in ("tenant-a", "tenant-b", "tenant-c"):
        await publish(logical_id)
    callers = CallerTable(redis)
    key_a, _ = await callers.create("acme", ["tenant-a", "tenant-a-next"], base=True)  # -next: unpublished
    key_b, _ = await callers.create("bolt", ["tenant-b", "tenant-c"], base=False)
    async with stubs(1) as backends, gateway([backends[0][0]]) as started:
        async with client(started.url, key_a) as api:
            seen_a = [m.id for m in (await api.models.list()).data]
        async with client(started.url, key_b) as api:
            seen_b = [m.id for m in (await api.models.list()).data]
    assert seen_a == ["base", "tenant-a"]
    assert seen_b == ["tenant-b", "tenant-c"]


SALT = re.compile(r"kvg-[0-9a-f]{32}")


async def test_base_model_requests_get_a_cache_namespace_per_tenant(
    gateway: StartGateway, redis: Redis
) -> None:
    callers = CallerTable(redis)
    key_1, _ = await callers.create("acme", [], base=True)
    key_1b, _ = await callers.create("acme", [], base=True)  # a second key of the same tenant
    key_2, _ = await callers.create("bolt", [], base=True)
    async with stubs(1) as backends, gateway([backends[0][0]]) as started:
        for key in (key_1, key_1, key_1b, key_2):
            async with client(started.url, key) as api:
                completion = await api.completions.create(
                    model="base", prompt="the same prompt", max_tokens=1, extra_body={"cache_salt": "mine"}
                )
                assert completion.model == "base"
    salts = [body["cache_salt"] for body in backends[0][1].received]
    assert all(SALT.fullmatch(salt) for salt in salts), salts
    assert salts[0] == salts[1] == salts[2], "one tenant keeps one namespace (warm), whichever key it uses"
    assert salts[3] != salts[0], "two tenants never share base-model prefix blocks"
    assert [body["model"] for body in backends[0][1].received] == ["base"] * 4


async def test_without_keys_base_requests_and_credentials_pass_as_before(
    gateway: StartGateway, publish: Any
) -> None:
    await publish("tenant-a")
    async with (
        stubs(1) as backends,
        gateway([backends[0][0]], auth="off") as started,
        client(started.url, "the-replicas-own-key") as api,
    ):
        await api.completions.create(model="base", prompt="p", max_tokens=1)
        await api.completions.create(model="tenant-a", prompt="p", max_tokens=1)
        models = [m.id for m in (await api.models.list()).data]
    (base, adapter) = backends[0][1].received
    assert "cache_salt" not in base
    assert SALT.fullmatch(adapter["cache_salt"])
    assert {h["Authorization"] for h in backends[0][1].received_headers} == {"Bearer the-replicas-own-key"}
    assert models == ["base", "tenant-a"]


async def test_kvgates_own_credential_never_reaches_a_replica(
    gateway: StartGateway, publish: Any, redis: Redis
) -> None:
    await publish("tenant-a")
    key, _ = await CallerTable(redis).create("acme", ["tenant-a"], base=True)
    async with (
        stubs(1) as backends,
        gateway([backends[0][0]]) as started,
        client(started.url, key) as api,
    ):
        await api.completions.create(model="tenant-a", prompt="p", max_tokens=1)
        stream = await api.chat.completions.create(
            model="base", messages=[{"role": "user", "content": "x"}], stream=True
        )
        assert [chunk async for chunk in stream]
    received = backends[0][1].received_headers
    assert len(received) == 2
    assert not [h for h in received if "Authorization" in h or key in str(h)]


async def test_replicas_are_named_by_a_stable_id_not_their_url(gateway: StartGateway, publish: Any) -> None:
    await publish("tenant-a")
    async with stubs(2) as backends, gateway([u for u, _ in backends], auth="off") as started:
        urls = [u for u, _ in backends]
        answers = [await call(started.url, "/v1/completions", body=COMPLETION) for _ in range(4)] + [
            await call(started.url, "/v1/completions", body={**COMPLETION, "model": "base"})
        ]
        token = {"x-kvgate-admin-token": ADMIN_TOKEN}
        status, raw_status, _ = await call(started.url, "/kvgate/status", method="GET", headers=token)
        pinned = {}
        for url in urls:  # the audit pins by id or by URL: both name the same replica
            for pin in (replica_id(url), url):
                pin_headers = {"x-kvgate-pin": pin, **token}
                _, _, headers = await call(
                    started.url, "/v1/completions", body=COMPLETION, headers=pin_headers
                )
                pinned[pin] = headers["x-kvgate-replica"]
    ids = {replica_id(url): url for url in urls}
    assert len(ids) == 2
    for code, _, headers in answers:
        assert code == 200
        assert headers["x-kvgate-replica"] in ids
        leaked = [value for value in headers.values() for url in urls if url.split("//")[1] in value]
        assert leaked == [], "no response header names a replica's address"
    assert status == 200
    assert {r["id"]: r["url"] for r in json.loads(raw_status)["replicas"]} == ids, "the admin maps ids"
    assert pinned == {pin: replica_id(url) for url in urls for pin in (replica_id(url), url)}
    async with stubs(1) as more, gateway([more[0][0]], auth="off", expose_replica_urls=True) as started:
        _, _, headers = await call(started.url, "/v1/completions", body={**COMPLETION, "model": "base"})
    assert headers["x-kvgate-replica"] == more[0][0], "exposing URLs is an explicit setting"


async def test_replica_ids_are_short_stable_and_distinct() -> None:
    a, b = replica_id("http://10.0.0.5:8000"), replica_id("http://10.0.0.6:8000")
    assert a == replica_id("http://10.0.0.5:8000")
    assert a != b
    assert re.fullmatch(r"r-[0-9a-f]{12}", a)


async def test_the_admin_surface_can_have_its_own_listener(
    gateway: StartGateway, publish: Any, redis: Redis
) -> None:
    await publish("tenant-a")
    key, _ = await CallerTable(redis).create("acme", ["tenant-a"], base=False)
    token = {"x-kvgate-admin-token": ADMIN_TOKEN}
    async with stubs(1) as backends, gateway([backends[0][0]], admin_port=0) as started:
        public, admin = started.url, started.admin_url
        assert admin is not None
        assert public != admin
        public_metrics = await call(public, "/metrics", method="GET")
        public_status = await call(public, "/kvgate/status", method="GET", headers=token)
        pin = {"x-kvgate-pin": backends[0][0], **token}
        public_pin = await call(public, "/v1/completions", body=COMPLETION, headers={**bearer(key), **pin})
        admin_metrics = await call(admin, "/metrics", method="GET", headers=token)
        admin_status = await call(admin, "/kvgate/status", method="GET", headers=token)
        admin_no_token = await call(admin, "/kvgate/status", method="GET")
        # an audit's request: pinned, on the admin listener, the admin token stands for every logical ID
        audit_like = await call(admin, "/v1/completions", body=COMPLETION, headers=pin)
        public_ok = await call(public, "/v1/completions", body=COMPLETION, headers=bearer(key))
        health = [(await call(u, "/healthz", method="GET"))[0] for u in (public, admin)]
    assert (public_metrics[0], public_status[0]) == (404, 404)
    assert openai_error(public_metrics[1])["type"] == openai_error(public_status[1])["type"]
    assert public_pin[0] == 401, "the admin token is not honoured on the public listener"
    assert (admin_metrics[0], admin_status[0], admin_no_token[0]) == (200, 200, 401)
    assert b"kvgate_requests_total" in admin_metrics[1]
    assert audit_like[0] == 200
    assert public_ok[0] == 200
    assert health == [200, 200]


@pytest.mark.parametrize("auth", ["off", "api-keys"])
async def test_public_metrics_name_no_tenant_without_the_admin_token(
    gateway: StartGateway, publish: Any, redis: Redis, auth: str
) -> None:
    """Without admin_port, /metrics (its series are labelled by logical ID: the tenants) was served to
    anyone on the public listener. It takes the admin token there, as the header or as a bearer token (what
    a Prometheus scrape config's ``authorization`` sends); an API key is not one. On the admin listener
    it stays open (the ServiceMonitor scrapes it without a token)."""
    await publish("tenant-a")
    key, _ = await CallerTable(redis).create("acme", ["tenant-a"], base=False)
    async with stubs(1) as backends:
        async with gateway([backends[0][0]], auth=auth) as started:
            served = await call(started.url, "/v1/completions", body=COMPLETION, headers=bearer(key))
            anonymous = await call(started.url, "/metrics", method="GET")
            keyed = await call(started.url, "/metrics", method="GET", headers=bearer(key))
            wrong = await call(started.url, "/metrics", method="GET", headers={"x-kvgate-admin-token": "no"})
            header = await call(
                started.url, "/metrics", method="GET", headers={"x-kvgate-admin-token": ADMIN_TOKEN}
            )
            scraped = await call(started.url, "/metrics", method="GET", headers=bearer(ADMIN_TOKEN))
        async with gateway([backends[0][0]], auth=auth, admin_token=None) as started:
            tokenless = await call(started.url, "/metrics", method="GET", headers=bearer(ADMIN_TOKEN))
        async with gateway([backends[0][0]], auth=auth, admin_port=0) as started:
            assert started.admin_url is not None
            private = await call(started.admin_url, "/metrics", method="GET")
    assert served[0] == 200
    for refused in (anonymous, keyed, wrong, tokenless):
        assert refused[0] == 401
        assert openai_error(refused[1])["type"] == "authentication_error"
        assert b"tenant-a" not in refused[1]
    for allowed in (header, scraped, private):
        assert allowed[0] == 200
    assert b'logical_id="tenant-a"' in header[1]
    assert b'logical_id="tenant-a"' in scraped[1]
