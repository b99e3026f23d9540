"""``kvgate serve --workers N``: the parent process of N workers serving one port (docs/workers.md).

The parent binds the API listener (and the admin listener, when ``admin_port`` is set) once and passes the
listening sockets to every worker it starts (``python -m gateway.process.worker``): the workers accept from
the one kernel queue, so a worker that dies or is starting loses no connection (its siblings take them), and
``--port 0`` is one port for all. The parent serves no request. It owns the embedded Redis (and supervises
it, as one-process serve does), starts the workers once it answers, restarts a worker that exits (logged;
the new one reports ``kvgate_worker_restarts_total``), and on SIGTERM or SIGINT sends SIGTERM to every
worker, which drains as one process does (``/healthz`` 503, running requests finish within
``shutdown_timeout``), then exits 0. A slot whose worker keeps dying soon after it starts, for more than
``background_failure_limit`` restarts in a row, ends the whole serve (exit 1): never up and wrong.

Each worker is a full kvgate (its own snapshot, change-log follower, replica poller, leases under its own
gateway id); ``siblings.py`` makes any of them answer ``/metrics`` and ``/healthz`` for all of them. The
KV events are followed once, by the KV indexer the parent keeps (``process/indexer.py``), into a table in
shared memory every worker reads (``kv/shared_index.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from opentelemetry.sdk.trace import TracerProvider

from gateway.cli.table_access import open_table
from gateway.core.errors import BadRequest, KvgateError
from gateway.kv.indexer import page_path
from gateway.kv.shared_index import create, region_tag
from gateway.process.http_edge import BACKLOG
from gateway.process.indexer import kept_indexer
from gateway.process.siblings import WORKERS_DIR, Siblings, forget_pages, parent_health, parent_views
from gateway.settings.model import Settings
from gateway.tasks.backoff import Backoff
from gateway.tasks.supervisor import Supervisor

log = logging.getLogger("gateway.process.parent")

STEADY_S = 30.0  # a worker that lived this long was not crash-looping: restarted at once, its backoff reset
RESTART_FIRST_S, RESTART_MAX_S = 0.5, 5.0  # the backoff of a slot whose worker keeps dying soon after start
KILL_AFTER_S = 10.0  # beyond shutdown_timeout: a worker still running then is killed


@dataclass(frozen=True)
class WorkerPlace:
    """What a worker got from its parent: its listening sockets and its siblings."""

    api: socket.socket
    admin: socket.socket | None
    siblings: Siblings
    ready_fd: int | None = None  # written once the worker serves (then closed): its start succeeded
    kv_index_fd: int | None = None  # the shared KV index the parent's indexer writes (kv_events on)

    def serving(self) -> None:
        if self.ready_fd is not None:
            with contextlib.suppress(OSError):
                os.write(self.ready_fd, b"1")
                os.close(self.ready_fd)
            object.__setattr__(self, "ready_fd", None)


CPU_MAX = Path("/sys/fs/cgroup/cpu.max")  # cgroup v2: "QUOTA PERIOD" or "max PERIOD"


def worker_count(settings: Settings, cpu_max: Path = CPU_MAX) -> int:
    """``workers``, else one per core this process may run on: its CPU affinity, bounded by its cgroup's
    CPU quota when it has one (a container limited to 2 CPUs on a 64-core node gets 2 workers, not 64)."""
    if settings.workers is not None:
        return settings.workers
    cores = len(os.sched_getaffinity(0))
    with contextlib.suppress(OSError, ValueError):
        quota, period = cpu_max.read_text().split()[:2]
        if quota != "max":
            cores = min(cores, math.ceil(int(quota) / int(period)))
    return max(1, cores)


def embedded_redis_url(settings: Settings) -> str:
    """The URL the workers reach their parent's embedded Redis by (its socket in the data directory)."""
    return f"unix://{settings.data_dir / 'redis' / 'redis.sock'}"


