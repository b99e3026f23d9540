"""Operator commands on a real Redis and the real store: versions, history, the status matrix, gc, and the
publish progress bar. gc never removes what is current, recent, was current lately, listed by a replica,
or young; ``--dry-run`` removes nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, ValuesView
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio import Redis

from gateway.adapters import gc
from gateway.adapters.gc_trash import TRASH_PREFIX
from gateway.adapters.publish import publish_adapter
from gateway.adapters.store import INCOMING_PREFIX, AdapterStore
from gateway.core.errors import VersionNotFound
from gateway.process.http_edge import free_port
from gateway.table import keys
from gateway.table.epoch_table import EpochTable
from gateway.table.inventory import forget_version, read_versions
from gateway.table.redis_server import EmbeddedRedis
from tests.support.adapter_files import MakeAdapter

DAY = 86400.0


def kvgate(*args: str, redis_url: str, store: Path) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "gateway.cli", *args, "--redis-url", redis_url, "--store", str(store)]
    return subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)


def ok_json(*args: str, redis_url: str, store: Path) -> Any:
    done = kvgate(*args, "--json", redis_url=redis_url, store=store)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


class Clock:
    def __init__(self, at: float) -> None:
        self.at = at

    def __call__(self) -> int:
        return int(self.at * 1000)


async def publish_at(
    redis: Redis, store: AdapterStore, clock: Clock, at: float, logical_id: str, adapter: Path
) -> str:
    """Publish ADAPTER as of time AT (the table's clock and the store directory's mtime)."""
    clock.at = at
    done = await publish_adapter(EpochTable(redis, clock=clock), store, logical_id, adapter, "base")
    os.utime(done.path, (at, at))
    return done.digest


async def test_versions_and_history(
    redis: Redis, redis_server: EmbeddedRedis, make_adapter: MakeAdapter, tmp_path: Path
) -> None:
    store = AdapterStore(tmp_path / "store")
    clock = Clock(time.time())
    v1 = await publish_at(redis, store, clock, time.time() - 60, "tenant-42", make_adapter(b"v1"))
    v2 = await publish_at(redis, store, clock, time.time() - 30, "tenant-42", make_adapter(b"v2"))
    await EpochTable(redis).rollback("tenant-42", "", "base")

    url = redis_server.url
    versions = ok_json("versions", "tenant-42", redis_url=url, store=store.root)
    assert [(v["digest"], v["current"]) for v in versions["versions"]] == [(v2, False), (v1, True)]
    assert versions["epoch"] == 3
    table = kvgate("versions", "tenant-42", redis_url=url, store=store.root)
    assert table.returncode == 0, table.stderr
    (current_line,) = [line for line in table.stdout.splitlines() if line.startswith("*")]
    assert v1[:16] in current_line
    assert v2[:16] not in current_line

    history = ok_json("history", "tenant-42", redis_url=url, store=store.root)
    assert [(e["action"], e["epoch"], e["digest"]) for e in history["history"]] == [
        ("rollback", 3, v1), ("publish", 2, v2), ("publish", 1, v1)
    ]  # fmt: skip
    lines = kvgate("history", "tenant-42", redis_url=url, store=store.root).stdout.splitlines()
    assert lines[1].split()[2:4] == ["3", "rollback"]

    missing = kvgate("history", "nobody", redis_url=url, store=store.root)
    assert missing.returncode == 2
    assert "no history" in missing.stderr


MALFORMED_HISTORY = [
    b"{not json",
    b'"a string"',
    b"\xff\xfe",  # not UTF-8
    b'{"action": 3}',
    b'{"action": "publish", "at_ms": "x"}',
    b'{"action": "publish", "at_ms": 1e20}',  # no date
    b'{"action": "rollout", "role": "candidate", "weight": "50%"}',
]


async def test_history_and_gc_skip_and_count_a_malformed_history_entry(
    redis: Redis, redis_server: EmbeddedRedis, make_adapter: MakeAdapter, tmp_path: Path
) -> None:
    """Entries written by hand (``LPUSH``) among the scripts' own: ``history`` and ``gc`` read the rest,
    exit 0 and name each skipped entry (the ID and its position, 0 the newest)."""
    store = AdapterStore(tmp_path / "store")
    table = EpochTable(redis)
    v1 = await publish_adapter(table, store, "tenant-42", make_adapter(b"v1"), "base")
    await redis.lpush(keys.history("tenant-42"), *MALFORMED_HISTORY[:4])
    v2 = await publish_adapter(table, store, "tenant-42", make_adapter(b"v2"), "base")
    await redis.lpush(keys.history("tenant-42"), *MALFORMED_HISTORY[4:])
    url = redis_server.url

    history = ok_json("history", "tenant-42", redis_url=url, store=store.root)
    assert [(e["action"], e["digest"]) for e in history["history"]] == [
        ("publish", v2.digest), ("publish", v1.digest)
    ]  # fmt: skip
    assert len(history["malformed"]) == len(MALFORMED_HISTORY)
    assert history["malformed"][0] == "history of 'tenant-42', entry 0: weight is not a number"
    assert "entry 5: not UTF-8 JSON" in history["malformed"][4]
    text = kvgate("history", "tenant-42", redis_url=url, store=store.root)
    assert (text.returncode, text.stderr) == (0, "")
    assert "skipped 7 malformed history entries" in text.stdout
    assert "  history of 'tenant-42', entry 1: at_ms 1e+20 is not a time" in text.stdout.splitlines()

    swept = ok_json("gc", "--dry-run", redis_url=url, store=store.root)
    assert swept["malformed_history"] == history["malformed"]
    assert {e["digest"] for e in swept["entries"]} == {v1.digest, v2.digest}
    text = kvgate("gc", "--dry-run", redis_url=url, store=store.root)
    assert (text.returncode, text.stderr) == (0, "")
    assert "skipped 7 malformed history entries" in text.stdout


async def test_status_matrix_marks_a_replica_holding_another_version(
    redis: Redis, redis_server: EmbeddedRedis, make_adapter: MakeAdapter, tmp_path: Path
) -> None:
    store = AdapterStore(tmp_path / "store")
    table = EpochTable(redis)
    old = await publish_adapter(table, store, "tenant-42", make_adapter(b"v1"), "base")
    new = await publish_adapter(table, store, "tenant-42", make_adapter(b"v2"), "base")
    good, stale = "http://10.0.0.5:8000", "http://10.0.0.6:8000"
    await table.record_loaded(good, {new.name: str(new.path)}, ttl_ms=60_000)
    await table.record_loaded(stale, {old.name: str(old.path)}, ttl_ms=60_000)

    doc = ok_json("status", redis_url=redis_server.url, store=store.root)
    (row,) = doc["logical_ids"]
    assert doc["replicas"] == [good, stale]
    assert row["replicas"][good] == {
        "loaded": [new.name],
        "current": True,
        "candidate": False,
        "mismatch": False,
    }
    assert row["replicas"][stale] == {
        "loaded": [old.name],
        "current": False,
        "candidate": False,
        "mismatch": True,
    }
    assert row["loaded_on"] == [good]

    text = kvgate("status", redis_url=redis_server.url, store=store.root).stdout
    (line,) = [line for line in text.splitlines() if line.startswith("tenant-42")]
    assert line.split()[3:] == ["=", f"!{old.digest[:16]}"]


async def test_gc_keeps_what_is_needed_and_removes_the_rest(
    redis: Redis, make_adapter: MakeAdapter, tmp_path: Path
) -> None:
    store = AdapterStore(tmp_path / "store")
    clock, now = Clock(0), time.time()
    old = now - 30 * DAY
    a = [await publish_at(redis, store, clock, old + i, "a", make_adapter(b"a%d" % i)) for i in range(6)]
    b_old = await publish_at(redis, store, clock, old, "b", make_adapter(b"b0"))
    b_now = await publish_at(redis, store, clock, now - 3600, "b", make_adapter(b"b1"))  # b0: current 1 h ago
    c = [await publish_at(redis, store, clock, old + 20 + i, "c", make_adapter(b"c%d" % i)) for i in range(3)]
    os.utime(store.path_for(c[0]))  # published again just now (the store touched it), though not recent
    table = EpochTable(redis)
    await table.record_loaded("http://10.0.0.5:8000", {f"a@{a[1][:16]}": str(store.path_for(a[1]))}, 60_000)
    live = {"http://10.0.0.6:8000": {f"a@{a[2][:16]}": "/elsewhere/a2"}}  # listed by name alone
    policy = gc.Policy(keep_last=2, retention_s=7 * DAY)

    entries = {e.digest: e.kept_because for e in await gc.collect(table, store, policy, live)}
    assert entries == {
        a[0]: (), a[1]: ("loaded",), a[2]: ("loaded",), a[3]: (), a[4]: ("recent",),
        a[5]: ("current", "recent", "was-current"), b_old: ("recent", "was-current"),
        b_now: ("current", "recent", "was-current", "young"),
        c[0]: ("young",), c[1]: ("recent",), c[2]: ("current", "recent", "was-current"),
    }  # fmt: skip

    before = sorted(p.name for p in store.root.iterdir())
    dry = await gc.sweep(table, store, policy, live, dry_run=True)
    assert (dry.removed, sorted(p.name for p in store.root.iterdir())) == ([], before)
    assert len(await read_versions(table, "a")) == 6

    done = await gc.sweep(table, store, policy, live)
    assert sorted(done.removed) == sorted([a[0], a[3]])
    assert sorted(p.name for p in store.root.iterdir()) == sorted(set(before) - {a[0], a[3]})
    assert {r.digest for r in await read_versions(table, "a")} == set(a) - {a[0], a[3]}
    with pytest.raises(VersionNotFound):  # its record went with its bytes: no rollback to a hole
        await table.rollback("a", a[0], "base")


async def test_gc_removes_what_a_killed_publish_left_once_it_is_old(
    table: EpochTable, make_adapter: MakeAdapter, tmp_path: Path
) -> None:
    store = AdapterStore(tmp_path / "store")
    kept = await publish_adapter(table, store, "a", make_adapter(b"1"), "base")
    killed, under_way = store.root / f"{INCOMING_PREFIX}killed", store.root / f"{INCOMING_PREFIX}now"
    for staging in (killed, under_way):
        (staging / "sub").mkdir(parents=True)
        (staging / "sub" / "adapter_model.safetensors").write_bytes(b"x" * 100)
    old = time.time() - 3 * DAY
    for path in (killed / "sub" / "adapter_model.safetensors", killed / "sub", killed):
        os.utime(path, (old, old))
    policy = gc.Policy(keep_last=1, retention_s=DAY)

    dry = await gc.sweep(table, store, policy, dry_run=True)
    assert [(item.path, item.bytes) for item in dry.leftovers] == [(str(killed), 100)]
    assert killed.is_dir(), "a dry run removes nothing"
    done = await gc.sweep(table, store, policy)
    assert [item.path for item in done.leftovers] == [str(killed)]
    assert not killed.exists()
    assert under_way.is_dir(), "a publish under way writes its staging now: young, kept"
    assert store.path_for(kept.digest).is_dir()


async def test_forgetting_the_current_version_is_refused(
    table: EpochTable, make_adapter: MakeAdapter, tmp_path: Path
) -> None:
    store = AdapterStore(tmp_path / "store")
    v1 = await publish_adapter(table, store, "a", make_adapter(b"1"), "base")
    v2 = await publish_adapter(table, store, "a", make_adapter(b"2"), "base")
    assert not await forget_version(table, "a", v2.digest)
    assert await forget_version(table, "a", v1.digest)
    assert [r.digest for r in await read_versions(table, "a")] == [v2.digest]


async def test_publishing_the_same_bytes_again_makes_the_entry_young(
    table: EpochTable, make_adapter: MakeAdapter, tmp_path: Path
) -> None:
    """The publish half of gc's safety: a publish that finds the directory touches it (so gc keeps it)."""
    store = AdapterStore(tmp_path / "store")
    first = await publish_adapter(table, store, "a", make_adapter(b"1"), "base")
    os.utime(first.path, (1, 1))
    await publish_adapter(table, store, "other", make_adapter(b"1"), "base")
    assert time.time() - os.stat(first.path).st_mtime < 60


