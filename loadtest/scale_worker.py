"""One process of simulated kvgates for ``loadtest.scale``: K real ``SnapshotSync``s (or the old path).

Each simulated kvgate has its own Redis client and its own ``Snapshot``; nothing else of kvgate runs (no
proxy, no replicas). The ``new`` path is today's code: one paged full read, then the change log and the
heartbeat. The ``old`` path is what every kvgate did before the change log, re-implemented here only for
comparison (as of commit f4d700f): every interval, ``SMEMBERS kvg:ids`` and one pipeline with an
``HGETALL`` per ID, then ``Snapshot.replace``. It prints one JSON line when every kvgate has read the
table ({"ready", cold-start seconds, memory}); on a line "stop" on stdin it prints the epoch changes each
snapshot saw, with the wall time it saw them, and exits. With ``--snapshot-file`` each new-path kvgate
starts from that file (the real ``SnapshotFile``, as ``kvgate serve`` with ``snapshot_file_interval``);
``--cold-only`` prints the ready line (with what each start read: full reads, file outcomes, checksum)
and exits, for ``loadtest.scale_cold``.

    python -m loadtest.scale_worker --url redis://127.0.0.1:PORT --kvgates 25 --path new
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import resource
import sys
import time
import tracemalloc
from pathlib import Path

from redis.asyncio import Redis

from gateway.core.model import TableView
from gateway.table import keys
from gateway.table.epoch_table import EpochTable
from gateway.table.replies import as_text
from gateway.table.rows import parse_state
from gateway.table.snapshot import Snapshot, SnapshotSync
from gateway.table.snapshot_file import SnapshotFile
from gateway.tasks.supervisor import periodically

Seen = list[tuple[str, int, float]]  # logical ID, epoch, wall time the snapshot took it


async def old_read_all(redis: Redis) -> TableView:
    """The full read as it was: one SMEMBERS, one unbounded pipeline (no paging)."""
    ids = sorted(as_text(i) for i in await redis.smembers(keys.IDS))
    async with redis.pipeline(transaction=False) as pipe:
        for logical_id in ids:
            pipe.hgetall(keys.state(logical_id))
        pipe.get(keys.GENERATION)
        *raws, generation = await pipe.execute()
    states = {i: s for i, raw in zip(ids, raws, strict=True) if (s := parse_state(i, raw)) is not None}
    return TableView(as_text(generation), states)


class SimulatedKvgate:
    def __init__(self, url: str, path: str, interval: float, file: Path | None = None) -> None:
        self.redis = Redis.from_url(url, socket_timeout=120.0)  # a fleet starting at once queues on Redis
        self.seen: Seen = []
        self.snapshot = Snapshot(on_epoch_change=self._changed)
        self.path = path
        self.interval = interval
        self.file = SnapshotFile(file, interval=0) if file is not None else None  # read, never written
        self.sync = SnapshotSync(EpochTable(self.redis), self.snapshot, interval=interval, file=self.file)

    def _changed(self, logical_id: str) -> None:
        state = self.snapshot.get(logical_id)
        self.seen.append((logical_id, state.epoch if state else 0, time.time()))

    async def cold_start(self) -> float:
        started = time.perf_counter()
        if self.path == "new":
            await self.sync.reconcile()
        else:
            self.snapshot.replace(await old_read_all(self.redis))
        return time.perf_counter() - started

    async def run(self) -> None:
        if self.path == "new":
            await self.sync.run()
        else:
            await periodically(self.interval, self._old_reconcile)

    async def _old_reconcile(self) -> None:
        self.snapshot.replace(await old_read_all(self.redis))


async def measured_memory(url: str, path: str) -> int:
    """Bytes one snapshot holds after a cold start (tracemalloc, on a kvgate of its own, then dropped)."""
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    probe = SimulatedKvgate(url, path, 1.0)
    await probe.cold_start()
    gc.collect()
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    await probe.redis.aclose()
    return held


async def main(args: argparse.Namespace) -> None:
    url, kvgates, path, interval = args.url, args.kvgates, args.path, args.interval
    held = await measured_memory(url, path) if args.memory else 0
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    fleet = [SimulatedKvgate(url, path, interval, args.snapshot_file) for _ in range(kvgates)]
    cpu = time.process_time()  # every thread's (the file is loaded in one)
    cold = await asyncio.gather(*(kvgate.cold_start() for kvgate in fleet))
    cpu = time.process_time() - cpu
    if args.cold_only:
        starts = [
            {"full_reads": dict(k.sync.counts.full_reads), "file": k.file.outcomes if k.file else {},
             "checksum": k.snapshot.checksum, "ids": k.snapshot.size(), "entries": k.sync.counts.entries}
            for k in fleet
        ]  # fmt: skip
        print(json.dumps({"ready": True, "cold_start_s": cold, "cpu_s": cpu, "starts": starts}), flush=True)
        for kvgate in fleet:
            await kvgate.redis.aclose()
        return
    rss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    tasks = [asyncio.ensure_future(kvgate.run()) for kvgate in fleet]
    ready = {"ready": True, "cold_start_s": cold, "tracemalloc_bytes": held}
    ready["rss_delta_kb_per_kvgate"] = (rss_after - rss_before) / kvgates
    print(json.dumps(ready), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await task
    counts = [dict(kvgate.sync.counts.full_reads) for kvgate in fleet]
    print(json.dumps({"seen": [kvgate.seen for kvgate in fleet], "full_reads": counts}), flush=True)
    for kvgate in fleet:
        await kvgate.redis.aclose()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--url", required=True)
    parser.add_argument("--kvgates", type=int, required=True)
    parser.add_argument("--path", choices=("new", "old"), default="new")
    parser.add_argument("--interval", type=float, default=1.0)
    parser.add_argument("--memory", action="store_true", help="measure one snapshot with tracemalloc first")
    parser.add_argument("--snapshot-file", type=Path, help="start each (new-path) kvgate from this file")
    parser.add_argument("--cold-only", action="store_true", help="print the cold start and exit")
    asyncio.run(main(parser.parse_args()))
