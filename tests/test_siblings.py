"""The pieces that make any ``--workers`` worker answer for all: merging /metrics pages, and /healthz over
the workers' private unix sockets (real sockets, real ``Metrics`` registries)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from gateway.siblings import WORKERS_DIR, Siblings, parent_views
from gateway.telemetry.merge import merge_pages
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

    def health(self) -> tuple[dict[str, Any], bool]:
        return {"draining": not self.ready, "failing": [], "replicas_healthy": 1}, self.ready


async def test_any_worker_answers_for_all_a_not_ready_or_down_sibling_shows(tmp_path: Path) -> None:
    (tmp_path / WORKERS_DIR).mkdir()
    workers = [Siblings(tmp_path, slot, 3, restarts=slot) for slot in range(3)]
    views = [Views(ready=True), Views(ready=True), Views(ready=False)]
    parent: dict[str, Any] = {"pid": 1, "background": {"embedded-redis": {"state": "running"}}, "failing": []}
    async with contextlib.AsyncExitStack() as stack:
        body, ready = await workers[0].health(*views[0].health())
        assert not ready, "a parent that does not answer: not ready"
        assert body["parent"] == {"state": "not answering"}
        await stack.enter_async_context(parent_views(tmp_path, lambda: parent))
        for worker, view in zip(workers[:2], views[:2], strict=True):  # worker 2 is down
            await stack.enter_async_context(worker.serving(view.metrics.exposition, view.health))
        body, ready = await workers[0].health(*views[0].health())
        assert ready, "worker 2 is down: not live, so not counted against readiness"
        assert [w["state"] for w in body["workers"]] == ["ready", "ready", "down"]
        assert body["worker"]["slot"] == 0
        assert body["draining"] is False  # its own fields stay where one process has them
        assert body["background"]["embedded-redis"] == {"state": "running"}  # the parent's task joins them
        parent["failing"] = ["embedded-redis"]
        body, ready = await workers[1].health(*views[1].health())
        assert not ready, "a parent task that keeps failing makes every worker answer 503"
        assert body["failing"] == ["embedded-redis"]
        parent["failing"] = []
        await stack.enter_async_context(workers[2].serving(views[2].metrics.exposition, views[2].health))
        body, ready = await workers[0].health(*views[0].health())
        assert not ready, "a live worker that is not ready makes every worker answer 503"
        assert [(w["slot"], w["state"], w["restarts"]) for w in body["workers"]] == [
            (0, "ready", 0), (1, "ready", 1), (2, "not ready", 2),
        ]  # fmt: skip
        page = values(await workers[1].metrics(views[1].metrics.exposition()))
        assert page[("kvgate_requests_total", (("logical_id", "tenant-42"), ("outcome", "200")))] == 3
        assert page[("kvgate_workers_answering", ())] == 3
