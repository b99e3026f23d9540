"""``/metrics`` stays bounded: per-ID counters for the top K IDs by traffic, ``other`` for the rest.

Bounds on size, not timers: 100,000 distinct active IDs through the real ``Metrics`` stay within 5,000
series and 1 MB; the top-K rules (``gateway/telemetry/top_ids.py``) keep every series monotonic and every
event counted once; and a running kvgate (stub replica, real Redis) labels its real traffic that way.
"""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import aiohttp
from redis.asyncio import Redis

from gateway.adapters.store import AdapterStore
from gateway.app.wiring import build_app
from gateway.process.http_edge import running
from gateway.settings.model import Settings
from gateway.table.epoch_table import EpochTable
from gateway.telemetry.heavy_hitters import SpaceSaving
from gateway.telemetry.metrics import OTHER, Metrics
from tests.support.adapter_files import Publish
from tests.support.conditions import eventually
from tests.support.metrics_traffic import Exposition, record_epoch_change, record_request
from tests.support.stub_backend import StubState, build_stub

TOKEN = "admin-token"  # /metrics on the public listener takes the admin token

MAX_SERIES = 5_000
MAX_BYTES = 1 << 20


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_space_saving_holds_every_heavy_key_and_never_underestimates() -> None:
    rng = random.Random(7)
    keys = [f"k{i}" for i in range(5_000)]
    weights = [1 / (rank + 1) for rank in range(len(keys))]  # Zipf-like: a few heavy keys, a long tail
    stream = rng.choices(keys, weights, k=50_000)
    sketch = SpaceSaving(100)
    for key in stream:
        sketch.add(key)
    true = Counter(stream)
    slack = len(stream) / 100
    assert len(sketch.counts) == 100
    heavy = {key for key, count in true.items() if count > slack}
    assert heavy
    assert heavy <= set(sketch.counts)
    for key, estimate in sketch.counts.items():
        assert true[key] <= estimate <= true[key] + slack
    assert sketch.top(3) == ["k0", "k1", "k2"]


def test_ids_enter_and_leave_the_top_k_with_every_series_monotonic_and_every_request_counted_once() -> None:
    clock = Clock()
    metrics = Metrics(top_k=2, rerank_interval=10, clock=clock)
    sent = 0
    dropped = 0.0
    before: dict[tuple[tuple[str, str], ...], float] = {}

    def send(logical_id: str, times: int = 1) -> None:
        nonlocal sent
        for _ in range(times):
            record_request(metrics, logical_id)
            sent += 1

    def requests() -> dict[str, float]:
        """Requests per label now; checks that no series went down and that the counts add up."""
        nonlocal before, dropped
        now = Exposition.parse(metrics.exposition()).samples["kvgate_requests_total"]
        for labels, value in before.items():
            if labels in now:
                assert now[labels] >= value, f"{labels} went down"
            else:
                dropped += value
        before = now
        assert sum(now.values()) + dropped == sent
        return {dict(labels)["logical_id"]: value for labels, value in now.items()}

    send("a")
    send("b")
    send("c")
    assert requests() == {"a": 1, "b": 1, OTHER: 1}  # the first K IDs seen take the free slots
    send("c", 5)
    clock.now = 10  # the next request re-ranks: c (7) and a (1; a tie with b goes by name) are the top 2
    send("c")
    send("b", 2)  # b is frozen: its count stays, its new traffic goes to other
    assert requests() == {"a": 1, "b": 1, "c": 1, OTHER: 8}
    assert metrics.for_id("b") == OTHER
    assert metrics.for_id("c") == "c"
    send("a", 3)
    clock.now = 20  # b is still out of the top 2 (halved, then: a 4.5, c 3.5, b 2.5): its series goes
    send("a")
    assert requests() == {"a": 5, "c": 1, OTHER: 8}
    assert dropped == 1
    send("b", 10)
    clock.now = 30  # b is back in the top 2 (12.25, a 2.25): a new series from 0; c is frozen
    send("b")
    assert requests() == {"a": 5, "b": 1, "c": 1, OTHER: 18}
    record_epoch_change(metrics, "c")
    record_epoch_change(metrics, "b")
    epochs = Exposition.parse(metrics.exposition()).ids("kvgate_epoch_changes_total")
    assert epochs == {"b": 1, OTHER: 1}


