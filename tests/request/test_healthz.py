"""``/healthz`` is truthful and discreet: 503 when kvgate would refuse every request of a kind it accepts
(API keys unreadable past ``auth_max_staleness``; a stale table only past ``table_max_staleness``, when
set), and an anonymous caller of the public port gets readiness and counts, never a replica URL, a
logical ID or an API key id (real Redis, stub replicas)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
from redis.asyncio import Redis

from gateway.adapters.publish import publish_adapter
from gateway.adapters.store import AdapterStore
from gateway.app.keys import ADMIN_LISTENER
from gateway.app.wiring import build_app
from gateway.process.http_edge import free_port, running
from gateway.settings.model import Settings
from gateway.table import keys
from gateway.table.callers import CallerTable
from gateway.table.epoch_table import EpochTable
from gateway.table.redis_server import EmbeddedRedis
from tests.kv.test_tokens import model_dir  # noqa: F401  (the fixture)
from tests.support.adapter_files import MakeAdapter
from tests.support.conditions import eventually
from tests.support.stub_backend import StubState, build_stub

ADMIN = "admin-secret"
BAD_KEY_ID = "0badc0ffee00"
FAST: dict[str, Any] = {"reconcile_interval": 0.1, "poll_interval": 0.1, "admin_token": ADMIN}


async def healthz(url: str, token: str | None = None) -> tuple[int, dict[str, Any]]:
    headers = {"x-kvgate-admin-token": token} if token else {}
    async with aiohttp.ClientSession() as http, http.get(f"{url}/healthz", headers=headers) as response:
        doc: dict[str, Any] = await response.json()
        return response.status, doc


async def test_anonymous_healthz_names_no_replica_logical_id_or_key_id(
    redis: Redis,
    make_adapter: MakeAdapter,
    model_dir: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    """The probe: a replica whose KV events fail (its URL in ``last_error``), a malformed state row (its
    logical ID) and a malformed key row (its key id) were all on the public port's anonymous /healthz."""
    store = AdapterStore(tmp_path / "store")
    await publish_adapter(EpochTable(redis), store, "tenant-secret", make_adapter(b"v1"), "base")
    await redis.hset(keys.state("tenant-secret"), "epoch", "NaN")
    await redis.hset(keys.CALLERS, BAD_KEY_ID, "{x")
    await CallerTable(redis).create("acme", [], base=True)
    dead = f"http://127.0.0.1:{free_port()}"  # refuses: its KV event sources cannot be asked
    async with running(build_stub(StubState())) as stub:
        settings = Settings(
            replicas=[stub, dead], store=store.root, auth="api-keys", kv_events=True, tokenizer=model_dir,
            data_dir=tmp_path,
            **FAST,
        )  # fmt: skip
        async with running(build_app(settings, redis)) as url:

            async def detailed() -> bool:
                _, doc = await healthz(url, ADMIN)
                streams = doc["kv_events"]
                return bool(doc["table"]["malformed_rows"] and doc["api_keys"]["malformed"]) and any(
                    dead.removeprefix("http://") in stream.get("last_error", "")
                    for stream in streams.values()
                )

            await eventually(detailed, "the admin view names the bad rows and the failing stream", within=10)
            status, public = await healthz(url)
            assert status == 200
            text = json.dumps(public)
            for secret in (dead.removeprefix("http://"), stub.removeprefix("http://"), "tenant-secret",
                           BAD_KEY_ID, "last_error"):  # fmt: skip
                assert secret not in text, f"anonymous /healthz names {secret!r}: {text}"
            assert public["table"]["malformed_rows"] == 1
            assert public["api_keys"]["malformed"] == 1
            # neither replica's events can be followed (the stub has no /kv_event_sources, the other
            # refuses): both unavailable, counted here, with the reason per replica in the detail view
            counts = {"streams": 2, "following": 0, "partial": 0, "lost": 0, "unavailable": 2, "lagging": 0,
                      "token_fallback": 0}  # fmt: skip
            assert public["kv_events"] == counts
            _, detail = await healthz(url, ADMIN)
            assert {stream["state"] for stream in detail["kv_events"].values()} == {"unavailable"}
            assert all(stream["reason"] for stream in detail["kv_events"].values())
            assert public["replicas_healthy"] == 1
            assert public["unready"] == []
            _, guessed = await healthz(url, "not-the-token")
            assert guessed["api_keys"]["malformed"] == 1, "a wrong token: the public view"


