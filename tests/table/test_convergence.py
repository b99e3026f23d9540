"""Every running kvgate serves what Redis's table names, whatever wrote it, or /healthz says it cannot.

Real redis-server (the session's), a stub replica, two real running kvgates (``build_app``). The table and
their snapshots are parted in each way a tool or an accident can part them: a change refused half way
(its state written, its change-log entry refused: the issue's probe with an entry at the stream's
largest id), a follower position beyond the end of a deleted log, a Redis restored from an older copy (a
rewound log), a direct write to a state row (also with its 'drift' entry refused), a check whose
``last`` is junk. Each time every kvgate serves what the table names within ``BOUND`` (docs/redis.md: one
heartbeat and a full read, plus the follower's longest block for a change made just after a rewind) with
``/healthz`` 200 and its sync never restarted. A check whose sum is junk, or a heartbeat Redis refuses
(the check's rows overwritten with a string), leaves nothing to compare: ``/healthz`` answers 503 naming
it, and 200 once repaired.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from redis.asyncio import Redis
from redis.exceptions import ResponseError

from gateway.adapters.publish import Published, publish_adapter
from gateway.adapters.store import AdapterStore
from gateway.app.keys import METRICS, SUPERVISOR
from gateway.app.wiring import build_app
from gateway.core.errors import KvgateError
from gateway.core.wire import VERSION_HEADER
from gateway.process.http_edge import running
from gateway.settings.model import Settings
from gateway.table import keys
from gateway.table.changelog import START, Ends
from gateway.table.epoch_table import EpochTable
from gateway.table.snapshot import BLOCK_S
from tests.support.adapter_files import MakeAdapter
from tests.support.conditions import eventually
from tests.support.stub_backend import StubState, build_stub

INTERVAL = 0.1  # reconcile_interval
LIMIT = 5.0  # background_failure_limit (periods)
BOUND = INTERVAL + BLOCK_S + 3.0  # the documented bound, and 3 s for a full read on a loaded CI machine
MAX_ID = "18446744073709551615-18446744073709551615"  # the stream's largest id: no XADD * after it


class Fleet:
    """Two kvgates on one table, and what it takes to ask them."""

    def __init__(self, redis: Redis, store: AdapterStore, make_adapter: MakeAdapter) -> None:
        self.redis, self.store, self.make_adapter = redis, store, make_adapter
        self.table = EpochTable(redis)
        self.apps: list[web.Application] = []
        self.urls: list[str] = []
        self.http: aiohttp.ClientSession

    async def publish(self, weights: bytes) -> Published:
        return await publish_adapter(self.table, self.store, "tenant-42", self.make_adapter(weights), "base")

    async def named(self) -> str:
        state = await self.table.read_state("tenant-42")
        assert state is not None
        return state.name

    async def served(self, url: str) -> tuple[int, str | None]:
        body = {"model": "tenant-42", "prompt": "p", "max_tokens": 1}
        async with self.http.post(f"{url}/v1/completions", json=body) as response:
            return response.status, response.headers.get(VERSION_HEADER)

    async def converged(self, name: str) -> bool:
        """The table names NAME, and every kvgate serves it."""
        served = [await self.served(url) for url in self.urls]
        return await self.named() == name and all(answer == (200, name) for answer in served)

    async def health(self, url: str) -> tuple[int, dict[str, Any]]:
        """/healthz's detail view (the admin token): the reasons, not only the failing tasks' names."""
        headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        async with self.http.get(f"{url}/healthz", headers=headers) as response:
            doc: dict[str, Any] = await response.json()
            return response.status, doc

    async def healthy(self) -> None:
        """Each /healthz 200 with nothing failing, and no kvgate's snapshot sync ever restarted."""
        for url, app in zip(self.urls, self.apps, strict=True):
            status, doc = await self.health(url)
            assert (status, doc["failing"]) == (200, []), doc
            assert app[SUPERVISOR].tasks["snapshot-sync"].restarts == 0, doc["background"]["snapshot-sync"]

    async def applied_malformed_entries(self, count: int) -> bool:
        line = f'kvgate_malformed_rows_total{{kind="change_log"}} {float(count)}'
        return all(line in app[METRICS].exposition().decode() for app in self.apps)


