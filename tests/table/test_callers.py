"""API keys in Redis (stored hashed) and each kvgate's local copy of them, against a real redis-server."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis

from gateway.core.errors import BadRequest, CallerNotFound, InvalidAdapter, KeysUnavailable
from gateway.process.http_edge import free_port
from gateway.table import keys
from gateway.table.callers import Callers, CallerSync, CallerTable, key_hash
from tests.support.conditions import eventually


@contextlib.asynccontextmanager
async def synced(
    table: CallerTable, callers: Callers, interval: float, *, read_first: bool = True
) -> AsyncIterator[None]:
    sync = CallerSync(table, callers, interval=interval)
    if read_first:
        await sync.reload()
    task = asyncio.create_task(sync.run())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_a_key_is_stored_hashed_and_listed_by_its_id(redis: Redis) -> None:
    table = CallerTable(redis)
    key, caller = await table.create("acme", ["tenant-42", "tenant-43", "tenant-42"], base=True)
    assert key.startswith("kvg-")
    assert len(key) > 40
    assert (caller.tenant, sorted(caller.ids), caller.base) == ("acme", ["tenant-42", "tenant-43"], True)
    assert key_hash(key).startswith(caller.key_id), "the id is a short prefix of the hash, not of the key"
    assert await redis.keys("*") == [keys.CALLERS.encode()], "one hash holds every key"
    stored: dict[bytes, bytes] = await redis.hgetall(keys.CALLERS)  # type: ignore[assignment]
    dump = b"".join(field + value for field, value in stored.items())
    assert key.encode() not in dump, "Redis never holds the key itself"
    assert key_hash(key).encode() in dump
    (listed,), malformed = await table.list()
    assert listed == caller
    assert malformed == {}
    assert (await table.read_all()) == {key_hash(key): caller}


async def test_revoke_removes_the_key_and_an_unknown_id_is_not_found(redis: Redis) -> None:
    table = CallerTable(redis)
    _, caller = await table.create("acme", ["tenant-42"], base=False)
    await table.create("other", [], base=True)
    assert (await table.revoke(caller.key_id)) == caller
    assert [c.tenant for c in (await table.list())[0]] == ["other"]
    with pytest.raises(CallerNotFound, match=caller.key_id):
        await table.revoke(caller.key_id)


@pytest.mark.parametrize(
    ("tenant", "ids", "base", "error", "reason"),
    [
        ("acme", ["tenant@42"], False, InvalidAdapter, "invalid logical ID"),
        ("", ["tenant-42"], False, BadRequest, "invalid tenant"),
        ("a b", ["tenant-42"], False, BadRequest, "invalid tenant"),
        ("acme", [], False, BadRequest, "at least one"),
    ],
)
async def test_bad_input_is_refused_and_nothing_is_written(
    redis: Redis, tenant: str, ids: list[str], base: bool, error: type[Exception], reason: str
) -> None:
    with pytest.raises(error, match=reason):
        await CallerTable(redis).create(tenant, ids, base=base)
    assert await redis.exists(keys.CALLERS) == 0


async def test_the_local_copy_follows_hints(redis: Redis) -> None:
    table, callers = CallerTable(redis), Callers(max_staleness=60)
    async with synced(table, callers, interval=60):  # no periodic read in this test: hints only
        key, caller = await table.create("acme", ["tenant-42"], base=False)
        await eventually(lambda: callers.find(key) == caller, "a new key is seen through its hint")
        await table.revoke(caller.key_id)
        await eventually(lambda: callers.find(key) is None, "a revoked key is gone through its hint")
    assert callers.find("kvg-never-issued") is None


async def test_the_local_copy_follows_a_revoke_made_straight_in_redis(redis: Redis) -> None:
    table, callers = CallerTable(redis), Callers(max_staleness=60)
    key, caller = await table.create("acme", ["tenant-42"], base=False)
    async with synced(table, callers, interval=0.1):
        assert callers.find(key) == caller
        await redis.hdel(keys.CALLERS, caller.key_id)  # no hint: the periodic read catches it
        await eventually(lambda: callers.find(key) is None, "the revoke is seen by the periodic read")


async def test_a_copy_that_cannot_reach_redis_refuses_keys_after_its_bound(redis: Redis) -> None:
    callers = Callers(max_staleness=0.5)
    key, caller = await CallerTable(redis).create("acme", ["tenant-42"], base=False)
    await CallerSync(CallerTable(redis), callers, interval=60).reload()
    assert callers.find(key) == caller
    unreachable = Redis(host="127.0.0.1", port=free_port(), socket_connect_timeout=0.5)  # nothing listens

    def refused() -> bool:
        try:
            callers.find(key)
        except KeysUnavailable:
            return True
        return False

    try:  # the copy keeps answering until it is older than its bound, then trusts no key
        async with synced(CallerTable(unreachable), callers, interval=0.1, read_first=False):
            await eventually(refused, "keys refused once the copy is older than max_staleness")
        await CallerSync(CallerTable(redis), callers, interval=60).reload()  # Redis answers again
        assert callers.find(key) == caller
    finally:
        await unreachable.aclose()
