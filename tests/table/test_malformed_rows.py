"""What Redis holds that kvgate's scripts did not write is that row's problem, never the reader's.

Each case writes straight to Redis as a person with ``redis-cli`` (or a bug elsewhere) would (issue 17): a
change-log entry without an ``id``, an epoch ``NaN``, a lease expiry ``x``, a state hash with bytes that
are not UTF-8. The real scripts and the real follower run on the session's redis-server.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import aiohttp
import pytest
from redis.asyncio import Redis

from gateway.app.wiring import build_app
from gateway.process.http_edge import running
from gateway.settings.model import Settings
from gateway.table import keys
from gateway.table.epoch_table import EpochTable
from gateway.table.leases import LeaseTable
from gateway.table.snapshot import Snapshot, SnapshotSync
from gateway.telemetry.metrics import Metrics
from tests.support.conditions import eventually
from tests.support.stub_backend import StubState, build_stub
from tests.table.test_changelog import following, publish
from tests.table.test_epoch_table import D1, D2, D3

ADMIN = "test-admin-token"
BAD_ENTRIES = {
    "no id": {"action": "publish", "digest": D3, "epoch": "9"},
    "no action": {"id": "tenant-42"},
    "epoch NaN": {
        "id": "tenant-42",
        "action": "publish",
        "digest": D3,
        "name": "n",
        "path": "p",
        "base": "base",
        "epoch": "NaN",
    },
    "no name": {"id": "tenant-42", "action": "publish", "digest": D3, "epoch": "9", "path": "p", "base": "b"},
    "id not utf-8": {"id": b"\xff\xfe", "action": "publish"},
    "name not utf-8": {
        "id": "tenant-42",
        "action": "publish",
        "digest": D3,
        "name": b"\xc3\x28",
        "path": "p",
        "base": "base",
        "epoch": "9",
    },
}


def malformed_count(metrics: Metrics, kind: str) -> float:
    value = metrics.registry.get_sample_value("kvgate_malformed_rows_total", {"kind": kind})
    return value or 0.0


@pytest.mark.parametrize("fields", BAD_ENTRIES.values(), ids=BAD_ENTRIES.keys())
async def test_a_malformed_change_log_entry_is_skipped_and_later_publishes_reach_the_kvgate(
    redis: Redis, table: EpochTable, fields: dict[str, str | bytes]
) -> None:
    metrics = Metrics()
    await publish(table, D1)
    async with following(redis, metrics=metrics) as sync:
        assert sync.snapshot.get("tenant-42") is not None
        await redis.xadd(keys.LOG, fields)  # type: ignore[arg-type]
        await publish(table, D2)

        def has(digest: str) -> bool:
            state = sync.snapshot.get("tenant-42")
            return state is not None and state.digest == digest

        await eventually(lambda: has(D2), "the publish after the malformed entry applied", 5)
        assert sync.counts.malformed == 1
        assert malformed_count(metrics, "change_log") == 1.0
        # what a malformed entry should have said is repaired by the scrub: a write past the scripts
        await redis.hset(keys.state("tenant-42"), mapping={"digest": D3, "name": f"tenant-42@{D3[:16]}"})
        await redis.xadd(keys.LOG, {"id": "tenant-42", "action": "publish", "epoch": "NaN", "digest": D3})
        await eventually(lambda: has(D3), "the scrub's drift entry repaired the snapshot", 5)
        # the scrub may repair the snapshot before the malformed entry is read: wait for that read too
        await eventually(lambda: sync.counts.malformed == 2, "the NaN entry read and skipped", 5)


async def test_staleness_grows_while_the_follower_has_not_applied_the_newest_entry(
    redis: Redis, table: EpochTable
) -> None:
    """Heartbeats alone do not make a snapshot current: the stale-table alert must fire when the follower
    cannot move past an entry (it read under 1 s, for good, while the follower retried one entry)."""
    await publish(table, D1)
    sync = SnapshotSync(table, Snapshot(), interval=0.1)
    await sync.reconcile()
    first = time.monotonic()
    await sync.heartbeat()
    assert sync.snapshot.refreshed_at >= first, "current as of the first heartbeat"
    await publish(table, D2)  # a change the follower (not running here) has not applied
    await asyncio.sleep(0.3)
    second = time.monotonic()
    await sync.heartbeat()
    assert sync.snapshot.refreshed_at < second, "not current as of a heartbeat it has not caught up with"
    assert sync.snapshot.staleness() >= 0.3
    sync.log.table = table
    entries = await sync.log.read(sync.snapshot.position, block_ms=100)
    assert entries, "the change it had not applied"
    for entry in entries:
        sync._apply(entry)
    sync._applied()
    assert sync.snapshot.refreshed_at >= second, "current as of the heartbeat whose newest entry it applied"
    third = time.monotonic()
    await sync.heartbeat()
    assert sync.snapshot.refreshed_at >= third


async def test_a_malformed_state_row_is_left_out_of_the_full_read_and_reported(
    redis: Redis, table: EpochTable
) -> None:
    metrics = Metrics()
    for logical_id in ("tenant-a", "tenant-b", "tenant-c"):
        await publish(table, D1, logical_id)
    await redis.hset(keys.state("tenant-b"), "epoch", "NaN")
    await redis.hset(keys.state("tenant-c"), "name", b"\xff\xfe")
    view = await table.read_all()
    assert set(view.states) == {"tenant-a"}
    assert "epoch" in view.malformed["tenant-b"]
    assert "not UTF-8" in view.malformed["tenant-c"]
    held = SnapshotSync(table, Snapshot(), interval=0.1)
    await held.reconcile()
    assert held.snapshot.get("tenant-b") is None, "a row malformed from the start is not served"
    async with following(redis, metrics=metrics) as sync:
        assert sync.snapshot.get("tenant-a") is not None
        assert set(sync.snapshot.malformed) == {"tenant-b", "tenant-c"}
        assert malformed_count(metrics, "state") == 2.0
        await publish(table, D2, "tenant-a")  # the follower and its heartbeat go on
        await eventually(lambda: sync.snapshot.get("tenant-a").epoch == 2, "tenant-a moved on", 5)  # type: ignore[union-attr]


@pytest.mark.parametrize("value", ["x", "", "NaN", "1e400x"])
async def test_a_malformed_lease_value_counts_as_expired_in_every_lease_script(
    table: EpochTable, redis: Redis, value: str
) -> None:
    replica, name = "http://r1", "tenant-42@" + "1" * 16
    mine, other = LeaseTable(table, "gw-a", ttl_ms=10_000), LeaseTable(table, "gw-b", ttl_ms=10_000)
    await redis.hset(keys.leases(replica), mapping={f"{name}|gw-a": value, f"{name}|gw-b": value})
    await redis.hset(keys.last_use(replica), name, value)
    since = mine.now_ms()
    await mine.refresh(replica, {name: since}, set(), since=since + 1)  # was a ResponseError
    assert await redis.hget(keys.leases(replica), f"{name}|gw-a") is None, "its own malformed lease let go"
    assert await mine.shared_last_use(replica, [name]) == {name: since}, "the malformed last use replaced"
    await redis.hset(keys.last_use(replica), "other@1", value)
    assert "other@1" not in await mine.shared_last_use(replica, [name, "other@1"])
    claim = await mine.begin_unload(replica, name, force=False, claim_ms=1_000)
    assert claim.claimed, "another gateway's malformed lease is expired, not live"
    await mine.end_unload(replica, name, unloaded=False)
    await redis.hset(keys.leases(replica), f"{name}|!unloading", value)
    assert await other.acquire(replica, name), "a malformed unload mark is no unload in progress"


async def test_a_malformed_history_event_does_not_stop_a_rollback(redis: Redis, table: EpochTable) -> None:
    await publish(table, D1)
    await publish(table, D2)
    await redis.lpush(keys.history("tenant-42"), "{not json", '"a string"')
    change = await table.rollback("tenant-42", "", "base")
    assert change.digest == D1


async def test_the_kvgate_serves_the_publish_made_after_a_malformed_change_log_entry(
    redis: Redis, table: EpochTable, tmp_path: Path
) -> None:
    """The probe as the tester ran it: a kvgate running, an ``XADD`` without ``id`` to the log, a publish:
    the kvgate's status shows the new version and its metrics count the skipped entry."""
    await publish(table, D1)
    settings = Settings(replicas=[], store=tmp_path / "store", admin_token=ADMIN,
                        reconcile_interval=0.1, poll_interval=0.1)  # fmt: skip
    async with (
        running(build_stub(StubState())) as replica,
        running(build_app(settings.model_copy(update={"replicas": [replica]}), redis)) as url,
        aiohttp.ClientSession(headers={"x-kvgate-admin-token": ADMIN}) as http,
    ):
        await redis.xadd(keys.LOG, {"action": "publish", "epoch": "NaN"})
        await publish(table, D2)

        async def serves_d2() -> bool:
            async with http.get(f"{url}/kvgate/status") as response:
                return bool((await response.json())["versions"]["tenant-42"]["digest"] == D2)

        await eventually(serves_d2, "the kvgate serves the version published after the bad entry", 5)
        async with http.get(f"{url}/metrics") as response:
            assert 'kvgate_malformed_rows_total{kind="change_log"} 1.0' in await response.text()


async def test_an_id_whose_row_turns_malformed_keeps_serving_its_previous_version(
    redis: Redis, table: EpochTable
) -> None:
    await publish(table, D1)
    sync = SnapshotSync(table, Snapshot(), interval=0.1)
    await sync.reconcile()
    await redis.hset(keys.state("tenant-42"), "epoch", "NaN")
    await sync.reconcile("checksum")
    state = sync.snapshot.get("tenant-42")
    assert state is not None
    assert state.digest == D1
    assert "epoch" in sync.snapshot.malformed["tenant-42"]
