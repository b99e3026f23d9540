"""A change is whole or absent: every Lua script refuses what Redis holds that its commands would fail on,
before its first write (issue 26; Redis does not roll a script's writes back when a command fails).

Table-driven: for every script in lua/, a call that writes when Redis holds what the scripts write, then
each odd value the script reads planted (a key of another type, a junk or overflowing count, the change
log at its last possible id, a record or candidate missing a field). The refused call must raise
``ScriptRefused`` and leave every key as it was (TYPE and DUMP of each, before and after). The real
scripts run on the session's redis-server; ``kvgate publish`` runs as the operator runs it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from redis import Redis as SyncRedis
from redis.asyncio import Redis

from gateway.core.errors import ScriptRefused
from gateway.table import keys
from gateway.table.epoch_table import EpochTable
from gateway.table.redis_server import EmbeddedRedis
from gateway.table.rollouts import start_rollout
from gateway.table.scripts import LOGGED, operation_names
from tests.cli.test_cli import kvgate
from tests.support.adapter_files import MakeAdapter
from tests.table.test_epoch_table import BASE, D1, D2, D3

ID, FRESH, REPLICA = "tenant-42", "tenant-new", "http://r1"
NAME = f"{ID}@{D1[:16]}"
LAST_ID = "18446744073709551615-18446744073709551615"
LOCK = keys.load_lock(ID, NAME, REPLICA)
GATE, COUNTS = keys.rollout_gate(ID, D3), keys.rollout_counts(ID, D3)
KINDS = {
    keys.LOG: "stream",
    keys.ROWS: "hash",
    keys.CHECK: "hash",
    keys.GENERATION: "string",
    keys.IDS: "set",
    keys.state(ID): "hash",
    keys.versions(ID): "hash",
    keys.history(ID): "list",
    keys.state(FRESH): "hash",
    keys.versions(FRESH): "hash",
    keys.history(FRESH): "list",
    keys.leases(REPLICA): "hash",
    keys.last_use(REPLICA): "hash",
    LOCK: "string",
    keys.replica_loaded(REPLICA): "string",
    GATE: "hash",
    COUNTS: "hash",
}
"""The type the scripts give each key a call below names."""


@dataclass(frozen=True)
class Call:
    script: str
    keys: list[str]
    args: list[str | int]
    setup: str = "published"  # which of SETUPS Redis holds first


def now() -> int:
    return 1_900_000_000_000


def logged(logical_id: str, versions: bool = True) -> list[str]:
    own = [
        keys.state(logical_id),
        *([keys.versions(logical_id)] if versions else []),
        keys.history(logical_id),
    ]
    return [*own, *LOGGED]


CALLS = {
    "publish_version": Call(
        "publish_version", logged(ID), [ID, D3, f"{ID}@{D3[:16]}", f"/s/{D3}", BASE, now(), 10_000, 100, ""]
    ),
    "bump_epoch": Call("bump_epoch", logged(ID, versions=False), [ID, now(), 10_000, 100]),
    "rollback_version": Call("rollback_version", logged(ID), [ID, "", BASE, now(), 10_000, 100, 8]),
    "reseed_version": Call(
        "reseed_version",
        logged(FRESH),
        [FRESH, D1, f"{FRESH}@{D1[:16]}", f"/s/{D1}", BASE, 5, now(), 10_000, 100],
    ),
    "rollout_version": Call(
        "rollout_version",
        logged(ID),
        [ID, D3, f"{ID}@{D3[:16]}", f"/s/{D3}", BASE, now(), 10_000, 100, "", 2500],
    ),
    "promote_candidate": Call(
        "promote_candidate", logged(ID, versions=False), [ID, now(), 10_000, 100, ""], setup="rolling out"
    ),
    "abort_rollout": Call(
        "abort_rollout", logged(ID, versions=False), [ID, now(), 10_000, 100, "", "test"], setup="rolling out"
    ),
    "forget_version": Call("forget_version", [keys.state(ID), keys.versions(ID)], [D1]),
    "heartbeat": Call(
        "heartbeat",
        [keys.GENERATION, keys.CHECK, keys.IDS, keys.ROWS, keys.LOG],
        [now(), 0, 100, 10_000, keys.STATE_PREFIX],
    ),
    "read_page": Call("read_page", [keys.IDS], ["0", 100, keys.STATE_PREFIX]),
    "acquire_lease": Call("acquire_lease", [keys.leases(REPLICA)], [NAME, "gw-a", now(), 10_000]),
    "begin_unload": Call("begin_unload", [keys.leases(REPLICA)], [NAME, now(), 1_000, 0, "gw-a"]),
    "end_unload": Call(
        "end_unload", [keys.leases(REPLICA), keys.last_use(REPLICA)], [NAME, 1], setup="leased"
    ),
    "refresh_leases": Call(
        "refresh_leases",
        [keys.leases(REPLICA), keys.last_use(REPLICA)],
        ["gw-a", now(), 10_000, now(), 1, NAME, now(), 1],
        setup="leased",
    ),
    "acquire_lock": Call("acquire_lock", [LOCK], ["token", 10_000]),
    "release_lock": Call("release_lock", [LOCK], ["token"], setup="locked"),
    "record_loaded": Call(
        "record_loaded",
        [keys.replica_loaded(REPLICA)],
        [REPLICA, '{"a":"b"}', 10_000, keys.HINTS, keys.REPLICA_HINT_PREFIX],
    ),
    "ensure_generation": Call("ensure_generation", [keys.GENERATION], ["new-generation"], setup="empty"),
    "take_gate_turn": Call("take_gate_turn", [GATE], ["gw-a", now(), 3_000, 1_000]),
    "renew_gate": Call("renew_gate", [GATE], ["gw-a", now(), 5_000, 1_000], setup="gated"),
    "release_gate": Call("release_gate", [GATE], ["gw-a"], setup="gated"),
    "add_rollout_counts": Call(
        "add_rollout_counts",
        [COUNTS],
        [60_000, 2, "candidate:requests", 1, "candidate:errors", 1],
        setup="gated",
    ),
}

Plant = Callable[[Redis], Awaitable[object]]


async def _published(table: EpochTable, redis: Redis) -> None:
    for digest in (D1, D2):
        await table.publish(ID, digest, f"{ID}@{digest[:16]}", f"/s/{digest}", BASE)


async def _rolling_out(table: EpochTable, redis: Redis) -> None:
    await _published(table, redis)
    await start_rollout(table, ID, D3, f"{ID}@{D3[:16]}", f"/s/{D3}", BASE, 2500)


async def _leased(table: EpochTable, redis: Redis) -> None:
    await _published(table, redis)
    await redis.hset(keys.leases(REPLICA), mapping={f"{NAME}|gw-a": now() - 1, f"{NAME}|gw-b": now() + 5})
    await redis.hset(keys.last_use(REPLICA), NAME, now() - 10)


async def _locked(table: EpochTable, redis: Redis) -> None:
    await _published(table, redis)
    await redis.set(LOCK, "token", px=60_000)


async def _empty(table: EpochTable, redis: Redis) -> None:
    return None


async def _gated(table: EpochTable, redis: Redis) -> None:
    await _rolling_out(table, redis)
    await redis.hset(GATE, mapping={"holder": "gw-a", "until_ms": now() + 3_000, "round_ms": now()})
    await redis.hset(COUNTS, mapping={"candidate:requests": 4, "candidate:errors": 1})


SETUPS = {"published": _published, "rolling out": _rolling_out, "leased": _leased, "locked": _locked,
          "empty": _empty, "gated": _gated}  # fmt: skip


def _wrong_type(key: str) -> Plant:
    async def plant(redis: Redis) -> None:
        await redis.delete(key)
        if KINDS[key] == "string":
            await redis.rpush(key, "odd")
        else:
            await redis.set(key, "odd")

    return plant


def _hset(key: str, field: str, value: str) -> Plant:
    async def plant(redis: Redis) -> object:
        return await redis.hset(key, field, value)

    return plant


async def _log_at_its_last_id(redis: Redis) -> None:
    await redis.xadd(keys.LOG, {"x": "y"}, id=LAST_ID)


async def _drift_over_a_full_log(redis: Redis) -> None:
    await _log_at_its_last_id(redis)
    await redis.hset(keys.state(ID), "epoch", "7")  # a write that bypassed the scripts: the scrub's drift


async def _no_candidate_name(redis: Redis) -> None:
    await redis.hdel(keys.state(ID), "cand_name")


LOGGED_PLANTS: dict[str, Plant] = {
    "log at its last id": _log_at_its_last_id,
    "check sum junk": _hset(keys.CHECK, "sum", "junk"),
    "check sum at int64's max": _hset(keys.CHECK, "sum", "9223372036854775807"),
    "check sum a float": _hset(keys.CHECK, "sum", "1.5"),
}
EPOCH_PLANTS: dict[str, Plant] = {
    "epoch junk": _hset(keys.state(ID), "epoch", "junk"),
    "epoch at int64's max": _hset(keys.state(ID), "epoch", "9223372036854775807"),
}
EXTRA: dict[str, dict[str, Plant]] = {
    "publish_version": {**LOGGED_PLANTS, **EPOCH_PLANTS},
    "bump_epoch": {**LOGGED_PLANTS, **EPOCH_PLANTS},
    "rollback_version": {
        **LOGGED_PLANTS,
        **EPOCH_PLANTS,
        "version record not JSON": _hset(keys.versions(ID), keys.version_field(BASE, D1), "{not json"),
        "version record without name": _hset(
            keys.versions(ID), keys.version_field(BASE, D1), '{"path": "p"}'
        ),
    },
    "reseed_version": LOGGED_PLANTS,
    "rollout_version": LOGGED_PLANTS,
    "promote_candidate": {**LOGGED_PLANTS, **EPOCH_PLANTS, "candidate without its name": _no_candidate_name},
    "abort_rollout": LOGGED_PLANTS,
    "add_rollout_counts": {
        "a count junk": _hset(COUNTS, "candidate:errors", "junk"),
        "a count a float": _hset(COUNTS, "candidate:requests", "1.5"),
        "a count past 2^53": _hset(COUNTS, "candidate:requests", "9007199254740993"),
    },
    "heartbeat": {
        **{what: plant for what, plant in LOGGED_PLANTS.items() if plant is not _log_at_its_last_id},
        "log at its last id, a drift to log": _drift_over_a_full_log,
        "scrub cursor junk": _hset(keys.CHECK, "scrub_cursor", "junk"),
        "scrub rounds junk": _hset(keys.CHECK, "scrub_rounds", "junk"),
    },
}
HEARTBEAT_READS: dict[str, Plant] = {  # only read by the heartbeat: it goes on, kvgate reads them
    "log at its last id, no drift": _log_at_its_last_id,
    "last junk": _hset(keys.CHECK, "last", "junk"),
}


def _cases() -> list[tuple[str, str, Plant]]:
    cases = []
    for script, call in CALLS.items():
        for key in dict.fromkeys(call.keys):
            cases.append((script, f"{key} of another type", _wrong_type(key)))
        for what, plant in EXTRA.get(script, {}).items():
            cases.append((script, what, plant))
    return cases


CASES = _cases()


async def everything(redis: Redis) -> dict[Any, tuple[Any, Any]]:
    """Every key's type and DUMP (its value, whatever its type)."""
    return {key: (await redis.type(key), await redis.dump(key)) async for key in redis.scan_iter(count=1_000)}


