"""A ``kvgate serve --workers N`` worker's siblings: whichever worker answers ``/metrics`` or ``/healthz``
answers for all of them.

Every worker serves its own views on a private unix socket, ``<data-dir>/workers/<slot>.sock`` (the
directory is the parent's, mode 0700, beside the embedded Redis's socket): ``/metrics`` its registry's
page, ``/healthz`` its own health body and readiness. The worker that a client reached answers with

- ``/metrics``: every worker's page merged (``telemetry/merge.py``: counters summed, gauges the
  largest), plus ``kvgate_workers_answering``, the number of fresh pages merged. The pages are not asked
  for: each worker writes its own to ``<slot>.prom`` every ``FLUSH_SECONDS`` (and when it answers a
  scrape), and the one that answers reads its siblings' files. So the merged counters never go down: a
  sibling that is slow or dead still counts what its file holds (its gauges only while the file is
  fresh), and a worker that takes over a slot carries its predecessor's counters on. A sum that dropped
  would read to Prometheus as a counter reset, whose ``rate()`` then counts every request again. (A worker
  killed between two writes takes at most ``FLUSH_SECONDS`` of counts with it, never shown.)
- ``/healthz`` (every sibling asked at once, bounded by ``ASK_TIMEOUT``): its own body (every field as
  with one process), plus ``worker`` (its slot and pid) and ``workers``, one entry per slot: its pid,
  readiness, draining, failing tasks and restarts, or ``"state": "down"`` when it did not answer (dead,
  or being restarted by the parent: it serves nobody), ``"starting"`` (503) when the parent says that
  slot's first worker has not served yet. Ready only if this worker and every worker that answered are
  ready. The parent's own supervised tasks (the embedded Redis) join ``background`` and ``failing``, and
  ``parent`` holds its answer (its socket is ``workers/parent.sock``): a parent task that keeps failing,
  or a parent that does not answer, makes every worker answer 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from aiohttp import web
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from gateway.core.atomic_file import write_atomically
from gateway.request.health import Health, Views, add_tasks
from gateway.tasks.supervisor import Supervisor, periodically
from gateway.telemetry.merge import counters_only, merge_pages
from gateway.telemetry.metrics import Metrics

log = logging.getLogger(__name__)
WORKERS_DIR = "workers"
ASK_TIMEOUT = 2.0  # seconds a sibling has to answer /healthz; a sibling that does not is reported down
FLUSH_SECONDS = 1.0  # how often a worker writes its /metrics page to its file
FRESH_SECONDS = 3 * FLUSH_SECONDS  # a page file older than this is a stopped worker's: its counters only
NOT_CARRIED = ("kvgate_worker_restarts",)  # the parent's count per slot, not a worker's own
LocalHealth = Callable[[], Health]


PARENT = "parent"


def socket_path(data_dir: Path, slot: int | str) -> Path:
    """Worker ``slot``'s private socket, or the parent's (``PARENT``)."""
    return data_dir / WORKERS_DIR / f"{slot}.sock"


def page_path(data_dir: Path, slot: int) -> Path:
    """Worker ``slot``'s last written ``/metrics`` page."""
    return data_dir / WORKERS_DIR / f"{slot}.prom"


def forget_pages(data_dir: Path) -> None:
    """A new parent's workers count from 0 (a process restart, which Prometheus reads as a reset)."""
    for stale in (data_dir / WORKERS_DIR).glob("*.prom"):
        _remove(stale)


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


def parent_health(supervisor: Supervisor, **fields: Any) -> dict[str, Any]:
    """The parent's answer: its supervised tasks (``background``, ``failing``) in both views of
    ``/healthz`` (``public``, ``detail``), and ``fields`` (pid, restarts, starting slots)."""
    views = Views()
    add_tasks(views, supervisor)
    return {**fields, "public": views.public, "detail": views.detail}


@contextlib.asynccontextmanager
async def parent_views(data_dir: Path, health: Callable[[], dict[str, Any]]) -> AsyncIterator[None]:
    """The parent's own health (``parent_health``: its supervised embedded Redis), for the workers'
    ``/healthz``: a failing parent task makes every worker answer 503."""

    async def answer(request: web.Request) -> web.Response:
        return web.Response(body=orjson.dumps(health()))

    async with serving_unix(socket_path(data_dir, PARENT), {"/healthz": answer}):
        yield


