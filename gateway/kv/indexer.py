"""The KV indexer: every replica's KV events followed once per kvgate, into the table its workers share.

One process per kvgate (``python -m gateway.process.indexer``, started and restarted by the process that
made the shared file: the workers' parent, or a one-process kvgate) runs the followers (``kv.follower``:
one per replica, each a supervised task), decodes and applies every batch to the precise index
(``kv.index``), whose views copy which blocks they hold into the shared table (``kv.shared_index``):
the workers read it, decode nothing, and no batch is ever applied on a loop that serves requests.

Every ``REPORT_S`` it writes each replica's figures into its record (state, lag, blocks, last batch,
batches dropped, its follower's ``health()``: the workers' ``/healthz`` and routing trust), empties a
replica's view
when a worker asked (kvgate purged its cache, or a worker saw the replica restart: the record's counts
moved), beats its heartbeat, and
writes its ``/metrics`` page (its counters: events, gaps, replays, drops, follower failures) to
``page`` for the worker that answers a scrape to merge. A new indexer (a restart) starts from an empty
table (``SharedWriter.start``): it cannot vouch for what the one before applied.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from pathlib import Path

import aiohttp

from gateway.core.atomic_file import write_atomically
from gateway.fleet.replicas import Replica
from gateway.kv.follower import KvFollower, follow_events
from gateway.kv.index import PreciseIndex
from gateway.kv.shared_index import SharedRegion, SharedWriter
from gateway.tasks.supervisor import Supervisor
from gateway.telemetry.metrics import Metrics

REPORT_S = 0.2  # how often the replicas' records, the heartbeat and purges are looked at
PAGE_S = 1.0  # how often the metrics page is written


def page_path(data_dir: Path, tag: str) -> Path:
    """Where the indexer of the shared file tagged ``tag`` (``SharedRegion.tag``) writes its page."""
    return data_dir / f"kv-indexer-{tag}.prom"


def report(writer: SharedWriter, follower: KvFollower) -> None:
    health = follower.health()
    state = str(health["state"])
    since = None if follower.last_batch is None else time.time() - (time.monotonic() - follower.last_batch)
    url = follower.replica.url
    writer.report(url, state, health, follower.lag, follower.index.blocks(url), since, follower.dropped)


async def index_events(
    fd: int,
    replicas: Sequence[str],
    endpoints: list[str],
    entries: int,
    page: Path,
    *,
    generation: int,
    failure_limit: float,
    stop: asyncio.Event,
) -> None:
    """Follow every replica's events into the shared file ``fd`` until ``stop`` is set."""
    region = SharedRegion(fd, replicas)
    writer = SharedWriter(region)
    writer.start(generation)
    index = PreciseIndex(entries, mirror=writer)
    metrics = Metrics()
    supervisor = Supervisor(failure_limit=failure_limit)
    seen = {url: writer.purges(url) for url in replicas}
    replica_list = [Replica(url) for url in replicas]
    for replica in replica_list:  # its incarnation: the restarts workers saw (follower._check_restart)
        replica.incarnation = writer.restarts(replica.url)
    timeout = aiohttp.ClientTimeout(total=10)
    async with (
        aiohttp.ClientSession(timeout=timeout) as session,
        follow_events(endpoints, replica_list, session, index, metrics, supervisor) as followers,
    ):  # fmt: skip
        written = 0.0
        while not stop.is_set():
            for url, follower in followers.items():
                purges = writer.purges(url)
                if purges != seen[url]:
                    seen[url] = purges
                    follower.cleared("purged by kvgate")
                follower.replica.incarnation = writer.restarts(url)  # moved: the follower empties the view
                report(writer, follower)
            writer.beat(int(time.time() * 1000))
            if time.monotonic() - written >= PAGE_S:
                write_atomically(page, metrics.kv_page(), durable=False)
                written = time.monotonic()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), REPORT_S)
    writer.close()