ADMIN_TOKEN = "convergence-admin-token"


@contextlib.asynccontextmanager
async def fleet(redis: Redis, tmp_path: Path, make_adapter: MakeAdapter) -> AsyncIterator[Fleet]:
    """Two running kvgates serving tenant-42 at v2 (v1 before it)."""
    kvgates = Fleet(redis, AdapterStore(tmp_path / "store"), make_adapter)
    await kvgates.publish(b"v1")
    v2 = await kvgates.publish(b"v2")
    async with running(build_stub(StubState())) as stub_url, contextlib.AsyncExitStack() as stack:
        settings = Settings(replicas=[stub_url], store=kvgates.store.root, reconcile_interval=INTERVAL,
                            poll_interval=0.1, background_failure_limit=LIMIT,
                            admin_token=ADMIN_TOKEN)  # fmt: skip
        for _ in range(2):
            app = build_app(settings, redis)
            kvgates.urls.append(await stack.enter_async_context(running(app)))
            kvgates.apps.append(app)
        kvgates.http = await stack.enter_async_context(aiohttp.ClientSession())
        await eventually(lambda: kvgates.converged(v2.name), "both kvgates serve v2")
        yield kvgates


async def test_a_change_refused_half_way_reaches_every_running_kvgate(
    redis: Redis, tmp_path: Path, make_adapter: MakeAdapter
) -> None:
    """The issue's probe: with an entry at the stream's largest id (any tool can write it), a publish's
    XADD is refused after its state was written; the running kvgates served v2 for good while Redis
    named v3 (their position was past the check's ``last``, so the checksum was never compared)."""
    async with fleet(redis, tmp_path, make_adapter) as kvgates:
        await redis.xadd(keys.LOG, {"x": "y"}, id=MAX_ID)
        await eventually(lambda: kvgates.applied_malformed_entries(1), "both followers skipped the odd entry")
        with contextlib.suppress(ResponseError, KvgateError):  # refused, half way or whole
            await kvgates.publish(b"v3")
        named = await kvgates.named()
        await eventually(lambda: kvgates.converged(named), f"both kvgates serve {named}, as Redis", BOUND)
        await kvgates.healthy()


async def test_a_follower_past_the_end_of_a_deleted_log_follows_the_new_one(
    redis: Redis, tmp_path: Path, make_adapter: MakeAdapter
) -> None:
    """A follower whose position is the largest id, then the log deleted: every new entry's id is lower,
    so a read from the old position never returned one (the issue: the split survived a DEL of the log and
    a later successful publish)."""
    async with fleet(redis, tmp_path, make_adapter) as kvgates:
        await redis.xadd(keys.LOG, {"x": "y"}, id=MAX_ID)
        await eventually(lambda: kvgates.applied_malformed_entries(1), "both followers skipped the odd entry")
        await redis.delete(keys.LOG)
        v3 = await kvgates.publish(b"v3")
        await eventually(lambda: kvgates.converged(v3.name), "both kvgates serve v3", BOUND)
        v4 = await kvgates.publish(b"v4")
        await eventually(lambda: kvgates.converged(v4.name), "and follow the new log", BOUND)
        await kvgates.healthy()


async def test_a_redis_restored_from_an_older_copy_reaches_every_running_kvgate(
    redis: Redis, tmp_path: Path, make_adapter: MakeAdapter
) -> None:
    """The table's keys put back as they were at v2 (what a restore of an older RDB or AOF does to them):
    the log's newest id is before the kvgates' position, the check agrees with the restored rows (no
    drift for the scrub), so only the rewind itself tells them."""
    async with fleet(redis, tmp_path, make_adapter) as kvgates:
        table_keys = [key async for key in redis.scan_iter(match=f"{keys.TABLE}:*")]
        saved = {key: dumped for key in table_keys if (dumped := await redis.dump(key)) is not None}
        v2 = await kvgates.named()
        v3 = await kvgates.publish(b"v3")
        await eventually(lambda: kvgates.converged(v3.name), "both kvgates serve v3")
        async with redis.pipeline(transaction=True) as restore:
            restore.delete(*[key async for key in redis.scan_iter(match=f"{keys.TABLE}:*")])
            for key, dumped in saved.items():
                restore.restore(key, 0, dumped, replace=True)
            await restore.execute()
        assert await kvgates.named() == v2
        await eventually(lambda: kvgates.converged(v2), "both kvgates serve v2 again, as Redis", BOUND)
        await kvgates.healthy()