class Siblings:
    """Worker ``slot`` of ``count``; ``restarts``: how many times the parent restarted this slot."""

    def __init__(self, data_dir: Path, slot: int, count: int, restarts: int) -> None:
        self.data_dir, self.slot, self.count, self.restarts = data_dir, slot, count, restarts
        self.pid = os.getpid()
        self.carried = b""
        """The counters of this slot's earlier workers (the last page the one before wrote)."""

    def track(self, metrics: Metrics) -> None:
        """``kvgate_worker_restarts_total{worker}`` on this worker's page: its slot's restarts."""
        metrics.registry.register(_Restarts(str(self.slot), lambda: self.restarts))

    @contextlib.asynccontextmanager
    async def serving(
        self, metrics: Callable[[], bytes], health: LocalHealth, supervisor: Supervisor
    ) -> AsyncIterator[None]:
        """This worker's own views on its private socket, for its siblings, and its page in its file
        (``metrics-page``, a supervised task: a write that fails is retried, counted and on /healthz)."""
        self.carried = counters_only(_read(page_path(self.data_dir, self.slot)) or b"", NOT_CARRIED)

        async def page(request: web.Request) -> web.Response:
            return web.Response(body=self.page(metrics()))

        async def own_health(request: web.Request) -> web.Response:
            own = health()
            doc = {"public": own.public, "detail": own.detail, "ready": own.ready, **self._me()}
            return web.Response(body=orjson.dumps(doc))

        async def flush() -> None:
            async def step() -> None:
                self.write(metrics())

            await periodically(FLUSH_SECONDS, step)

        self.write(metrics())  # the slot's file holds this worker from its start

        routes = {"/metrics": page, "/healthz": own_health}
        async with (
            serving_unix(socket_path(self.data_dir, self.slot), routes),
            supervisor.run("metrics-page", flush, period=FLUSH_SECONDS),
        ):
            yield
        with contextlib.suppress(OSError):
            self.write(metrics())  # what it counted to the end (drained), for the slot's next worker

    def page(self, own: bytes) -> bytes:
        """This worker's page with its slot's earlier workers' counters in it."""
        return merge_pages([own, self.carried]) if self.carried else own

    def write(self, own: bytes) -> bytes:
        """``page(own)`` written to this slot's file (whole: a reader never sees half of one); returned."""
        page = self.page(own)
        # not fsynced: written on the event loop every second, read only by running workers
        write_atomically(page_path(self.data_dir, self.slot), page, durable=False)
        return page

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

    def metrics(self, own: bytes) -> bytes:
        """Every worker's page, merged: this one's as it is now (written first, so that no later scrape,
        whichever worker answers it, shows less), its siblings' from their files."""
        try:
            pages = [self.write(own)]
        except OSError as exc:  # the metrics-page task fails the same way, and says so on /healthz
            log.warning("worker %d could not write its metrics page: %r", self.slot, exc)
            pages = [self.page(own)]
        fresh = 1
        for slot in self._others():
            path = page_path(self.data_dir, slot)
            page, age = _read(path), _age(path)
            if page is not None and age <= FRESH_SECONDS:
                pages.append(page)
                fresh += 1
            elif page is not None:  # a stopped worker's: what it counted still counts
                pages.append(counters_only(page, NOT_CARRIED))
        count = (
            "# HELP kvgate_workers_answering Worker processes whose metrics this page sums\n"
            f"# TYPE kvgate_workers_answering gauge\nkvgate_workers_answering {fresh}.0\n"
        )
        return merge_pages(pages) + count.encode()

    async def health(self, own: Health) -> Health:
        """``own`` with the parent's tasks joined (``background``, ``failing``), ``worker``, ``workers``
        (each sibling's summary, from its public view) and ``parent``, in both views."""
        others = list(self._others())
        answers = await asyncio.gather(
            self._ask(PARENT, "/healthz"), *(self._ask(slot, "/healthz") for slot in others)
        )
        parent = _parse(answers[0])
        more: list[str] = []  # why not ready, beyond this worker's own reasons
        views = {"public": dict(own.public), "detail": dict(own.detail)}
        for name, body in views.items():
            theirs = parent.get(name, {}) if parent is not None else {}
            body["background"] = {**body.get("background", {}), **theirs.get("background", {})}
            body["failing"] = [*body.get("failing", []), *theirs.get("failing", [])]
        if parent is None:  # alive while this worker is (it dies with it), so it should answer
            more.append("the workers' parent does not answer")
        else:
            more += [
                f"background task {name} keeps failing"
                for name in parent.get("public", {}).get("failing", [])
            ]
        workers = {self.slot: {**self._me(), **_summary(own.public, own.ready)}}
        for slot, answer in zip(others, answers[1:], strict=True):
            doc = _parse(answer)
            if doc is None:
                starting = parent is not None and slot in parent.get("starting", [])  # serve is not up yet
                workers[slot] = {"slot": slot, "state": "starting" if starting else "down"}
                if starting:
                    more.append(f"worker {slot} is starting")
                continue
            body = doc["public"] if isinstance(doc.get("public"), dict) else {}
            named = {key: doc.get(key) for key in ("slot", "pid", "restarts")}
            workers[slot] = {**named, **_summary(body, doc.get("ready") is True)}
            if doc.get("ready") is not True:
                more.append(f"worker {slot} is not ready")
        about = {
            "worker": self._me(),
            "workers": [workers[slot] for slot in sorted(workers)],
            "unready": [*own.public.get("unready", []), *more],
        }
        public: dict[str, Any] = {"state": "not answering"}
        detail = public
        if parent is not None:
            public = {key: parent.get(key) for key in ("pid", "starting")}
            detail = {key: value for key, value in parent.items() if key not in ("public", "detail")}
        return Health(
            own.ready and not more,
            {**views["public"], **about, "parent": public},
            {**views["detail"], **about, "parent": detail},
        )


def _summary(body: dict[str, Any], ready: bool) -> dict[str, Any]:
    return {
        "state": "ready" if ready else "not ready",
        "draining": body.get("draining"),
        "failing": body.get("failing"),
        "replicas_healthy": body.get("replicas_healthy"),
    }


def _read(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None


def _age(path: Path) -> float:
    """Seconds since ``path`` was written (infinite when there is none)."""
    try:
        return time.time() - path.stat().st_mtime
    except FileNotFoundError:
        return math.inf


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
