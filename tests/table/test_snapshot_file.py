"""The snapshot file, on a real redis-server: a start loads it and catches up from the change log.

A publish and a rollback made while no kvgate ran are in the snapshot after a start from the file, with
no full read; a file of another table (Redis came back empty), one whose position fell off the trimmed
log, and a damaged, truncated, foreign or garbage file each cost one full read and count on the metric;
writers sharing one data dir never leave a partial file for a reader.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import msgpack
import pytest
from redis.asyncio import Redis

from gateway.core.model import Candidate, VersionState
from gateway.table import keys
from gateway.table.epoch_table import EpochTable
from gateway.table.rows import row_hash
from gateway.table.snapshot import Snapshot, SnapshotSync
from gateway.table.snapshot_file import DIGEST_BYTES, FILE_NAME, MAGIC, Rejected, SnapshotFile, decode, encode
from gateway.telemetry.metrics import Metrics
from tests.support.conditions import eventually
from tests.table.test_epoch_table import BASE, D1, D2, D3


def file_count(metrics: Metrics, outcome: str) -> float:
    return metrics.registry.get_sample_value("kvgate_snapshot_file_total", {"outcome": outcome}) or 0.0


@contextlib.asynccontextmanager
async def kvgate(
    table: EpochTable, path: Path, metrics: Metrics, **options: Any
) -> AsyncIterator[SnapshotSync]:
    """One kvgate's snapshot sync with its file at PATH: started (reconcile), running, then stopped."""
    file = SnapshotFile(path, interval=options.pop("file_interval", 0.05), metrics=metrics)
    sync = SnapshotSync(table, Snapshot(), interval=0.1, metrics=metrics, file=file, **options)
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


async def written_at_head(sync: SnapshotSync, redis: Redis) -> None:
    """Until the file holds the snapshot at the log's newest entry."""
    assert sync.file is not None
    head = await sync.log.head()
    await eventually(lambda: sync.file is not None and sync.file.written[1] == head, "the file is written")


async def test_a_start_from_the_file_serves_what_changed_while_no_kvgate_ran(
    redis: Redis, table: EpochTable, tmp_path: Path
) -> None:
    path = tmp_path / FILE_NAME
    for logical_id in ("tenant-42", "tenant-b", "tenant-c"):
        await publish(table, D1, logical_id)
    await publish(table, D2, "tenant-b")
    async with kvgate(table, path, Metrics()) as first:
        await written_at_head(first, redis)
        assert first.file is not None
        assert first.file.outcomes == {"missing": 1, "written": 1}
    await publish(table, D2, "tenant-42")  # while down: a publish,
    await table.rollback("tenant-b", "", BASE)  # a rollback (tenant-b@D2 is revoked)
    await table.bump("tenant-c")  # and a bump
    metrics = Metrics()
    async with kvgate(table, path, metrics) as second:
        assert dict(second.counts.full_reads) == {}, "no full read: the file and the log"
        assert file_count(metrics, "loaded") == 1
        snapshot = second.snapshot
        assert {s.logical_id: s.digest for s in snapshot} == {"tenant-42": D2, "tenant-b": D1, "tenant-c": D1}
        assert f"tenant-b@{D2[:16]}" not in snapshot.current_names(), "the rolled-back version is not served"
        assert {s.logical_id: s for s in snapshot} == (await table.read_all()).states, "as a full read"
        assert not snapshot.flushed, "confirmed current by a heartbeat"
        assert snapshot.staleness() < 5
        assert second.counts.entries == 3, "the three changes came from the log"
        await written_at_head(second, redis)  # it moved: written again
        await publish(table, D3, "tenant-42")  # and it follows the log from there
        await eventually(lambda: _digest(second, "tenant-42") == D3, "the next publish arrives")
        assert dict(second.counts.full_reads) == {}


def _digest(sync: SnapshotSync, logical_id: str) -> str:
    state = sync.snapshot.get(logical_id)
    return state.digest if state is not None else ""


