"""A ``kvgate serve --workers N`` worker's siblings: whichever worker answers ``/metrics`` or ``/healthz``
answers for all of them.

Every worker serves its own views on a private unix socket, ``<data-dir>/workers/<slot>.sock`` (the
directory is the parent's, mode 0700, beside the embedded Redis's socket): ``/metrics`` its registry's
page, ``/healthz`` its own health body and readiness. The worker that a client reached asks every sibling
at once (bounded by ``ASK_TIMEOUT``) and answers with

- ``/metrics``: its page and the siblings' merged (``telemetry/merge.py``: counters summed, gauges the
  largest), plus ``kvgate_workers_answering``, the number of pages merged;
- ``/healthz``: its own body (every field as with one process), plus ``worker`` (its slot and pid) and
  ``workers``, one entry per slot: its pid, readiness, draining, failing tasks and restarts, or
  ``"state": "down"`` when it did not answer (dead, or being restarted by the parent: it serves nobody),
  ``"starting"`` (503) when the parent says that slot's first worker has not served yet.
  Ready only if this worker and every worker that answered are ready. The parent's own supervised
  tasks (the embedded Redis) join ``background`` and ``failing``, and ``parent`` holds its answer (its
  socket is ``workers/parent.sock``): a parent task that keeps failing, or a parent that does not
  answer, makes every worker answer 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from aiohttp import web
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from gateway.telemetry.merge import merge_pages
from gateway.telemetry.metrics import Metrics

WORKERS_DIR = "workers"
ASK_TIMEOUT = 2.0  # seconds a sibling has to answer; a sibling that does not is reported down
LocalHealth = Callable[[], tuple[dict[str, Any], bool]]


PARENT = "parent"


def socket_path(data_dir: Path, slot: int | str) -> Path:
    """Worker ``slot``'s private socket, or the parent's (``PARENT``)."""
    return data_dir / WORKERS_DIR / f"{slot}.sock"


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@contextlib.asynccontextmanager
async def serving_unix(path: Path, routes: Mapping[str, Handler]) -> AsyncIterator[None]:
    """GET ``routes`` on the unix socket ``path`` (a previous process's socket there is replaced)."""
    app = web.Application()
    for route, handler in routes.items():
        app.router.add_get(route, handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    _remove(path)
    await web.UnixSite(runner, str(path)).start()
    try:
        yield
    finally:
        await runner.cleanup()
        _remove(path)


def _remove(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


@contextlib.asynccontextmanager
async def parent_views(data_dir: Path, health: Callable[[], dict[str, Any]]) -> AsyncIterator[None]:
    """The parent's own health (its supervised embedded Redis: ``background``, ``failing``), for the
    workers' ``/healthz``: a failing parent task makes every worker answer 503."""

    async def answer(request: web.Request) -> web.Response:
        return web.Response(body=orjson.dumps(health()))

    async with serving_unix(socket_path(data_dir, PARENT), {"/healthz": answer}):
        yield


class Siblings:
    """Worker ``slot`` of ``count``; ``restarts``: how many times the parent restarted this slot."""

    def __init__(self, data_dir: Path, slot: int, count: int, restarts: int) -> None:
        self.data_dir, self.slot, self.count, self.restarts = data_dir, slot, count, restarts
        self.pid = os.getpid()

    def track(self, metrics: Metrics) -> None:
        """``kvgate_worker_restarts_total{worker}`` on this worker's page: its slot's restarts."""
        metrics.registry.register(_Restarts(str(self.slot), lambda: self.restarts))

    @contextlib.asynccontextmanager
    async def serving(self, metrics: Callable[[], bytes], health: LocalHealth) -> AsyncIterator[None]:
        """This worker's own views on its private socket, for its siblings."""

        async def page(request: web.Request) -> web.Response:
            return web.Response(body=metrics())

        async def own_health(request: web.Request) -> web.Response:
            body, ready = health()
            return web.Response(body=orjson.dumps({"body": body, "ready": ready, **self._me()}))

        routes = {"/metrics": page, "/healthz": own_health}
        async with serving_unix(socket_path(self.data_dir, self.slot), routes):
            yield

    def _me(self) -> dict[str, Any]:
        return {"slot": self.slot, "pid": self.pid, "restarts": self.restarts}

    def _others(self) -> Iterator[int]:
        return (slot for slot in range(self.count) if slot != self.slot)

    async def _ask(self, slot: int | str, path: str) -> bytes | None:
        connector = aiohttp.UnixConnector(path=str(socket_path(self.data_dir, slot)))
        timeout = aiohttp.ClientTimeout(total=ASK_TIMEOUT)
        try:
            async with (
                aiohttp.ClientSession(connector=connector, timeout=timeout) as session,
                session.get(f"http://worker{path}") as answer,
            ):
                return await answer.read() if answer.status == 200 else None
        except (TimeoutError, aiohttp.ClientError, OSError):
            return None

    async def metrics(self, own: bytes) -> bytes:
        pages = [page for page in await asyncio.gather(*(self._ask(s, "/metrics") for s in self._others()))]
        answered = [own, *(page for page in pages if page is not None)]
        count = (
            "# HELP kvgate_workers_answering Worker processes whose metrics this page sums\n"
            f"# TYPE kvgate_workers_answering gauge\nkvgate_workers_answering {len(answered)}.0\n"
        )
        return merge_pages(answered) + count.encode()

    async def health(self, own: dict[str, Any], ready: bool) -> tuple[dict[str, Any], bool]:
        others = list(self._others())
        answers = await asyncio.gather(
            self._ask(PARENT, "/healthz"), *(self._ask(slot, "/healthz") for slot in others)
        )
        parent = _parse(answers[0])
        if parent is None:  # alive while this worker is (it dies with it), so it should answer
            parent, ready = {"state": "not answering"}, False
        else:
            own = {**own, "background": {**own.get("background", {}), **parent.get("background", {})}}
            own["failing"] = [*own.get("failing", []), *parent.get("failing", [])]
            ready = ready and not parent.get("failing")
        workers = {self.slot: {**self._me(), **_summary(own, ready)}}
        for slot, answer in zip(others, answers[1:], strict=True):
            doc = _parse(answer)
            if doc is None:
                starting = slot in parent.get("starting", [])  # its first start: serve is not up yet
                workers[slot] = {"slot": slot, "state": "starting" if starting else "down"}
                ready = ready and not starting
                continue
            sibling_ready = doc.get("ready") is True
            body = doc["body"] if isinstance(doc.get("body"), dict) else {}
            named = {key: doc.get(key) for key in ("slot", "pid", "restarts")}
            workers[slot] = {**named, **_summary(body, sibling_ready)}
            ready = ready and sibling_ready
        listed = [workers[slot] for slot in sorted(workers)]
        return {**own, "worker": self._me(), "workers": listed, "parent": parent}, ready


def _summary(body: dict[str, Any], ready: bool) -> dict[str, Any]:
    return {
        "state": "ready" if ready else "not ready",
        "draining": body.get("draining"),
        "failing": body.get("failing"),
        "replicas_healthy": body.get("replicas_healthy"),
    }


def _parse(answer: bytes | None) -> dict[str, Any] | None:
    if answer is None:
        return None
    try:
        doc = orjson.loads(answer)
    except orjson.JSONDecodeError:
        return None
    return doc if isinstance(doc, dict) else None


class _Restarts(Collector):
    def __init__(self, slot: str, count: Callable[[], int]) -> None:
        self.slot, self.count = slot, count

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            "kvgate_worker_restarts", "Times the parent restarted a worker that died, by worker slot",
            labels=["worker"],
        )  # fmt: skip
        family.add_metric([self.slot], self.count())
        yield family
