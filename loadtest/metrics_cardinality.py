"""``/metrics`` size at 1,000 / 10,000 / 100,000 logical IDs: the old per-ID labels against the top K.

Two traffic shapes, each replayed into a fresh metrics registry per ID count:

- ``one request per ID``: every ID served once (prompt and cached tokens reported, one epoch change,
  a coherent canary verdict on each of two replicas), as in the measurement that opened issue 13;
- ``active, hot set moving``: the same, plus a hot set of 100 IDs taking as much traffic again, which
  moves to other IDs three times over the run, while the clock crosses six re-rankings (so the top K
  churns and frozen series are as many as they can be).

*Before* is ``gateway/telemetry/metrics.py`` as it was at ``--before`` (default: the last commit before
bounded metrics), loaded from git and driven with that code's own calls (every metric labelled by the
ID); *after* is this tree's ``Metrics`` (defaults: K = 100, re-ranked every 300 s) driven by
``tests.support.metrics_traffic.record_request``, the calls the request path makes. A series is a sample
line of
the exposition (``_created`` lines included: Prometheus stores them too); bytes are the exposition's.

``--end-to-end N`` also serves N IDs once each through a running kvgate (in-process, a stub replica, an
embedded Redis) and scrapes its ``/metrics``, to check the replay against the real call sites.

Run from the repository root (``make loadtest-metrics``)::

    .venv/bin/python -m loadtest.metrics_cardinality [--ids 1000 10000 100000] [--end-to-end 1000] \\
        [--out docs/observability.md]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import subprocess
import tempfile
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
from redis.asyncio import Redis

from gateway.adapters.store import AdapterStore
from gateway.app.wiring import build_app
from gateway.core.identity import versioned_name
from gateway.dev import generated_docs
from gateway.process.http_edge import running
from gateway.settings.model import Settings
from gateway.table.epoch_table import EpochTable
from gateway.table.redis_server import EmbeddedRedis
from gateway.telemetry.metrics import Metrics
from tests.support.metrics_traffic import REPLICAS, record_epoch_change, record_request, series_in
from tests.support.stub_backend import StubState, build_stub

ROOT = Path(__file__).resolve().parent.parent
BEFORE = "f4d700f"
"""The last commit before bounded metrics (every metric labelled by logical ID)."""
HOT = 100
SECONDS = 2_000.0  # the replayed clock: six re-rankings at the default 300 s


def old_metrics(rev: str) -> Callable[[], Any]:
    """``Metrics`` from ``gateway/telemetry/metrics.py`` at ``rev``."""
    source = subprocess.run(
        ["git", "show", f"{rev}:gateway/telemetry/metrics.py"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    module = types.ModuleType("metrics_before")
    exec(compile(source, f"{rev}:gateway/telemetry/metrics.py", "exec"), module.__dict__)
    factory: Callable[[], Any] = module.Metrics
    return factory


Record = Callable[[str, str, bool], None]
"""Record one served request (logical ID, outcome) and, if asked, an epoch change of that ID."""


def before(factory: Callable[[], Any]) -> tuple[Any, Record]:
    metrics = factory()

    def record(logical_id: str, outcome: str, epoch: bool) -> None:  # the old call sites' calls
        metrics.requests.labels(logical_id, outcome).inc()
        metrics.latency.labels(logical_id).observe(0.2)
        metrics.ttfb.labels(logical_id).observe(0.05)
        metrics.prompt_tokens.labels(logical_id).inc(100)
        metrics.cached_tokens.labels(logical_id).inc(64)
        for replica in REPLICAS:
            metrics.audits.labels(logical_id, replica, "coherent").inc()
        if epoch:
            metrics.epoch_changes.labels(logical_id).inc()

    return metrics, record


def after(clock: Callable[[], float]) -> tuple[Metrics, Record]:
    metrics = Metrics(clock=clock)

    def record(logical_id: str, outcome: str, epoch: bool) -> None:
        record_request(metrics, logical_id, outcome)
        if epoch:
            record_epoch_change(metrics, logical_id)

    return metrics, record


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def replay(make: Callable[[Clock], tuple[Any, Record]], ids: int, hot: bool) -> bytes:
    clock = Clock()
    metrics, record = make(clock)
    tenants = [f"tenant-{i}" for i in range(ids)]
    random.Random(13).shuffle(tenants)
    hot_sets = [tenants[HOT * phase : HOT * (phase + 1)] for phase in range(3)]
    step = SECONDS / ids
    for i, logical_id in enumerate(tenants):
        clock.now += step
        record(logical_id, "200", True)
        if hot:
            hot_set = hot_sets[min(int(clock.now // (SECONDS / 3)), 2)]
            record(hot_set[i % len(hot_set)], "200" if i % 7 else "429", False)
    exposition: bytes = metrics.exposition()
    return exposition


async def end_to_end(ids: int) -> bytes:
    """``ids`` IDs published in a real Redis, each served once through a running kvgate; its ``/metrics``."""
    with tempfile.TemporaryDirectory() as tmp, EmbeddedRedis(Path(tmp) / "redis") as server:
        redis = Redis.from_url(server.url)
        table = EpochTable(redis)
        store = AdapterStore(Path(tmp) / "store")
        adapter = Path(tmp) / "adapter"
        adapter.mkdir()
        config = '{"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}'
        (adapter / "adapter_config.json").write_text(config)
        (adapter / "adapter_model.safetensors").write_bytes(b"weights")
        artifact = store.ingest(adapter)
        names = [f"tenant-{i}" for i in range(ids)]
        for name in names:
            await table.publish(
                name, artifact.digest, versioned_name(name, artifact.digest), str(artifact.path), "base"
            )
        async with running(build_stub(StubState())) as stub_url:
            settings = Settings(
                replicas=[stub_url], store=store.root, max_adapters_per_replica=ids + 1, admin_token="scrape"
            )
            async with running(build_app(settings, redis)) as url, aiohttp.ClientSession() as http:
                for name in names:
                    body = {"model": name, "prompt": "p", "max_tokens": 1}
                    async with http.post(f"{url}/v1/completions", json=body) as response:
                        assert response.status == 200, await response.text()
                async with http.get(f"{url}/metrics", headers={"x-kvgate-admin-token": "scrape"}) as response:
                    text = await response.read()
        await redis.aclose()
    return text


def row(label: str, ids: int, exposition: bytes) -> str:
    return f"| {label} | {ids:,} | {series_in(exposition):,} | {len(exposition) / 1e6:.3f} MB |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ids", type=int, nargs="+", default=[1_000, 10_000, 100_000])
    parser.add_argument("--before", default=BEFORE, help="git revision of the old metrics.py")
    parser.add_argument(
        "--end-to-end", type=int, default=0, metavar="N", help="also serve N IDs through kvgate"
    )
    parser.add_argument("--out", type=Path, help="write the tables into this doc's generated block")
    args = parser.parse_args()
    generated_docs.started_tree()  # the tree measured, taken before the run
    factory = old_metrics(args.before)
    lines: list[str] = []

    def say(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    for hot, title in ((False, "one request per ID"), (True, f"active, a hot set of {HOT} moving")):
        say(f"\n{title}:\n")
        say("| labels | IDs | series | bytes |\n| --- | ---: | ---: | ---: |")
        for ids in args.ids:
            started = time.perf_counter()
            old = replay(lambda c: before(factory), ids, hot)
            say(row(f"before ({args.before}: every metric by ID)", ids, old))
            say(row("after (counters: top 100 + other)", ids, replay(after, ids, hot)))
            print(f"({ids:,} IDs replayed in {time.perf_counter() - started:.1f} s)")
    if args.end_to_end:
        exposition = asyncio.run(end_to_end(args.end_to_end))
        say(f"\nthrough a running kvgate (stub replica), {args.end_to_end:,} IDs served once each:\n")
        say("| labels | IDs | series | bytes |\n| --- | ---: | ---: | ---: |")
        say(row("after, end to end", args.end_to_end, exposition))
    if args.out is not None:
        generated_docs.write_block(args.out, generated_docs.measured("\n".join(lines)))


if __name__ == "__main__":
    main()
