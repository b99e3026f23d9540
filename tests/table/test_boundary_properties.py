"""Property tests of every reader at kvgate's boundary (hypothesis): whatever a replica answers and whatever
Redis holds, each reader returns a well-formed value or raises its one malformed-input error
(``MalformedAnswer`` for a replica's answer, ``MalformedRow`` for a row in Redis), never anything else.

Replica answers: arbitrary bytes, JSON of any shape, nesting 200,000 deep, to the readers of the model list,
the ``/metrics`` start time, the fingerprint probe and a refusal's reason (fleet/backends/answers.py, the
SGLang answer). Redis: arbitrary bytes in change-log entry fields, state rows, API-key rows and lease values,
read by the real parsers and, for state rows, keys and leases, through the real scripts and reads on the
session's redis-server. Derandomized, no example database (as tests/core/test_properties.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import tempfile
from collections.abc import Iterator
from typing import Any

os.environ.setdefault(
    "HYPOTHESIS_STORAGE_DIRECTORY", os.path.join(tempfile.gettempdir(), "kvgate-hypothesis")
)

import pytest
import redis as sync_redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis.asyncio import Redis

from gateway.core.errors import MalformedAnswer, MalformedRow
from gateway.core.model import VersionState
from gateway.fleet.backends import answers, sglang
from gateway.table import keys
from gateway.table.callers import Caller, CallerTable, parse_row
from gateway.table.changelog import _entry
from gateway.table.epoch_table import EpochTable
from gateway.table.redis_server import EmbeddedRedis
from gateway.table.rows import parse_state
from gateway.table.scripts import assemble_script

QUICK = settings(
    max_examples=100,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
ON_REDIS = settings(QUICK, max_examples=40)

scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=12))
any_json = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)
deep = st.builds(lambda depth: b"[" * depth + b"]" * depth, st.integers(1, 200_000)) | st.builds(
    lambda depth: b'{"data": ' + b'{"a":' * depth + b"1" + b"}" * depth + b"}", st.integers(1, 200_000)
)
model_entry = st.fixed_dictionaries(
    {},
    optional={
        "id": any_json | st.text(max_size=8),
        "root": any_json,
        "parent": any_json,
        "max_model_len": any_json,
    },
)
listing_like = st.fixed_dictionaries(
    {}, optional={"object": any_json, "data": st.lists(model_entry, max_size=4)}
)
probe_like = st.fixed_dictionaries(
    {},
    optional={
        "choices": st.lists(
            st.fixed_dictionaries(
                {},
                optional={
                    "text": any_json,
                    "index": st.integers(-1, 2) | any_json,
                    "logprobs": st.fixed_dictionaries(
                        {},
                        optional={
                            "token_logprobs": st.lists(scalars, max_size=4) | any_json,
                            "top_logprobs": st.lists(
                                st.dictionaries(st.text(max_size=3), scalars, max_size=3) | any_json,
                                max_size=2,
                            )
                            | any_json,
                        },
                    ),
                },
            )
            | any_json,
            max_size=2,
        )
        | any_json,
    },
)
raw_bytes = st.binary(max_size=64)


def bodies(shaped: st.SearchStrategy[Any]) -> st.SearchStrategy[bytes]:
    """What a replica can send: random bytes, deep nesting, JSON of any shape, JSON of roughly the right
    shape with wrong types inside (NaN and Infinity included, as Python's json writes them)."""
    import json

    return st.one_of(raw_bytes, deep, (any_json | shaped).map(lambda doc: json.dumps(doc).encode()))


@QUICK
@given(bodies(listing_like))
def test_the_model_list_reader(body: bytes) -> None:
    try:
        listing = answers.model_list(answers.json_of(body))
    except MalformedAnswer:
        return
    assert listing.base_name is None or isinstance(listing.base_name, str)
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in listing.adapters.items())
    assert listing.max_model_len is None or (type(listing.max_model_len) is int and listing.max_model_len > 0)