def for_worker(settings: Settings, slot: int) -> Settings:
    """A worker's settings: the parent's embedded Redis by its socket (the worker never owns it), and a
    gateway id of its own (leases are per gateway: siblings must not let go of each other's)."""
    update: dict[str, object] = {}
    if settings.redis_url is None:
        update["redis_url"] = embedded_redis_url(settings)
    if settings.gateway_id:
        update["gateway_id"] = f"{settings.gateway_id}-w{slot}"
    return settings.model_copy(update=update)


def listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket the workers inherit."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(address)
    sock.listen(BACKLOG)
    sock.set_inheritable(True)
    return sock


def _url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://{host}:{port}"


class Workers:
    """N worker processes, each restarted when it exits, until ``stop``."""

    def __init__(
        self,
        settings: Settings,
        count: int,
        argv: list[str],
        api: socket.socket,
        admin: socket.socket | None,
        kv_index: int | None = None,
    ) -> None:
        self.settings, self.count, self.argv, self.api, self.admin = settings, count, argv, api, admin
        self.kv_index = kv_index
        self.processes: dict[int, asyncio.subprocess.Process] = {}
        self.restarts = dict.fromkeys(range(count), 0)
        self.served: set[int] = set()  # slots whose worker has served once (until then /healthz is 503)
        self.stopping = False
        self.fatal: asyncio.Future[KvgateError] = asyncio.get_running_loop().create_future()

    async def _start(self, slot: int) -> tuple[asyncio.subprocess.Process, int]:
        """A worker for ``slot``, and the read end of its readiness pipe."""
        ready_read, ready_write = os.pipe()
        fds = [self.api.fileno(), ready_write, *([self.admin.fileno()] if self.admin else [])]
        kv_index = [] if self.kv_index is None else ["--kv-index-fd", str(self.kv_index)]
        command = [sys.executable, "-m", "gateway.process.worker", "--slot", str(slot),
                   "--count", str(self.count), "--restarts", str(self.restarts[slot]),
                   "--parent", str(os.getpid()),
                   "--api-fd", str(fds[0]), "--ready-fd", str(ready_write),
                   *(["--admin-fd", str(fds[2])] if self.admin else []), *kv_index,
                   "--", *self.argv]  # fmt: skip
        try:
            process = await asyncio.create_subprocess_exec(
                *command,
                pass_fds=[*fds, *([] if self.kv_index is None else [self.kv_index])],
                stdin=asyncio.subprocess.DEVNULL,
            )
        finally:
            os.close(ready_write)
        self.processes[slot] = process
        log.info("worker %d started (pid %d)", slot, process.pid)
        os.set_blocking(ready_read, False)
        asyncio.get_running_loop().add_reader(ready_read, self._ready, slot, ready_read)
        return process, ready_read

    def _ready(self, slot: int, fd: int) -> None:
        with contextlib.suppress(OSError):
            if os.read(fd, 1) == b"1":
                self.served.add(slot)
        asyncio.get_running_loop().remove_reader(fd)  # a byte or the end: nothing more comes

    def _fail(self, error: KvgateError) -> None:
        if not self.fatal.done():
            self.fatal.set_result(error)

    async def keep(self, slot: int) -> None:
        """Slot ``slot``'s worker, restarted whenever it exits until ``stop``."""
        backoff, served = Backoff(RESTART_FIRST_S, RESTART_MAX_S), False
        while not self.stopping:
            began = time.monotonic()
            process, ready = await self._start(slot)
            code = await process.wait()
            asyncio.get_running_loop().remove_reader(ready)
            with contextlib.suppress(OSError):
                if os.read(ready, 1) == b"1":
                    self.served.add(slot)
            os.close(ready)
            served = slot in self.served
            if self.stopping:
                return
            if not served:  # this slot never served: its start fails, as one process's would (config)
                why = f"worker {slot} could not start ({_exit_text(code)}; its error is above)"
                self._fail(BadRequest(why) if code == 2 else KvgateError(why))
                return
            steady = time.monotonic() - began >= STEADY_S
            if steady:
                backoff.reset()
            wait = 0.0 if steady else backoff.next()
            self.restarts[slot] += 1
            log.warning(
                "worker %d (pid %d) exited with %s; restarting it (restart %d of this slot)",
                slot, process.pid, _exit_text(code), self.restarts[slot],
            )  # fmt: skip
            if backoff.failures > self.settings.background_failure_limit:
                self._fail(
                    KvgateError(
                        f"worker {slot} keeps exiting soon after it starts ({backoff.failures} in a row)"
                    )
                )
                return
            await asyncio.sleep(wait)

    async def stop(self) -> None:
        """SIGTERM to every worker (each drains); the ones still running after the drain's time are killed."""
        self.stopping = True
        running = [p for p in self.processes.values() if p.returncode is None]
        for process in running:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
        waits = [asyncio.ensure_future(process.wait()) for process in running]
        if not waits:
            return
        _, late = await asyncio.wait(waits, timeout=self.settings.shutdown_timeout + KILL_AFTER_S)
        for process in running:
            if process.returncode is None:
                log.warning("worker pid %d did not stop after its drain: killed", process.pid)
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
        if late:
            await asyncio.wait(late)