def test_k_0_counts_every_id_under_other() -> None:
    metrics = Metrics(top_k=0)
    for logical_id in ("a", "b", "a"):
        record_request(metrics, logical_id)
    parsed = Exposition.parse(metrics.exposition())
    assert parsed.ids("kvgate_requests_total") == {OTHER: 3}
    assert metrics.ids.sketch.counts == {}


def test_100000_active_ids_stay_within_5000_series_and_1_mb() -> None:
    """100,000 distinct IDs each active (shuffled), and beside them a hot set of 100 IDs that moves to
    other IDs every 700 s: the re-rankings (every 300 s, 6 in all) promote each hot set while it still
    gets traffic and freeze the one before, so promoted and frozen series are as many as they can be."""
    clock = Clock()
    metrics = Metrics(clock=clock)  # the defaults: K = 100, re-ranked every 300 s
    tenants = [f"tenant-{i}" for i in range(100_000)]
    random.Random(13).shuffle(tenants)
    hot_sets = [tenants[100 * phase : 100 * (phase + 1)] for phase in range(3)]
    for i, logical_id in enumerate(tenants):
        clock.now += 0.02  # 2,000 s in all
        record_request(metrics, logical_id)
        record_epoch_change(metrics, logical_id)
        hot = hot_sets[int(clock.now // 700)]
        record_request(metrics, hot[i % len(hot)], outcome="200" if i % 7 else "429")
    parsed = Exposition.parse(metrics.exposition())
    assert parsed.series <= MAX_SERIES, parsed.series
    assert parsed.size <= MAX_BYTES, parsed.size
    assert parsed.by_id == {
        "kvgate_requests",
        "kvgate_backend_prompt_tokens",
        "kvgate_backend_cached_tokens",
        "kvgate_epoch_changes",
        "kvgate_audit_verdicts",
    }
    assert all(parsed.families[name] == "counter" for name in parsed.by_id)
    requests = parsed.ids("kvgate_requests_total")
    assert set(hot_sets[2]) <= set(requests)  # promoted now
    assert set(hot_sets[1]) <= set(requests)  # promoted while hot, then frozen
    assert len(requests) == 2 * 100 + 1  # and other
    assert requests[OTHER] > 100_000
    assert parsed.samples["kvgate_request_duration_seconds_count"] == {(): 200_000}


async def test_a_running_kvgate_labels_its_real_traffic_by_the_top_k(
    redis: Redis, table: EpochTable, publish: Publish, store: AdapterStore, tmp_path: Path
) -> None:
    ids = [f"tenant-{i}" for i in range(8)]
    for i, logical_id in enumerate(ids):
        await publish(logical_id, f"weights-{i}".encode())
    async with running(build_stub(StubState())) as stub_url:
        settings = Settings(
            replicas=[stub_url], store=store.root, reconcile_interval=0.1, metrics_top_k=3,
            metrics_rerank_interval=3600, admin_token=TOKEN,
        )  # fmt: skip
        async with running(build_app(settings, redis)) as url, aiohttp.ClientSession() as http:

            async def scrape() -> Exposition:
                async with http.get(f"{url}/metrics", headers={"x-kvgate-admin-token": TOKEN}) as response:
                    return Exposition.parse(await response.read())

            for logical_id in [*ids, "tenant-0", "no-such-id"]:
                body = {"model": logical_id, "prompt": "p", "max_tokens": 1}
                async with http.post(f"{url}/v1/completions", json=body) as response:
                    assert response.status == (404 if logical_id == "no-such-id" else 200)
            await table.bump("tenant-7")  # not in the top 3: its epoch change counts under other

            async def bump_counted() -> bool:
                return (await scrape()).ids("kvgate_epoch_changes_total") == {OTHER: 1}

            await eventually(bump_counted, "the bump of tenant-7 is counted under other")
            parsed = await scrape()
    requests = parsed.ids("kvgate_requests_total")
    assert requests == {"tenant-0": 2, "tenant-1": 1, "tenant-2": 1, OTHER: 5, "unknown": 1}
    prompt_tokens = parsed.ids("kvgate_backend_prompt_tokens_total")
    assert set(prompt_tokens) == {"tenant-0", "tenant-1", "tenant-2", OTHER}
    assert parsed.by_id == {"kvgate_requests", "kvgate_backend_prompt_tokens", "kvgate_epoch_changes"}
    assert parsed.samples["kvgate_time_to_first_byte_seconds_count"] == {(): 9}
    assert parsed.samples["kvgate_request_duration_seconds_count"] == {(): 10}
    assert parsed.series <= 200, parsed.series