def test_every_script_has_a_call() -> None:
    assert set(CALLS) == set(operation_names())


@pytest.mark.parametrize("script", sorted(CALLS))
async def test_each_call_goes_through_when_redis_holds_what_the_scripts_write(
    table: EpochTable, redis: Redis, script: str
) -> None:
    """The control: unplanted, each call runs (and every writing script writes), so a refusal below is
    the planted value's."""
    call = CALLS[script]
    await SETUPS[call.setup](table, redis)
    before = await everything(redis)
    await table.scripts.run(call.script, call.keys, call.args)
    if script != "read_page":
        assert await everything(redis) != before, f"{script} wrote nothing: its call does not reach a write"


@pytest.mark.parametrize(("script", "what", "plant"), CASES, ids=[f"{s}: {w}" for s, w, _ in CASES])
async def test_a_refused_call_changes_no_key(
    table: EpochTable, redis: Redis, script: str, what: str, plant: Plant
) -> None:
    call = CALLS[script]
    await SETUPS[call.setup](table, redis)
    await plant(redis)
    before = await everything(redis)
    with pytest.raises(Exception) as caught:  # noqa: PT011 - the old scripts raised what Redis said
        await table.scripts.run(call.script, call.keys, call.args)
    assert await everything(redis) == before, f"{script} refused ({caught.value}) after writing"
    assert isinstance(caught.value, ScriptRefused), f"{script}: {caught.value!r}"
    assert caught.value.status == 500


