"""The pieces that make any ``--workers`` worker answer for all: merging /metrics pages, and /healthz over
the workers' private unix sockets (real sockets, real ``Metrics`` registries)."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from gateway.process.siblings import FRESH_SECONDS, WORKERS_DIR, Siblings, page_path, parent_views
from gateway.request.health import Health
from gateway.tasks.supervisor import Supervisor
from gateway.telemetry.merge import counters_only, merge_pages
from gateway.telemetry.metrics import Metrics


def values(page: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample, as the Prometheus parser reads it (the merged page must parse)."""
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(page.decode())
        for sample in family.samples
    }


def worker_metrics(requests: int, lag: float, only_here: str | None = None) -> Metrics:
    metrics = Metrics()
    for _ in range(requests):
        metrics.requests.labels(metrics.for_request("tenant-42"), "200").inc()
        metrics.latency.observe(0.02)
    metrics.kv_event_lag.labels("http://r0").set(lag)
    if only_here:
        metrics.unloads.labels(only_here, "idle").inc()
    return metrics


def test_counters_and_histograms_sum_gauges_take_the_largest_and_one_worker_series_stay() -> None:
    first, second = worker_metrics(3, lag=0.5), worker_metrics(4, lag=2.0, only_here="http://r1")
    merged = values(merge_pages([first.exposition(), second.exposition()]))
    assert merged[("kvgate_requests_total", (("logical_id", "tenant-42"), ("outcome", "200")))] == 7
    assert merged[("kvgate_request_duration_seconds_count", ())] == 7
    assert merged[("kvgate_request_duration_seconds_bucket", (("le", "0.025"),))] == 7
    assert merged[("kvgate_request_duration_seconds_bucket", (("le", "0.01"),))] == 0
    assert merged[("kvgate_kv_event_lag_seconds", (("replica", "http://r0"),))] == 2.0
    assert merged[("kvgate_adapter_unloads_total", (("reason", "idle"), ("replica", "http://r1")))] == 1
    created = ("kvgate_request_duration_seconds_created", ())
    assert merged[created] == min(values(first.exposition())[created], values(second.exposition())[created])
    assert merge_pages([first.exposition()]) == first.exposition()  # one page passes through unchanged


class Views:
    """A worker's own views, as its app would give them."""

    def __init__(self, ready: bool) -> None:
        self.ready, self.metrics = ready, worker_metrics(1, lag=0.0)

    def health(self) -> Health:
        body = {"draining": not self.ready, "failing": [], "replicas_healthy": 1, "unready": []}
        return Health(self.ready, body, {**body, "secret": "detail only"})