async def test_an_unmoved_snapshot_is_not_written_again(
    redis: Redis, table: EpochTable, tmp_path: Path
) -> None:
    await publish(table, D1)
    async with kvgate(table, tmp_path / FILE_NAME, Metrics()) as sync:
        await written_at_head(sync, redis)
        beats = sync.counts.heartbeats
        await eventually(lambda: sync.counts.heartbeats >= beats + 5, "five heartbeats (many writer rounds)")
        assert sync.file is not None
        assert sync.file.outcomes["written"] == 1


async def test_a_file_of_another_table_costs_a_full_read(
    redis: Redis, table: EpochTable, tmp_path: Path
) -> None:
    path = tmp_path / FILE_NAME
    await publish(table, D1, "tenant-gone")
    async with kvgate(table, path, Metrics()) as first:
        await written_at_head(first, redis)
    await redis.flushdb()  # Redis came back empty: a new generation, the old table's IDs are gone
    await publish(table, D2)
    metrics = Metrics()
    async with kvgate(table, path, metrics) as second:
        assert file_count(metrics, "generation") == 1
        assert file_count(metrics, "loaded") == 0
        assert dict(second.counts.full_reads) == {"start": 1}
        assert {s.logical_id for s in second.snapshot} == {"tenant-42"}, "nothing of the old table"
        assert second.snapshot.generation == await table.ensure_generation()


async def test_a_position_trimmed_off_the_log_costs_a_full_read(redis: Redis, tmp_path: Path) -> None:
    short = EpochTable(redis, log_kept=100)  # XADD MAXLEN ~ 100: whole nodes of 100 entries go at once
    path = tmp_path / FILE_NAME
    await publish(short, D1)
    async with kvgate(short, path, Metrics()) as first:
        await written_at_head(first, redis)
    for _ in range(400):
        await short.bump("tenant-42")
    assert int((await redis.xinfo_stream(keys.LOG))["length"]) < 400, "the log was trimmed"
    metrics = Metrics()
    async with kvgate(short, path, metrics) as second:
        assert file_count(metrics, "trimmed") == 1
        assert file_count(metrics, "loaded") == 0
        assert dict(second.counts.full_reads) == {"start": 1}
        held = second.snapshot.get("tenant-42")
        assert held is not None
        assert held.epoch == 401


def _valid(states: int = 2) -> bytes:
    rows = [
        VersionState(f"tenant-{i}", D1, f"tenant-{i}@{D1[:16]}", f"/store/{D1}", BASE, 1)
        for i in range(states)
    ]
    return encode("g", "1-0", 0, rows, {})


def _with_body(body: Any) -> bytes:
    """BODY as a file with a correct digest (so only what it says can be wrong)."""
    packed: bytes = msgpack.packb(body, use_bin_type=True)
    return MAGIC + hashlib.blake2b(packed, digest_size=DIGEST_BYTES).digest() + packed


def _body() -> dict[str, Any]:
    return msgpack.unpackb(_valid()[len(MAGIC) + DIGEST_BYTES :], raw=False)  # type: ignore[no-any-return]


def _changed(**fields: Any) -> bytes:
    return _with_body({**_body(), **fields})