async def test_a_direct_write_to_a_state_row_reaches_every_running_kvgate(
    redis: Redis, tmp_path: Path, make_adapter: MakeAdapter
) -> None:
    """A rollback to v1 by hand (HSET on the row, no script): the scrub logs it as drift."""
    async with fleet(redis, tmp_path, make_adapter) as kvgates:
        name = await rollback_by_hand(kvgates)
        await eventually(lambda: kvgates.converged(name), "both kvgates serve v1, as Redis", BOUND)
        await kvgates.healthy()


async def rollback_by_hand(kvgates: Fleet) -> str:
    """tenant-42's row set back to v1 with HSET, past every script; v1's versioned name."""
    v2 = await kvgates.table.read_state("tenant-42")
    assert v2 is not None
    digest = (await kvgates.table.read_history("tenant-42"))[-1]["digest"]
    name = f"tenant-42@{digest[:16]}"
    stored = {"digest": digest, "name": name, "path": str(kvgates.store.root / digest), "epoch": v2.epoch + 1}
    await kvgates.redis.hset(keys.state("tenant-42"), mapping=stored)  # type: ignore[arg-type]
    return name


async def test_a_direct_write_whose_drift_entry_the_log_refuses_reaches_every_running_kvgate(
    redis: Redis, tmp_path: Path, make_adapter: MakeAdapter
) -> None:
    """The same rollback by hand with an entry at the stream's largest id: the scrub's 'drift' entry is
    refused, so the log cannot carry it. Every kvgate serves it anyway (the scrub's rows and sum moved
    before its refused XADD), or, where the heartbeat stays refused, /healthz says so."""
    async with fleet(redis, tmp_path, make_adapter) as kvgates:
        await redis.xadd(keys.LOG, {"x": "y"}, id=MAX_ID)
        await eventually(lambda: kvgates.applied_malformed_entries(1), "both followers skipped the odd entry")
        name = await rollback_by_hand(kvgates)

        async def served_or_says_why() -> bool:
            if await kvgates.converged(name):
                return True
            docs = [(await kvgates.health(url))[1] for url in kvgates.urls]
            return all("Redis refuses the table's heartbeat" in " ".join(doc["failing"]) for doc in docs)

        await eventually(served_or_says_why, "both kvgates serve v1 as Redis, or say why not", BOUND)


async def test_a_heartbeat_redis_refuses_makes_healthz_503_naming_it(
    redis: Redis, tmp_path: Path, make_adapter: MakeAdapter
) -> None:
    """The check's rows overwritten with a string: every heartbeat (its scrub) is refused, so no snapshot
    can be checked; a refusal that is not Redis refusing every write is no pause to wait out."""
    async with fleet(redis, tmp_path, make_adapter) as kvgates:
        rows = await redis.dump(keys.ROWS)
        assert rows is not None
        await redis.set(keys.ROWS, "junk")

        async def unready() -> bool:
            docs = [await kvgates.health(url) for url in kvgates.urls]
            return all(status == 503 and len(doc["failing"]) == 1 for status, doc in docs)

        await eventually(unready, "every /healthz answers 503", within=LIMIT * INTERVAL + 3.0)
        for url in kvgates.urls:
            (reason,) = (await kvgates.health(url))[1]["failing"]
            assert reason.startswith("background task snapshot-sync has been failing for "), reason
            assert (
                "EpochTableError: Redis refuses the table's heartbeat, so this snapshot cannot be" in reason
            )
            assert f"{keys.ROWS} is a string, not a hash" in reason  # the script's refusal, nothing written
        await redis.restore(keys.ROWS, 0, rows, replace=True)

        async def ready() -> bool:
            return all([(await kvgates.health(url))[0] == 200 for url in kvgates.urls])

        await eventually(ready, "every /healthz answers 200 again", within=15)


