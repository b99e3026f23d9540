"""The Lua epoch table against a real redis-server."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from redis.asyncio import Redis

from gateway.core.errors import ModelNotFound, VersionNotFound
from gateway.table import keys
from gateway.table.epoch_table import EpochTable, lua_dir

D1, D2, D3 = "1" * 64, "2" * 64, "3" * 64


async def publish(table: EpochTable, digest: str, base: str = "base") -> tuple[bool, int]:
    change = await table.publish("tenant-42", digest, f"tenant-42@{digest[:16]}", f"/store/{digest}", base)
    return change.changed, change.epoch


def test_every_lua_file_is_registered(redis: Redis) -> None:
    table = EpochTable(redis)
    on_disk = {p.stem for p in Path(str(lua_dir())).glob("*.lua")}
    assert on_disk == set(table.scripts)
    assert {"publish_version", "rollback_version", "bump_epoch", "record_loaded"} <= on_disk


def test_every_lua_file_documents_keys_argv_and_returns() -> None:
    for path in Path(str(lua_dir())).glob("*.lua"):
        header = path.read_text().split("]]")[0]
        for word in ("KEYS[1]", "Returns"):
            assert word in header, f"{path.name} header lacks {word}"


async def test_publish_is_idempotent_and_epochs_are_monotonic(table: EpochTable) -> None:
    assert await publish(table, D1) == (True, 1)
    assert await publish(table, D1) == (False, 1)
    assert await publish(table, D2) == (True, 2)
    state = await table.read_state("tenant-42")
    assert state is not None
    assert (state.digest, state.name, state.epoch) == (D2, f"tenant-42@{D2[:16]}", 2)


async def test_same_digest_new_base_is_a_new_version(table: EpochTable) -> None:
    await publish(table, D1, base="base-a")
    assert await publish(table, D1, base="base-b") == (True, 2)


async def test_rollback_to_previous_and_by_prefix(table: EpochTable) -> None:
    await publish(table, D1)
    await publish(table, D2)
    await publish(table, D3)
    back = await table.rollback("tenant-42")
    assert (back.changed, back.epoch, back.digest) == (True, 4, D2)
    again = await table.rollback("tenant-42", D1[:8])
    assert (again.changed, again.epoch, again.digest) == (True, 5, D1)
    same = await table.rollback("tenant-42", D1)
    assert (same.changed, same.epoch) == (False, 5)
    actions = [event["action"] for event in await table.read_history("tenant-42")]
    assert actions == ["rollback", "rollback", "publish", "publish", "publish"]


async def test_rollback_errors(table: EpochTable) -> None:
    with pytest.raises(ModelNotFound):
        await table.rollback("nobody")
    await publish(table, D1)
    with pytest.raises(VersionNotFound, match="earlier version"):
        await table.rollback("tenant-42")
    with pytest.raises(VersionNotFound):
        await table.rollback("tenant-42", "f" * 64)


async def test_bump(table: EpochTable) -> None:
    with pytest.raises(ModelNotFound):
        await table.bump("tenant-42")
    await publish(table, D1)
    assert (await table.bump("tenant-42")).epoch == 2
    state = await table.read_state("tenant-42")
    assert state is not None
    assert (state.digest, state.epoch) == (D1, 2)


async def test_mutations_publish_hints(table: EpochTable, redis: Redis) -> None:
    pubsub = redis.pubsub(ignore_subscribe_messages=True)
    await pubsub.subscribe(keys.HINTS)
    await publish(table, D1)
    await table.bump("tenant-42")
    await publish(table, D1)  # unchanged: no hint
    await table.record_loaded("http://r1", {"tenant-42@x": "/store/x"}, ttl_ms=5000)
    await table.record_loaded("http://r1", {"tenant-42@x": "/store/x"}, ttl_ms=5000)  # same set: no hint
    hints: list[bytes] = []
    async with asyncio.timeout(5):
        while len(hints) < 3:
            message = await pubsub.get_message(timeout=1.0)
            if message:
                hints.append(message["data"])
    assert hints == [b"tenant-42", b"tenant-42", b"replica:http://r1"]
    assert await pubsub.get_message(timeout=0.3) is None
    await pubsub.aclose()  # type: ignore[no-untyped-call]


async def test_all_keys_of_an_id_share_one_cluster_slot(table: EpochTable, redis: Redis) -> None:
    await publish(table, D1)
    await table.acquire_load_lock("tenant-42", "tenant-42@x", "http://r1", "tok", 5000)
    per_id = [k.decode() for k in await redis.keys("kvg:{tenant-42}:*") if isinstance(k, bytes)]
    assert len(per_id) == 4
    assert {k.split("}")[0] for k in per_id} == {"kvg:{tenant-42"}


async def test_load_lock_is_single_owner(table: EpochTable) -> None:
    args = ("tenant-42", "tenant-42@x", "http://r1")
    assert await table.acquire_load_lock(*args, "a", 5000)
    assert not await table.acquire_load_lock(*args, "b", 5000)
    assert await table.acquire_load_lock(*args, "a", 5000)  # re-entrant for its owner
    assert not await table.release_load_lock(*args, "b")
    assert await table.release_load_lock(*args, "a")
    assert await table.acquire_load_lock(*args, "b", 5000)


async def test_generation_survives_and_changes_when_table_is_emptied(table: EpochTable, redis: Redis) -> None:
    first = await table.ensure_generation()
    assert await table.ensure_generation() == first
    await redis.flushdb()
    assert await table.ensure_generation() != first


async def test_read_all_ignores_indexed_ids_without_state(table: EpochTable, redis: Redis) -> None:
    await redis.sadd(keys.IDS, "half-published")
    await publish(table, D1)
    view = await table.read_all()
    assert list(view.states) == ["tenant-42"]
