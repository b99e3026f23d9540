"""Adapter churn: many logical IDs over a small adapter budget (issue 17: 2,000 IDs over two instant-loading
stub replicas at the default budget of 8 took 123 s for 1,806 requests, p99 18.4 s, max 31 s).

One kvgate (in this process, ``build_app``) in front of two stub replicas (``tests.support.stub_backend``:
loads
and unloads are instant) on a ``redis-server`` of its own. ``--ids`` logical IDs are published (the same
bytes under each: the stubs do not read them); then ``--clients`` clients send ``--requests`` completion
requests in all, each for an ID drawn at random, so nearly every request needs a load and every load past
the budget an eviction. Printed: wall time, throughput, latency percentiles, statuses, loads, unloads and
the time loads spent waiting for an adapter slot (``kvgate_adapter_slot_wait_seconds``).

    .venv/bin/python -m loadtest.churn                      # 2,000 IDs, 2,000 requests, 32 clients
    .venv/bin/python -m loadtest.churn --ids 500 --requests 500 --budget 8 --clients 16
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families
from redis.asyncio import Redis

from gateway.adapters.store import AdapterStore
from gateway.app.wiring import build_app
from gateway.core.identity import versioned_name
from gateway.process.http_edge import running
from gateway.settings.model import Settings
from gateway.table import keys
from gateway.table.epoch_table import EpochTable
from gateway.table.redis_server import EmbeddedRedis
from tests.support.stub_backend import StubState, build_stub

CONFIG = '{"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}'
ADMIN_TOKEN = "churn"


async def publish_all(redis: Redis, store: AdapterStore, root: Path, ids: int) -> list[str]:
    adapter = root / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(CONFIG)
    (adapter / "adapter_model.safetensors").write_bytes(b"weights")
    artifact = store.ingest(adapter)
    table = EpochTable(redis)
    names = [f"tenant-{i}" for i in range(ids)]
    for name in names:
        await table.publish(
            name, artifact.digest, versioned_name(name, artifact.digest), str(artifact.path), "base"
        )
    return names


def _samples(text: str, family: str) -> dict[str, float]:
    """The summed samples of one metric family, by sample name (``_sum``, ``_count``, ``_total``)."""
    found: dict[str, float] = {}
    for metric in text_string_to_metric_families(text):
        if metric.name == family:
            for sample in metric.samples:
                found[sample.name] = found.get(sample.name, 0.0) + sample.value
    return found


async def run(args: argparse.Namespace) -> None:
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmp, EmbeddedRedis(Path(tmp) / "redis") as server:
        redis = Redis.from_url(server.url)
        store = AdapterStore(Path(tmp) / "store")
        names = await publish_all(redis, store, Path(tmp), args.ids)
        states = [StubState(), StubState()]
        async with running(build_stub(states[0])) as a, running(build_stub(states[1])) as b:
            settings = Settings(
                replicas=[a, b],
                store=store.root,
                max_adapters_per_replica=args.budget,
                admin_token=ADMIN_TOKEN,
            )
            async with (
                running(build_app(settings, redis)) as url,
                aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as http,
            ):
                latencies: list[float] = []
                statuses: Counter[int] = Counter()
                queue = [rng.choice(names) for _ in range(args.requests)]

                async def client() -> None:
                    while queue:
                        model = queue.pop()
                        body = {"model": model, "prompt": "p", "max_tokens": 1}
                        started = time.perf_counter()
                        async with http.post(f"{url}/v1/completions", json=body) as response:
                            await response.read()
                        latencies.append(time.perf_counter() - started)
                        statuses[response.status] += 1

                started = time.perf_counter()
                await asyncio.gather(*(client() for _ in range(args.clients)))
                wall = time.perf_counter() - started
                async with http.get(f"{url}/metrics", headers={"x-kvgate-admin-token": ADMIN_TOKEN}) as got:
                    metrics = await got.text()
                shared = [await redis.hlen(keys.last_use(replica)) for replica in (a, b)]
        await redis.aclose()
    listings = sum(state.listings for state in states)
    latencies.sort()
    waits = _samples(metrics, "kvgate_adapter_slot_wait_seconds")
    loads = _samples(metrics, "kvgate_adapter_loads")
    unloads = _samples(metrics, "kvgate_adapter_unloads")

    def pct(p: float) -> float:
        return latencies[min(len(latencies) - 1, int(p * len(latencies)))]

    print(
        f"{args.requests} requests, {args.ids} IDs, {args.clients} clients, budget {args.budget} x 2 "
        f"replicas: {wall:.1f} s wall, {args.requests / wall:.0f} req/s\n"
        f"latency: p50 {pct(0.5) * 1000:.0f} ms, p90 {pct(0.9) * 1000:.0f} ms, "
        f"p99 {pct(0.99) * 1000:.0f} ms, max {latencies[-1] * 1000:.0f} ms, "
        f"mean {statistics.fmean(latencies) * 1000:.0f} ms\n"
        f"statuses: {dict(sorted(statuses.items()))}\n"
        f"loads: {loads.get('kvgate_adapter_loads_total', 0):.0f}, "
        f"unloads: {unloads.get('kvgate_adapter_unloads_total', 0):.0f}, "
        f"slot waits: {waits.get('kvgate_adapter_slot_wait_seconds_count', 0):.0f} loads waited "
        f"{waits.get('kvgate_adapter_slot_wait_seconds_sum', 0):.1f} s in all\n"
        f"replica listings (GET /v1/models) kvgate asked for: {listings}\n"
        f"names in the shared last-use hash per replica at the end: {shared} (loaded: at most {args.budget})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ids", type=int, default=2_000)
    parser.add_argument("--requests", type=int, default=2_000)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--budget", type=int, default=8, help="max_adapters_per_replica")
    parser.add_argument("--seed", type=int, default=17)
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