async def test_a_check_whose_last_is_junk_stops_no_sync(
    redis: Redis, tmp_path: Path, make_adapter: MakeAdapter
) -> None:
    """The issue's probe: with the check's ``last`` set to junk, the sync restarted 288 times in 20 s."""
    async with fleet(redis, tmp_path, make_adapter) as kvgates:
        await redis.hset(keys.CHECK, "last", "junk")
        rounds = int(await redis.hget(keys.CHECK, "scrub_rounds") or 0)

        async def beaten() -> bool:
            return int(await redis.hget(keys.CHECK, "scrub_rounds") or 0) >= rounds + 5

        await eventually(beaten, "five more heartbeats")
        await kvgates.healthy()
        v3 = await kvgates.publish(b"v3")
        await eventually(lambda: kvgates.converged(v3.name), "both kvgates serve v3", BOUND)
        await kvgates.healthy()


async def test_a_check_whose_sum_is_junk_makes_healthz_503_naming_it(
    redis: Redis, tmp_path: Path, make_adapter: MakeAdapter, caplog: pytest.LogCaptureFixture
) -> None:
    """No snapshot can be checked against the table: every kvgate says so, within the failure limit, in one
    logged traceback per kvgate (not one per try), and is ready again once the check is repaired."""
    caplog.set_level(logging.INFO, logger="gateway.tasks.supervisor")
    async with fleet(redis, tmp_path, make_adapter) as kvgates:
        total = await redis.hget(keys.CHECK, "sum")
        await redis.hset(keys.CHECK, "sum", "junk")

        async def unready() -> bool:
            return all([(await kvgates.health(url))[0] == 503 for url in kvgates.urls])

        await eventually(unready, "every /healthz answers 503", within=LIMIT * INTERVAL + 3.0)
        for url in kvgates.urls:
            (reason,) = (await kvgates.health(url))[1]["failing"]
            assert reason.startswith("background task snapshot-sync has been failing for "), reason
            assert f'{keys.CHECK} field sum is "junk", not a whole number' in reason
        tracebacks = [r for r in caplog.records if r.exc_info and "snapshot-sync" in r.getMessage()]
        assert len(tracebacks) == 2, [r.getMessage() for r in tracebacks]  # one burst per kvgate
        assert total is not None
        await redis.hset(keys.CHECK, "sum", total)

        async def ready() -> bool:
            return all([(await kvgates.health(url))[0] == 200 for url in kvgates.urls])

        await eventually(ready, "every /healthz answers 200 again", within=15)


@pytest.mark.parametrize(
    ("ends", "position", "parted"),
    [
        (Ends("5-0", "1-0", "5-0"), "5-0", ""),  # current
        (Ends("5-0", "1-0", "5-0"), "3-0", ""),  # behind, the entries after it held
        (Ends("5-0", "1-0", "5-0"), "7-0", "rewound"),  # restored from an older copy, recreated lower
        (Ends(START, None, None), "7-0", "rewound"),  # the log deleted
        (Ends("9-0", "8-0", "9-0"), "5-0", "trimmed"),  # trimmed past the position
        (Ends("9-0", "1-0", "5-0"), "5-0", "trimmed"),  # the entries after it deleted (XDEL)
        (Ends("9-0", None, None), START, "trimmed"),  # every entry given after a full read at START gone
        (Ends("9-0", "8-0", "9-0"), START, ""),  # from the START: the follower reads them (trimmed_past)
    ],
)
def test_the_ways_a_position_parts_from_the_log(ends: Ends, position: str, parted: str) -> None:
    """What each heartbeat checks the snapshot's position against: the cases no running follower can be
    held in long enough to probe (it reads an entry within milliseconds of its XADD)."""
    assert ends.parted(position) == parted