@QUICK
@given(bodies(probe_like))
def test_the_probe_answer_reader(body: bytes) -> None:
    try:
        tops = answers.probe_tops(answers.json_of(body), 2, 2)
    except MalformedAnswer:
        return
    assert len(tops) == 2
    for top in tops:
        assert len(top) == 2
        assert all(isinstance(token, str) and type(x) is float and math.isfinite(x) for token, x in top)
        assert top[0][1] >= top[1][1]


metric_values = st.one_of(
    st.text(max_size=12).map(str.encode),
    raw_bytes,
    st.floats().map(lambda f: repr(f).encode()),
    st.sampled_from([b"NaN", b"+Inf", b"-Inf", b"1.7e9", b"0x10", b"1_000", b"", b"1e999"]),
)


@QUICK
@given(raw_bytes, metric_values, st.sampled_from([b"", b'{pid="1"}']), raw_bytes)
def test_the_metrics_start_time_reader(before: bytes, value: bytes, labels: bytes, after: bytes) -> None:
    body = before + b"\nprocess_start_time_seconds" + labels + b" " + value + b"\n" + after
    try:
        started = answers.start_time(body)
    except MalformedAnswer:
        return
    assert started is None or (type(started) is float and math.isfinite(started))


@QUICK
@given(bodies(any_json), st.integers(100, 599))
def test_a_refusals_reason_is_always_text(body: bytes, status: int) -> None:
    reason = answers.reason_of(body, status)
    assert isinstance(reason, str)
    assert reason


@QUICK
@given(
    bodies(
        st.fixed_dictionaries(
            {}, optional={"success": any_json, "error_message": any_json, "loaded_adapters": any_json}
        )
    )
)
def test_the_sglang_load_and_unload_answer_readers(body: bytes) -> None:
    try:
        data = answers.json_of(body)
    except MalformedAnswer:
        return
    if isinstance(data, dict):
        assert isinstance(sglang._reason(data), str)
        loaded = sglang._loaded_adapters(data)
        assert loaded is None or all(isinstance(k, str) and isinstance(v, str) for k, v in loaded.items())


STATE_FIELDS = [b"digest", b"name", b"path", b"base", b"epoch", b"base_print"]
field_values = st.one_of(raw_bytes, st.sampled_from([b"NaN", b"-1", b"1", b"007", b"1e3", b"", b"\xff"]))
state_rows = st.dictionaries(st.sampled_from(STATE_FIELDS) | raw_bytes, field_values, max_size=8)


def check_state(state: VersionState | None) -> None:
    if state is None:
        return
    assert all(
        isinstance(v, str) for v in (state.digest, state.name, state.path, state.base, state.base_print)
    )
    assert type(state.epoch) is int
    assert state.epoch >= 0


@QUICK
@given(st.text(max_size=8), state_rows)
def test_the_state_row_parser(logical_id: str, raw: dict[bytes, bytes]) -> None:
    with contextlib.suppress(MalformedRow):
        check_state(parse_state(logical_id, raw))


@QUICK
@given(
    st.dictionaries(st.sampled_from([b"id", b"action", *STATE_FIELDS]) | raw_bytes, field_values, max_size=9)
)
def test_the_change_log_entry_reader_never_raises(raw: dict[bytes, bytes]) -> None:
    entry = _entry("1-0", raw)
    if entry.malformed:
        assert entry.state is None
        return
    assert isinstance(entry.logical_id, str)
    assert isinstance(entry.action, str)
    check_state(entry.state)


caller_docs = st.fixed_dictionaries(
    {},
    optional={
        "hash": st.sampled_from(["a" * 64, "A" * 64, "a" * 63]) | any_json,
        "tenant": any_json,
        "ids": any_json,
        "base": any_json,
        "created_ms": any_json,
    },
)