BAD_FILES: dict[str, tuple[Callable[[], bytes], str]] = {
    "empty": (lambda: b"", "corrupt"),
    "truncated": (lambda: _valid()[: len(_valid()) // 2], "corrupt"),
    "only the magic": (lambda: MAGIC, "corrupt"),
    "one byte flipped": (lambda: _valid()[:-5] + bytes([_valid()[-5] ^ 1]) + _valid()[-4:], "corrupt"),
    "garbage": (lambda: os.urandom(4096), "corrupt"),
    "not msgpack, right digest": (
        lambda: MAGIC + hashlib.blake2b(b"\xc1\xc1", digest_size=DIGEST_BYTES).digest() + b"\xc1\xc1",
        "corrupt",
    ),
    "a list, not a map": (lambda: _with_body([1, 2]), "corrupt"),
    "format 1": (lambda: _changed(format=1), "foreign"),  # before candidates held their split key
    "format 3": (lambda: _changed(format=3), "foreign"),
    "other fields": (lambda: _changed(fields=["logical_id", "digest"]), "foreign"),
    "no generation": (lambda: _changed(generation=""), "corrupt"),
    "epoch as text": (lambda: _changed(columns=[*_body()["columns"][:5], ["1", "1"], ["", ""]]), "corrupt"),
    "short column": (lambda: _changed(columns=[*_body()["columns"][:6], [""]]), "corrupt"),
    "an ID twice": (lambda: _changed(columns=[["a", "a"], *_body()["columns"][1:]]), "corrupt"),
    "malformed not text": (lambda: _changed(malformed={"a": 1}), "corrupt"),
}


@pytest.mark.parametrize(("make", "outcome"), BAD_FILES.values(), ids=BAD_FILES.keys())
async def test_a_bad_file_is_counted_and_costs_a_full_read(
    redis: Redis, table: EpochTable, tmp_path: Path, make: Callable[[], bytes], outcome: str
) -> None:
    await publish(table, D1)
    path = tmp_path / FILE_NAME
    path.write_bytes(make())
    metrics = Metrics()
    async with kvgate(table, path, metrics, file_interval=0) as sync:
        assert file_count(metrics, outcome) == 1
        assert file_count(metrics, "loaded") == 0
        assert dict(sync.counts.full_reads) == {"start": 1}
        assert {s.logical_id for s in sync.snapshot} == {"tenant-42"}
    with pytest.raises(Rejected) as rejected:
        decode(make())
    assert rejected.value.outcome == outcome


async def test_a_good_file_of_this_table_from_someone_else_is_caught_by_the_checksum(
    redis: Redis, table: EpochTable, tmp_path: Path
) -> None:
    """Right generation, right position, rows the table never held: the heartbeat's checksum sets it aside."""
    await publish(table, D1)
    path = tmp_path / FILE_NAME
    wrong = VersionState("tenant-42", D2, f"tenant-42@{D2[:16]}", f"/store/{D2}", BASE, 1)
    generation, head = await table.ensure_generation(), await _head(table)
    path.write_bytes(
        encode(generation, head, row_hash(wrong), [wrong], {})
    )  # a consistent file, not this table's
    metrics = Metrics()
    async with kvgate(table, path, metrics) as sync:
        assert file_count(metrics, "checksum") == 1
        assert dict(sync.counts.full_reads) == {"start": 1}
        assert _digest(sync, "tenant-42") == D1


async def _head(table: EpochTable) -> str:
    last = await table.redis.hget(keys.CHECK, "last")
    assert last is not None
    return last.decode() if isinstance(last, bytes) else str(last)


def test_writers_sharing_a_data_dir_never_leave_a_partial_file(tmp_path: Path) -> None:
    path = tmp_path / FILE_NAME
    files = [SnapshotFile(path, interval=1.0) for _ in range(4)]
    contents = [_valid(states=1_000 * (n + 1)) for n in range(len(files))]  # 4 sizes, 0.2 to 0.8 MB
    stop = threading.Event()
    seen: list[int] = []
    failures: list[str] = []

    def write(file: SnapshotFile, data: bytes) -> None:
        for _ in range(25):
            file.write(data)

    def read() -> None:
        while not stop.is_set():
            with contextlib.suppress(FileNotFoundError):
                data = path.read_bytes()
                try:
                    seen.append(len(decode(data).states))
                except Rejected as exc:
                    failures.append(exc.reason)

    reader = threading.Thread(target=read)
    reader.start()
    writers = [threading.Thread(target=write, args=pair) for pair in zip(files, contents, strict=True)]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join()
    stop.set()
    reader.join()
    assert failures == [], "a reader saw a partial file"
    assert len(seen) > 10
    assert set(seen) <= {1_000, 2_000, 3_000, 4_000}
    assert len(decode(path.read_bytes()).states) in {1_000, 2_000, 3_000, 4_000}
    assert [p.name for p in tmp_path.iterdir()] == [FILE_NAME], "no temporary file left behind"


async def test_a_write_that_fails_is_counted_and_the_sync_runs_on(
    redis: Redis, table: EpochTable, tmp_path: Path
) -> None:
    blocked = tmp_path / "not-a-dir"
    blocked.write_text("a file where the data dir should be")
    metrics = Metrics()
    await publish(table, D1)
    async with kvgate(table, blocked / FILE_NAME, metrics) as sync:
        await eventually(lambda: file_count(metrics, "write_failed") >= 2, "two failed writes, counted")
        await publish(table, D2)
        await eventually(lambda: _digest(sync, "tenant-42") == D2, "the sync runs on")


async def test_a_file_ahead_of_the_log_costs_a_full_read(
    redis: Redis, table: EpochTable, tmp_path: Path
) -> None:
    """A position past the log's newest entry (a Redis restored from an older copy, same generation):
    the changes after the copy are unknown to the table, so the file is not trusted."""
    await publish(table, D1)
    path = tmp_path / FILE_NAME
    held = VersionState("tenant-42", D2, f"tenant-42@{D2[:16]}", f"/store/{D2}", BASE, 2)  # a later publish
    future = f"{2**62}-0"
    path.write_bytes(encode(await table.ensure_generation(), future, row_hash(held), [held], {}))
    metrics = Metrics()
    async with kvgate(table, path, metrics) as sync:
        assert file_count(metrics, "ahead") == 1
        assert dict(sync.counts.full_reads) == {"start": 1}
        assert _digest(sync, "tenant-42") == D1


async def test_rows_that_are_not_utf8_go_through_the_file_as_the_bytes_redis_held(
    redis: Redis, table: EpochTable, tmp_path: Path
) -> None:
    """A logical ID that is not UTF-8 (written past the scripts) is kept as surrogates; the file keeps
    it too (a write that failed on it stopped the sync). Its row is in the table's checksum and in no
    snapshot, so a start from the file sets it aside (checksum) and reads in full, as a running kvgate
    does once."""
    await publish(table, D1)
    odd = b"tenant-\xff\xfe"
    await redis.sadd(keys.IDS, odd)
    await redis.hset(keys.STATE_PREFIX.encode() + odd, mapping={"digest": D2, "epoch": "NaN"})
    path = tmp_path / FILE_NAME
    first_metrics = Metrics()
    async with kvgate(table, path, first_metrics) as first:
        await written_at_head(first, redis)
        malformed = dict(first.snapshot.malformed)
        assert list(malformed) == [odd.decode(errors="surrogateescape")]
    assert file_count(first_metrics, "write_failed") == 0
    assert decode(path.read_bytes()).malformed == malformed, "the bytes Redis held, through the file"
    metrics = Metrics()
    async with kvgate(table, path, metrics) as second:
        assert file_count(metrics, "checksum") == 1
        assert second.snapshot.malformed == malformed
        assert dict(second.counts.full_reads) == {"start": 1}


def test_a_rollouts_candidate_goes_through_the_file_and_a_bad_one_is_refused() -> None:
    candidate = Candidate(D2, f"t@{D2[:16]}", f"/store/{D2}", BASE, "bp1-x", 2500, "conversation")
    with_rollout = VersionState("t", D1, f"t@{D1[:16]}", f"/store/{D1}", BASE, 3, candidate=candidate,
                                last_rollout='{"outcome": "aborted"}')  # fmt: skip
    plain = VersionState("u", D3, f"u@{D3[:16]}", f"/store/{D3}", BASE, 1)
    saved = decode(encode("g", "1-0", row_hash(with_rollout) + row_hash(plain), [with_rollout, plain], {}))
    assert saved.states == {"t": with_rollout, "u": plain}
    for bad_candidate in (Candidate(D2, "t@2", "/s2", BASE, "", 10_001),
                          Candidate(D2, "t@2", "/s2", BASE, "", 100, "prefix")):  # fmt: skip
        bad = VersionState("t", D1, "t@1", "/s", BASE, 3, candidate=bad_candidate)
        with pytest.raises(Rejected, match="candidate column"):
            decode(encode("g", "1-0", 0, [bad], {}))