def _exit_text(code: int) -> str:
    return f"signal {signal.Signals(-code).name}" if code < 0 else f"code {code}"


async def run_workers(
    settings: Settings, tracing: TracerProvider | None, count: int, argv: list[str]
) -> None:
    api = listen(settings.host, settings.port)
    admin = listen(settings.admin_host, settings.admin_port) if settings.admin_port is not None else None
    directory = settings.data_dir / WORKERS_DIR
    directory.mkdir(parents=True, exist_ok=True)
    directory.chmod(0o700)  # the workers' private sockets
    forget_pages(settings.data_dir)
    supervisor = Supervisor(failure_limit=settings.background_failure_limit)  # the embedded Redis's
    restarts: dict[int, int] = {}
    served: set[int] = set()

    def health() -> dict[str, Any]:
        return parent_health(supervisor, pid=os.getpid(), starting=sorted(set(restarts) - served),
                             restarts={str(slot): count for slot, count in restarts.items()})  # fmt: skip

    kv_index = create(settings.precise_index_entries, settings.replicas) if settings.kv_events else None
    async with (
        open_table(settings, tracing, supervisor=supervisor),  # this process owns the embedded Redis
        parent_views(settings.data_dir, health),
        contextlib.AsyncExitStack() as indexer,
    ):
        if kv_index is not None:  # the KV events followed once for every worker
            await indexer.enter_async_context(kept_indexer(
                kv_index, settings.replicas, settings.kv_event_endpoints, settings.precise_index_entries,
                page_path(settings.data_dir, region_tag(kv_index, settings.replicas)),
                failure_limit=settings.background_failure_limit,
            ))  # fmt: skip
        log.info("kvgate listening on %s (%d workers, parent pid %d)", _url(api), count, os.getpid())
        if admin is not None:
            log.info("admin listener on %s", _url(admin))
        workers = Workers(settings, count, argv, api, admin, kv_index)
        restarts, served = workers.restarts, workers.served
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        slots = [asyncio.ensure_future(workers.keep(slot)) for slot in range(count)]
        waits: list[asyncio.Future[Any]] = [asyncio.ensure_future(stop.wait())]
        waits.append(asyncio.ensure_future(supervisor.wait_fatal()))
        waits.append(workers.fatal)
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        await workers.stop()
        failed = workers.fatal.result() if workers.fatal.done() else None
        if supervisor.fatal_reason is not None:
            failed = KvgateError(f"stopped: {supervisor.fatal_reason}")
        for task in [*waits, *slots]:
            task.cancel()
        await asyncio.gather(*slots, return_exceptions=True)
    api.close()
    if admin is not None:
        admin.close()
    if kv_index is not None:
        os.close(kv_index)
    if failed is not None:
        raise failed