async def test_gc_command_dry_run_then_for_real(
    redis: Redis, redis_server: EmbeddedRedis, make_adapter: MakeAdapter, tmp_path: Path
) -> None:
    store = AdapterStore(tmp_path / "store")
    clock, old = Clock(0), time.time() - 30 * DAY
    digests = [await publish_at(redis, store, clock, old + i, "a", make_adapter(b"%d" % i)) for i in range(3)]
    url = redis_server.url

    dry = kvgate("gc", "--keep", "1", "--older-than", "7d", "--dry-run", redis_url=url, store=store.root)
    assert dry.returncode == 0, dry.stderr
    assert "would remove 2 of 3 store entries" in dry.stdout
    assert all(store.contains(d) for d in digests)

    unreachable = f"http://127.0.0.1:{free_port()}"
    refused = kvgate("gc", "--keep", "1", "--replica", unreachable, redis_url=url, store=store.root)
    assert refused.returncode == 1
    assert "nothing removed" in refused.stderr
    assert all(store.contains(d) for d in digests)

    short = kvgate("gc", "--older-than", "10s", redis_url=url, store=store.root)
    assert (short.returncode, all(store.contains(d) for d in digests)) == (2, True)

    done = ok_json("gc", "--keep", "1", redis_url=url, store=store.root)
    assert sorted(done["removed"]) == sorted(digests[:2])
    assert [store.contains(d) for d in digests] == [False, False, True]


