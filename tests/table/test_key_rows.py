"""API keys: a malformed row is that row's problem; a wiped key table is re-seeded, never with a revoked key.

Real redis-server, the real kvgate app (``auth = "api-keys"``) and the real ``kvgate keys`` command. The
rows are written as the hostile tester did (issue 17): ``HSET kvg:callers 0badc0ffee00 '{x'``, then
``FLUSHALL``.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from unittest.mock import ANY

import aiohttp
import redis as sync_redis
from redis.asyncio import Redis

from gateway.process.http_edge import running
from gateway.table import keys
from gateway.table.callers import Callers, CallerSync, CallerTable, key_hash
from gateway.table.redis_server import EmbeddedRedis
from gateway.telemetry.metrics import Metrics
from tests.adapters.test_tenants import StartGateway, gateway  # noqa: F401  (the fixture)
from tests.cli.test_cli import kvgate
from tests.request.test_proxy import ADMIN_TOKEN
from tests.support.conditions import eventually
from tests.support.stub_backend import StubState, build_stub

BAD_ID = "0badc0ffee00"


async def models_status(http: aiohttp.ClientSession, url: str, key: str) -> int:
    async with http.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"}) as response:
        return response.status


async def healthz(http: aiohttp.ClientSession, url: str, token: str | None = None) -> dict[str, object]:
    headers = {"x-kvgate-admin-token": token} if token else {}  # the detail view
    async with http.get(f"{url}/healthz", headers=headers) as response:
        doc: dict[str, object] = await response.json()
        return doc


async def test_a_malformed_key_row_is_refused_alone_and_the_sync_goes_on(
    redis: Redis,
    gateway: StartGateway,  # noqa: F811
) -> None:
    table = CallerTable(redis)
    kept, _ = await table.create("acme", ["tenant-42"], base=True)
    revoked, revoked_caller = await table.create("bolt", ["tenant-7"], base=True)
    await redis.hset(keys.CALLERS, BAD_ID, "{x")
    async with (
        running(build_stub(StubState())) as replica,
        gateway([replica]) as started,  # the startup's first read went through (it raised: exit 1)
        aiohttp.ClientSession() as http,
    ):
        url = started.url
        assert await models_status(http, url, kept) == 200
        await table.revoke(revoked_caller.key_id)
        fresh, _ = await table.create("cobalt", [], base=True)

        async def revoke_and_create_seen() -> bool:
            return (
                await models_status(http, url, revoked) == 401
                and await models_status(http, url, fresh) == 200
            )

        await eventually(revoke_and_create_seen, "the revoke and the new key reach the kvgate", 5)
        await asyncio.sleep(0.3)  # several re-reads: still one malformed row, logged and counted once
        health = await healthz(http, url, ADMIN_TOKEN)
        assert health["api_keys"] == {"keys": 2, "malformed": {BAD_ID: "key 0badc0ffee00: not JSON"},
                                      "wiped_at": None, "restored": 0, "lost": 0, "age_s": ANY,
                                      "max_age_s": 60.0}  # fmt: skip
        anonymous = await healthz(http, url)
        # a count, not the key id (the age moves between the two reads: a fresh-clone run saw 0.0, 0.5)
        assert anonymous["api_keys"] == {**health["api_keys"], "malformed": 1, "age_s": ANY}
        assert BAD_ID not in json.dumps(anonymous)
        async with http.get(f"{url}/metrics", headers={"x-kvgate-admin-token": ADMIN_TOKEN}) as response:
            assert 'kvgate_malformed_rows_total{kind="caller"} 1.0' in await response.text()


def test_kvgate_keys_list_names_a_malformed_row_and_exits_0(tmp_path: Path) -> None:
    data = tmp_path / "kvgate"
    with EmbeddedRedis(data) as server:
        client = sync_redis.Redis.from_url(server.url)
        try:
            assert kvgate("keys", "create", "--tenant", "acme", "--base", data_dir=data).returncode == 0
            client.hset(keys.CALLERS, BAD_ID, "{x")
            client.hset(keys.CALLERS, "00ff00ff00ff", '{"hash": 5}')
            listed = kvgate("keys", "list", data_dir=data)
            assert listed.returncode == 0, listed.stderr
            lines = listed.stdout.splitlines()
            assert any(line.startswith("0badc0ffee00") and "MALFORMED" in line and "not JSON" in line
                       for line in lines)  # fmt: skip
            assert any(line.startswith("00ff00ff00ff") and "MALFORMED" in line for line in lines)
            assert any("acme" in line for line in lines)
            revoked = kvgate("keys", "revoke", BAD_ID, data_dir=data)
            assert revoked.returncode == 0, revoked.stderr
            assert client.hget(keys.CALLERS, BAD_ID) is None, "a malformed row can be revoked (deleted)"
        finally:
            client.close()


async def test_flushall_re_seeds_the_keys_a_fresh_copy_holds_but_never_a_revoked_one(redis: Redis) -> None:
    table = CallerTable(redis)
    a = CallerSync(table, Callers(max_staleness=60, metrics=Metrics()), interval=30)
    b = CallerSync(table, Callers(max_staleness=60), interval=30)
    key_1, caller_1 = await table.create("acme", ["tenant-42"], base=False)
    key_2, _ = await table.create("bolt", ["tenant-7"], base=False)
    await a.reload()
    await b.reload()  # b's copy: both keys (it misses the revoke below)
    await table.revoke(caller_1.key_id)
    await a.reload()  # a saw it revoked
    await redis.flushall()
    await a.reload()
    assert a.callers.find(key_2) is not None
    assert a.callers.find(key_1) is None
    assert a.callers.restored == 1
    assert a.callers.wiped_at is not None
    assert await redis.hexists(keys.CALLERS, caller_1.key_id) == 0
    await b.reload()  # b writes back what it held, the revoked key with it...
    assert await redis.hexists(keys.CALLERS, caller_1.key_id) == 1
    await a.reload()  # ...a, which saw the revoke, deletes it again and refuses it
    assert a.callers.find(key_1) is None
    assert await redis.hexists(keys.CALLERS, caller_1.key_id) == 0
    await b.reload()
    assert b.callers.find(key_1) is None
    assert b.callers.find(key_2) is not None
    assert key_hash(key_2) in (await table.read()).by_hash


async def test_a_copy_too_old_to_trust_is_not_written_back_and_health_says_every_key_is_gone(
    redis: Redis,
) -> None:
    table = CallerTable(redis)
    sync = CallerSync(table, Callers(max_staleness=60), interval=0.05)
    key, _ = await table.create("acme", ["tenant-42"], base=False)
    await sync.reload()
    await asyncio.sleep(0.2)  # older than two intervals: a revoke could have been missed meanwhile
    await redis.flushall()
    await sync.reload()
    assert sync.callers.find(key) is None
    assert await redis.hlen(keys.CALLERS) == 0
    health = sync.callers.health()
    assert health["lost"] == 1
    assert health["wiped_at"] is not None


async def test_the_app_re_seeds_its_keys_after_flushall(
    redis: Redis,
    gateway: StartGateway,  # noqa: F811
) -> None:
    key, _ = await CallerTable(redis).create("acme", ["tenant-42"], base=True)
    async with (
        running(build_stub(StubState())) as replica,
        gateway([replica]) as started,
        aiohttp.ClientSession() as http,
    ):
        assert await models_status(http, started.url, key) == 200
        await redis.flushall()

        async def key_back() -> bool:
            return bool(await redis.hexists(keys.CALLERS, key_hash(key)[: keys.KEY_ID_LENGTH]))

        await eventually(key_back, "the key table re-seeded", 30)  # 0.1 s syncs; a bound against a hang
        for _ in range(5):  # every re-read since (each 0.1 s) keeps it
            assert await models_status(http, started.url, key) == 200
            await asyncio.sleep(0.1)
        health = (await healthz(http, started.url))["api_keys"]
        assert isinstance(health, dict)
        assert health["restored"] == 1
        assert health["wiped_at"] is not None