async def test_any_worker_answers_for_all_a_not_ready_or_down_sibling_shows(tmp_path: Path) -> None:
    (tmp_path / WORKERS_DIR).mkdir()
    workers = [Siblings(tmp_path, slot, 3, restarts=slot) for slot in range(3)]
    views = [Views(ready=True), Views(ready=True), Views(ready=False)]
    tasks: dict[str, Any] = {"background": {"embedded-redis": {"state": "running"}}, "failing": []}
    parent: dict[str, Any] = {"pid": 1, "public": tasks, "detail": tasks}
    async with contextlib.AsyncExitStack() as stack:
        merged = await workers[0].health(views[0].health())
        assert not merged.ready, "a parent that does not answer: not ready"
        assert merged.public["parent"] == {"state": "not answering"}
        assert merged.public["unready"] == ["the workers' parent does not answer"]
        await stack.enter_async_context(parent_views(tmp_path, lambda: parent))
        for worker, view in zip(workers[:2], views[:2], strict=True):  # worker 2 is down
            await stack.enter_async_context(
                worker.serving(view.metrics.exposition, view.health, Supervisor())
            )
        merged = await workers[0].health(views[0].health())
        body = merged.public
        assert merged.ready, "worker 2 is down: not live, so not counted against readiness"
        assert [w["state"] for w in body["workers"]] == ["ready", "ready", "down"]
        assert body["worker"]["slot"] == 0
        assert body["draining"] is False  # its own fields stay where one process has them
        assert body["background"]["embedded-redis"] == {"state": "running"}  # the parent's task joins them
        assert "secret" not in body, "the public view"
        assert merged.detail["secret"] == "detail only", "the detail view"
        tasks["failing"] = ["embedded-redis"]
        merged = await workers[1].health(views[1].health())
        assert not merged.ready, "a parent task that keeps failing makes every worker answer 503"
        assert merged.public["failing"] == ["embedded-redis"]
        tasks["failing"] = []
        await stack.enter_async_context(
            workers[2].serving(views[2].metrics.exposition, views[2].health, Supervisor())
        )
        merged = await workers[0].health(views[0].health())
        assert not merged.ready, "a live worker that is not ready makes every worker answer 503"
        assert merged.public["unready"] == ["worker 2 is not ready"]
        assert [(w["slot"], w["state"], w["restarts"]) for w in merged.public["workers"]] == [
            (0, "ready", 0), (1, "ready", 1), (2, "not ready", 2),
        ]  # fmt: skip
        page = values(workers[1].metrics(views[1].metrics.exposition()))
        assert page[("kvgate_requests_total", (("logical_id", "tenant-42"), ("outcome", "200")))] == 3
        assert page[("kvgate_workers_answering", ())] == 3


REQUESTS = ("kvgate_requests_total", (("logical_id", "tenant-42"), ("outcome", "200")))
LAG = ("kvgate_kv_event_lag_seconds", (("replica", "http://r0"),))


async def test_merged_counters_never_drop_when_a_worker_stops_or_its_slot_restarts(tmp_path: Path) -> None:
    """What a scrape showed, a later one shows at least: a stopped worker's last page still counts (its
    gauges do not), and the worker that takes over its slot carries its counters on."""
    (tmp_path / WORKERS_DIR).mkdir()
    first, second = Siblings(tmp_path, 0, 2, restarts=0), Siblings(tmp_path, 1, 2, restarts=0)
    ones, twos = worker_metrics(3, lag=9.0), worker_metrics(4, lag=1.0)
    first.track(ones)
    async with first.serving(ones.exposition, lambda: Health(True, {}, {}), Supervisor()):
        before = values(second.metrics(twos.exposition()))
    assert (before[REQUESTS], before[LAG], before[("kvgate_workers_answering", ())]) == (7, 9.0, 2)
    old = time.time() - FRESH_SECONDS - 1
    os.utime(page_path(tmp_path, 0), (old, old))  # worker 0 died and nothing took its slot yet
    stopped = values(second.metrics(twos.exposition()))
    assert (stopped[REQUESTS], stopped[LAG], stopped[("kvgate_workers_answering", ())]) == (7, 1.0, 1)
    successor, fresh = Siblings(tmp_path, 0, 2, restarts=1), worker_metrics(1, lag=0.0)
    successor.track(fresh)
    async with successor.serving(fresh.exposition, lambda: Health(True, {}, {}), Supervisor()):
        after = values(successor.metrics(fresh.exposition()))
    assert after[REQUESTS] == 3 + 4 + 1, "the successor carries worker 0's 3 on"
    assert after[("kvgate_worker_restarts_total", (("worker", "0"),))] == 1, "the parent's count, not carried"


def test_what_a_stopped_worker_still_counts_is_its_counters_and_histograms() -> None:
    page = worker_metrics(2, lag=5.0, only_here="http://r1").exposition()
    kept = values(counters_only(page, ("kvgate_adapter_unloads",)))
    assert kept[REQUESTS] == 2
    assert kept[("kvgate_request_duration_seconds_count", ())] == 2
    assert LAG not in kept
    assert not any(name.startswith("kvgate_adapter_unloads") for name, _ in kept)
    assert counters_only(b"") == b""