async def test_the_admin_listener_answers_the_detail_view_and_the_public_port_never_does(
    redis: Redis, make_adapter: MakeAdapter, tmp_path: Path
) -> None:
    store = AdapterStore(tmp_path / "store")
    await publish_adapter(EpochTable(redis), store, "tenant-secret", make_adapter(b"v1"), "base")
    await redis.hset(keys.state("tenant-secret"), "epoch", "NaN")
    async with running(build_stub(StubState())) as stub:
        settings = Settings(
            replicas=[stub], admin_port=free_port(), data_dir=tmp_path, store=store.root, **FAST
        )
        app = build_app(settings, redis)
        async with running(app) as url, running(app[ADMIN_LISTENER], port=settings.admin_port) as admin:
            _, detail = await healthz(admin)
            assert "tenant-secret" in detail["table"]["malformed_rows"]
            _, public = await healthz(url, ADMIN)  # the token is refused on the public port
            assert public["table"]["malformed_rows"] == 1


@asynccontextmanager
async def outage_kvgate(tmp_path: Path, **overrides: Any) -> AsyncIterator[tuple[str, EmbeddedRedis, str]]:
    """A kvgate on a Redis of its own (which the test stops), with one API key; yields its URL, the
    Redis and the key."""
    server = EmbeddedRedis(tmp_path / "redis-home")
    server.start()
    redis = Redis.from_url(server.url, socket_timeout=1.0, socket_connect_timeout=1.0)
    try:
        key, _ = await CallerTable(redis).create("acme", [], base=True)
        async with running(build_stub(StubState())) as stub:
            settings = Settings(
                replicas=[stub], store=tmp_path / "store", data_dir=tmp_path, **FAST | overrides
            )
            async with running(build_app(settings, redis)) as url:
                yield url, server, key
    finally:
        await redis.aclose()
        server.stop()


async def completion(url: str, key: str) -> tuple[int, str]:
    body = {"model": "base", "prompt": "p", "max_tokens": 1}
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}) as answer,
    ):
        return answer.status, await answer.text()


async def test_api_keys_unreadable_past_auth_max_staleness_make_healthz_503_then_200(tmp_path: Path) -> None:
    """The probe: Redis stopped with auth = "api-keys": past auth_max_staleness every keyed request got
    503 KeysUnavailable while /healthz said 200, so a load balancer kept sending traffic it refused."""
    async with outage_kvgate(tmp_path, auth="api-keys", auth_max_staleness=1.0) as (url, server, key):
        assert (await completion(url, key))[0] == 200
        assert (await healthz(url))[0] == 200
        server.stop()

        async def refused() -> bool:
            status, text = await completion(url, key)
            return status == 503 and "cannot check API keys" in text

        await eventually(refused, "keyed requests get 503 once the keys are too old", within=15)
        status, doc = await healthz(url)
        assert status == 503, doc
        (why,) = doc["unready"]  # the stale table alone is not a reason (table_max_staleness unset)
        assert why.startswith("API keys not readable for "), why
        assert doc["api_keys"]["age_s"] >= doc["api_keys"]["max_age_s"] == 1.0
        assert doc["table"]["followed"] is False
        assert doc["table"]["max_age_s"] is None
        server.start()

        async def ready() -> bool:
            return (await healthz(url))[0] == 200 and (await completion(url, key))[0] == 200

        await eventually(ready, "ready and serving once the keys are read again", within=15)


async def test_a_stale_table_makes_healthz_503_only_past_table_max_staleness(tmp_path: Path) -> None:
    async with outage_kvgate(tmp_path, table_max_staleness=1.0) as (url, server, _):
        status, doc = await healthz(url)
        assert status == 200
        assert doc["table"]["followed"] is True
        assert doc["table"]["age_s"] < 1.0
        server.stop()

        async def unready() -> bool:
            status, doc = await healthz(url)
            return status == 503 and any(
                why.startswith("the epoch table not readable") for why in doc["unready"]
            )

        await eventually(unready, "/healthz 503 once the table is older than table_max_staleness", within=15)
        server.start()
        await eventually(lambda: _ok(url), "ready again once the table is followed again", within=15)


async def _ok(url: str) -> bool:
    return (await healthz(url))[0] == 200