def test_publish_progress_bar_when_asked(make_adapter: MakeAdapter, tmp_path: Path) -> None:
    data = tmp_path / "kvgate"
    adapter = make_adapter(b"x" * (3 << 20))
    command = [sys.executable, "-m", "gateway.cli", "publish", "tenant-42", str(adapter), "--progress",
               "--data-dir", str(data), "--store", str(data / "store")]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert "copying adapter" in done.stderr
    assert "3.1/3.1 MB" in done.stderr
    without = [arg for arg in command if arg != "--progress"]
    quiet = subprocess.run(without, capture_output=True, text=True, timeout=60, check=False)
    assert quiet.returncode == 0
    assert "copying" not in quiet.stderr, "no bar when stderr is not a terminal and none was asked for"


class ListedLater(Mapping[str, Mapping[str, str]]):
    """Replica listings that name nothing at gc's first read and LISTING from the second on: a replica
    that loaded the version while gc was deciding."""

    def __init__(self, listing: dict[str, str]) -> None:
        self.listing, self.reads = listing, 0

    def _now(self) -> dict[str, Mapping[str, str]]:
        return {"http://10.0.0.7:8000": self.listing} if self.reads > 1 else {}

    def values(self) -> ValuesView[Mapping[str, str]]:
        self.reads += 1
        return self._now().values()

    def __getitem__(self, key: str) -> Mapping[str, str]:
        return self._now()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._now())

    def __len__(self) -> int:
        return len(self._now())


async def test_gc_puts_back_what_became_needed_after_it_decided(
    redis: Redis, make_adapter: MakeAdapter, tmp_path: Path
) -> None:
    """Between the rename and the deletion gc reads everything again: a version listed meanwhile stays."""
    store = AdapterStore(tmp_path / "store")
    clock, old = Clock(0), time.time() - 30 * DAY
    first = await publish_at(redis, store, clock, old, "a", make_adapter(b"1"))
    await publish_at(redis, store, clock, old + 1, "a", make_adapter(b"2"))
    table = EpochTable(redis)
    later = ListedLater({f"a@{first[:16]}": str(store.path_for(first))})

    report = await gc.sweep(table, store, gc.Policy(keep_last=1, retention_s=DAY), later)
    assert later.reads == 2, "decided on the first read, checked again on the second"
    assert (report.removed, report.restored) == ([], [first])
    assert store.contains(first)
    assert not [p for p in store.root.iterdir() if p.name.startswith(TRASH_PREFIX)]
    assert first in {r.digest for r in await read_versions(table, "a")}, "its records stay too"