def check_caller(digest: str, caller: Caller) -> None:
    assert isinstance(digest, str)
    assert digest.startswith(caller.key_id)
    assert isinstance(caller.tenant, str)
    assert all(isinstance(i, str) for i in caller.ids)
    assert type(caller.base) is bool
    assert type(caller.created_ms) is int


@QUICK
@given(st.sampled_from([b"aaaaaaaaaaaa", b"\xff\xfe", b"x"]), bodies(caller_docs))
def test_the_api_key_row_parser(key_id: bytes, raw: bytes) -> None:
    with contextlib.suppress(MalformedRow):
        check_caller(*parse_row(key_id, raw))


@pytest.fixture(scope="module")
def client(redis_server: EmbeddedRedis) -> Iterator[sync_redis.Redis]:
    connection = sync_redis.Redis.from_url(redis_server.url)
    try:
        yield connection
    finally:
        connection.close()


lease_values = st.one_of(
    raw_bytes, st.sampled_from([b"NaN", b"inf", b"-5", b"0x10", b"1e400", b" 1", b"9" * 30])
)


@ON_REDIS
@given(lease_values, lease_values, lease_values)
def test_every_lease_script_reads_a_malformed_lease_value_as_expired(
    client: sync_redis.Redis, mine: bytes, other: bytes, mark: bytes
) -> None:
    client.flushdb()
    replica, name = "http://r", "t@1"
    lease_key, last_use = keys.leases(replica), keys.last_use(replica)
    client.hset(lease_key, mapping={f"{name}|gw-a": mine, f"{name}|gw-b": other, f"{name}|!unloading": mark})
    client.hset(last_use, name, other)
    now = 1_000_000

    def run(script: str, keys_: list[str], args: list[Any]) -> Any:
        return client.eval(assemble_script(script), len(keys_), *keys_, *args)

    run("refresh_leases", [lease_key, last_use], ["gw-a", now, 1000, now + 1, 1, name, now, 0])
    run("begin_unload", [lease_key], [name, now, 1000, 0, "gw-a"])
    run("acquire_lease", [lease_key], [name, "gw-b", now, 1000])
    run("end_unload", [lease_key, last_use], [name, 1])


@ON_REDIS
@given(state_rows, st.text(max_size=6) | st.sampled_from(["\udcff"]))
def test_a_full_read_over_any_state_row(
    redis_server: EmbeddedRedis, client: sync_redis.Redis, raw: dict[bytes, bytes], odd_id: str
) -> None:
    client.flushdb()
    good = {b"digest": b"d" * 64, b"name": b"n", b"path": b"p", b"base": b"b", b"epoch": b"3"}
    client.hset(keys.state("good"), mapping=good)  # type: ignore[arg-type]
    odd = odd_id.encode(errors="surrogateescape")
    if raw:
        client.hset(keys.STATE_PREFIX.encode() + odd, mapping=raw)  # type: ignore[arg-type]
    client.sadd(keys.IDS, b"good", odd)

    async def read() -> None:
        connection = Redis.from_url(redis_server.url)
        try:
            view = await EpochTable(connection).read_all()
        finally:
            await connection.aclose()
        assert view.states["good"].epoch == 3 or odd == b"good"
        for state in view.states.values():
            check_state(state)
        assert set(view.states).isdisjoint(view.malformed)

    asyncio.run(read())


@ON_REDIS
@given(st.dictionaries(raw_bytes, bodies(caller_docs), max_size=4))
def test_a_key_table_read_over_any_rows(
    redis_server: EmbeddedRedis, client: sync_redis.Redis, rows: dict[bytes, bytes]
) -> None:
    client.flushdb()
    if rows:
        client.hset(keys.CALLERS, mapping=rows)  # type: ignore[arg-type]

    async def read() -> None:
        connection = Redis.from_url(redis_server.url)
        try:
            found = await CallerTable(connection).read()
        finally:
            await connection.aclose()
        for digest, caller in found.by_hash.items():
            check_caller(digest, caller)

    asyncio.run(read())