@pytest.mark.parametrize("what", sorted(HEARTBEAT_READS))
async def test_a_heartbeat_goes_on_over_what_it_only_reads(
    table: EpochTable, redis: Redis, what: str
) -> None:
    """Refusing these would make every kvgate unready over a value no heartbeat writes: it scrubs on."""
    call = CALLS["heartbeat"]
    await SETUPS[call.setup](table, redis)
    await HEARTBEAT_READS[what](redis)
    rounds = int(await redis.hget(keys.CHECK, "scrub_rounds") or 0)
    await table.scripts.run(call.script, call.keys, call.args)
    assert int(await redis.hget(keys.CHECK, "scrub_rounds") or 0) == rounds + 1


def test_a_publish_over_a_log_at_its_last_id_changes_nothing_and_says_why_in_one_line(
    make_adapter: MakeAdapter, tmp_path: Path
) -> None:
    """The probe of issue 26: ``XADD kvg:{epochs}:log <last id> x y``, then ``kvgate publish`` of v3."""
    data = tmp_path / "kvgate"
    for weights in (b"v1", b"v2"):
        assert kvgate("publish", ID, str(make_adapter(weights)), data_dir=data).returncode == 0
    with EmbeddedRedis(data) as server:
        client = SyncRedis.from_url(server.url)
        client.xadd(keys.LOG, {"x": "y"}, id=LAST_ID)
        before = {key: (client.type(key), client.dump(key)) for key in client.scan_iter()}
        done = kvgate("publish", ID, str(make_adapter(b"v3")), data_dir=data)
        after = {key: (client.type(key), client.dump(key)) for key in client.scan_iter()}
        client.close()
    assert done.returncode == 1, done.stderr
    assert after == before, "the refused publish wrote"
    lines = [line for line in done.stderr.splitlines() if " INFO " not in line]
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("kvgate publish: refused, nothing written"), lines[0]
    assert f"{keys.LOG} is at {LAST_ID}" in lines[0]
