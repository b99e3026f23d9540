"""Every background loop of a running kvgate survives any exception: restarted, counted, on /healthz.

A running app (stub replica, the session's real redis-server) with one loop's step made to raise
``RuntimeError`` a few times (``Flaky``, patched in before the app starts and armed once it serves):
the loop's work happens again, ``kvgate_background_restarts_total{task}`` counts the restarts and
``/healthz`` shows the task running again with its last error. A step that keeps failing makes
``/healthz`` answer 503 naming the task, and 200 once it runs again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import signal
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from redis.asyncio import Redis

from gateway.adapters.publish import publish_adapter
from gateway.adapters.store import AdapterStore
from gateway.app.keys import PURGER
from gateway.app.wiring import build_app
from gateway.fleet.invalidation import PurgeAll
from gateway.fleet.leases import Leases
from gateway.fleet.loader import AdapterLoader
from gateway.fleet.replicas import ReplicaPool
from gateway.process.http_edge import free_port, running
from gateway.proof.canary import Canary
from gateway.settings.model import Settings
from gateway.table.callers import CallerSync
from gateway.table.epoch_table import EpochTable
from gateway.table.redis_server import EmbeddedRedis, redis_servers_in
from gateway.table.snapshot import SnapshotSync
from gateway.tasks.supervisor import Supervisor, periodically
from tests.support.adapter_files import MakeAdapter
from tests.support.conditions import eventually, until_healthy
from tests.support.stub_backend import StubState, build_stub

FAST = {"poll_interval": 0.1, "reconcile_interval": 0.1, "lease_ttl": 0.4, "canary_interval": 0.1}
TOKEN = "supervisor-admin-token"  # /metrics on the public listener takes the admin token


class Flaky:
    """Wraps a method: once ``arm``ed, its next ``failures`` calls raise RuntimeError; the rest run it."""

    def __init__(self, method: Callable[..., Awaitable[Any]]) -> None:
        self.method = method
        self.failures = 0
        self.failed = 0
        self.passed = 0  # calls run through after the last injected failure

    def arm(self, failures: int) -> None:
        self.failures, self.failed, self.passed = failures, 0, 0

    def install(self, monkeypatch: pytest.MonkeyPatch, owner: type, name: str) -> None:
        async def flaky(*args: Any, **kwargs: Any) -> Any:
            if self.failed < self.failures:
                self.failed += 1
                raise RuntimeError(f"injected failure {self.failed}")
            result = await self.method(*args, **kwargs)
            if self.failures:
                self.passed += 1
            return result

        monkeypatch.setattr(owner, name, flaky)


@dataclass
class Loop:
    task: str  # its name under the supervisor
    owner: type
    step: str  # the method the loop runs each time
    settings: dict[str, Any]


LOOPS = [
    Loop("replica-poll", ReplicaPool, "refresh_all", {}),
    Loop("api-key-sync", CallerSync, "reload", {"auth": "api-keys", "auth_max_staleness": 5}),
    Loop("leases-heartbeat", Leases, "heartbeat", {}),
    Loop("adapter-sweep", AdapterLoader, "sweep", {}),
    Loop("snapshot-sync", SnapshotSync, "heartbeat", {}),
    Loop("canary", Canary, "run_round", {}),
    Loop("purger", PurgeAll, "_drain", {"invalidation": "purge-all"}),
]


@asynccontextmanager
async def kvgate(redis: Redis, **overrides: Any) -> AsyncIterator[tuple[str, web.Application, StubState]]:
    state = StubState()
    async with running(build_stub(state)) as stub_url:
        app = build_app(Settings(replicas=[stub_url], admin_token=TOKEN, **(FAST | overrides)), redis)
        async with running(app) as url:
            yield url, app, state


async def health(url: str) -> tuple[int, dict[str, Any]]:
    """``/healthz``'s detail view (the admin token): the tasks' errors and the failing ones' reasons."""
    headers = {"x-kvgate-admin-token": TOKEN}
    async with aiohttp.ClientSession() as http, http.get(f"{url}/healthz", headers=headers) as response:
        doc: dict[str, Any] = await response.json()
        return response.status, doc


async def restarts_metric(url: str, task: str) -> float:
    headers = {"x-kvgate-admin-token": TOKEN}
    async with aiohttp.ClientSession() as http, http.get(f"{url}/metrics", headers=headers) as response:
        text = await response.text()
    found = re.search(rf'^kvgate_background_restarts_total{{task="{task}"}} (\S+)$', text, re.M)
    return float(found.group(1)) if found else -1.0


@pytest.mark.parametrize("loop", LOOPS, ids=[loop.task for loop in LOOPS])
async def test_a_loop_that_raises_is_restarted_counted_and_shown(
    loop: Loop, redis: Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    flaky = Flaky(getattr(loop.owner, loop.step))
    flaky.install(monkeypatch, loop.owner, loop.step)
    async with kvgate(redis, **loop.settings) as (url, app, stub):
        flaky.arm(3)
        if loop.task == "purger":  # it acts on a change: one per attempt
            purger = app[PURGER]

            async def purged() -> bool:
                purger.changed("tenant-x")
                return stub.resets > 0 and flaky.passed >= 2

            await eventually(purged, "the purger purges again after its failures")
        await eventually(lambda: flaky.failed == 3, f"{loop.task} failed 3 times")
        listings = stub.listings
        await eventually(lambda: flaky.passed >= 2, f"{loop.task} runs its step again")
        if loop.task == "replica-poll":
            await eventually(lambda: stub.listings > listings, "the replica gets listing requests again")

        async def shown() -> bool:
            status, doc = await health(url)
            task = doc["background"][loop.task]
            return status == 200 and task["state"] == "running" and task["restarts"] >= 2

        await eventually(shown, f"/healthz shows {loop.task} running again")
        _, doc = await health(url)
        task = doc["background"][loop.task]
        assert task["last_error"]["type"] == "RuntimeError"  # a task group's sub-loop: its own error
        assert re.fullmatch(r"injected failure [23]", task["last_error"]["message"])
        assert doc["failing"] == []
        # two sub-loops of one task group may fail at once: one restart
        assert await restarts_metric(url, loop.task) == task["restarts"] >= 2


async def test_a_task_that_keeps_failing_makes_healthz_503_with_the_reason_then_200(
    redis: Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    flaky = Flaky(ReplicaPool.refresh_all)
    flaky.install(monkeypatch, ReplicaPool, "refresh_all")
    async with kvgate(redis) as (url, _, stub):
        assert (await health(url))[0] == 200
        flaky.arm(10**9)

        async def unready() -> bool:
            return (await health(url))[0] == 503

        await eventually(unready, "/healthz answers 503 while the replica poll keeps failing")
        status, doc = await health(url)
        assert status == 503
        (reason,) = doc["failing"]
        assert reason.startswith("background task replica-poll has been failing for ")
        assert "RuntimeError: injected failure" in reason
        assert doc["background"]["replica-poll"]["failing_for_s"] >= 0.5  # 5 periods of 0.1 s
        assert doc["replicas_healthy"] == 1, "only the failing task makes it unready"

        flaky.failures = flaky.failed  # the step works again
        listings = stub.listings

        async def ready() -> bool:
            status, doc = await health(url)
            return status == 200 and doc["failing"] == [] and stub.listings > listings

        await eventually(ready, "/healthz answers 200 once the poll runs again", within=15)


async def test_serve_exits_1_when_its_embedded_redis_cannot_be_restarted(tmp_path: Path) -> None:
    """The embedded Redis's supervision is the one fatal task: a redis-server that dies and cannot be
    started again (here: an append-only file it refuses to load) ends ``kvgate serve`` with exit 1 and
    one clear line, instead of a process that stays up with no table."""
    data, log_path = tmp_path / "kvgate", tmp_path / "serve.log"
    async with running(build_stub(StubState())) as stub_url:
        port = free_port()
        command = [sys.executable, "-m", "gateway.cli", "serve", "--replica", stub_url, "--port", str(port),
                   "--data-dir", str(data), "--store", str(data / "store"),
                   "--reconcile-interval", "0.1", "--poll-interval", "0.1"]  # fmt: skip
        with log_path.open("wb") as log_file:
            server = await asyncio.create_subprocess_exec(*command, stderr=log_file)
        try:
            await until_healthy(f"http://127.0.0.1:{port}")
            _, doc = await health(f"http://127.0.0.1:{port}")
            redis_home = (data / "redis").resolve()
            for path in redis_home.rglob("appendonly*"):
                if path.is_file():  # redis-server refuses to start on it
                    path.write_text("not an append-only file\n")
            (redis_pid,) = redis_servers_in(redis_home)
            os.kill(redis_pid, signal.SIGKILL)
            code = await asyncio.wait_for(server.wait(), timeout=60)
        finally:
            if server.returncode is None:
                server.kill()
                await server.wait()
    text = log_path.read_text()
    assert code == 1, text[-3000:]
    assert doc["background"]["embedded-redis"]["state"] == "running", "it was shown while it ran"

    assert (
        "CRITICAL gateway.tasks.supervisor: kvgate is stopping: background task embedded-redis has been"
        in text
    )
    last = text.strip().splitlines()[-1]
    assert last.startswith("kvgate serve: stopped: background task embedded-redis has been failing "), last
    assert "KvgateError: embedded redis-server did not start" in last
    assert redis_servers_in(redis_home) == [], "no redis-server is left behind"


async def test_sigterm_with_a_load_in_flight_logs_no_unretrieved_task_exception(
    tmp_path: Path, make_adapter: MakeAdapter
) -> None:
    """Seen in the issue: SIGTERM logged "Task exception was never retrieved" for loads in flight. A load
    whose request has left runs on (single-flight, shielded); at shutdown the session closed under it
    and its failure went to nobody. Loads in flight are now cancelled before the session closes, and
    a load that fails is logged by the loader itself."""
    state = StubState(load_delay=30)
    log_path = tmp_path / "serve.log"
    with EmbeddedRedis(tmp_path / "redis-home") as server:
        redis = Redis.from_url(server.url)
        store = AdapterStore(tmp_path / "store")
        await publish_adapter(EpochTable(redis), store, "tenant-42", make_adapter(b"v1"), "base")
        await redis.aclose()
        async with running(build_stub(state)) as stub_url:
            port = free_port()
            command = [sys.executable, "-m", "gateway.cli", "serve", "--replica", stub_url, "--port",
                       str(port), "--redis-url", server.url, "--store", str(store.root)]  # fmt: skip
            with log_path.open("wb") as log_file:
                process = await asyncio.create_subprocess_exec(*command, stderr=log_file)
            try:
                url = f"http://127.0.0.1:{port}"
                await until_healthy(url)
                body = {"model": "tenant-42", "prompt": "p", "max_tokens": 1}
                async with aiohttp.ClientSession() as http:
                    request = asyncio.ensure_future(http.post(f"{url}/v1/completions", json=body))
                    await eventually(lambda: state.load_requests == 1, "the load is in flight")
                    request.cancel()  # the caller leaves: the load runs on without it
                    with contextlib.suppress(asyncio.CancelledError):
                        await request
                process.send_signal(signal.SIGTERM)
                code = await asyncio.wait_for(process.wait(), timeout=60)
            finally:
                if process.returncode is None:
                    process.kill()
                    await process.wait()
    text = log_path.read_text()
    assert code == 0, text[-3000:]
    assert "draining: 0 request(s) running" in text, "the load was the only work in flight"
    assert "never retrieved" not in text, text[-3000:]
    assert "Traceback" not in text, text[-3000:]


async def test_a_burst_of_failures_is_logged_once_and_its_end_once(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="gateway.tasks.supervisor")
    supervisor = Supervisor(failure_limit=100)
    calls = 0

    async def work() -> None:
        nonlocal calls
        calls += 1
        if calls <= 4:
            raise RuntimeError(f"boom {calls}")
        await asyncio.Event().wait()  # runs until cancelled

    async with supervisor.run("work", work, period=0.1) as state:
        await eventually(lambda: calls == 5 and state.failing_since is None, "runs after 4 failures")
        assert (state.restarts, state.error_type, state.error_message) == (4, "RuntimeError", "boom 4")
    failed = [r for r in caplog.records if "failed, restarting it" in r.getMessage()]
    again = [r for r in caplog.records if "running again after 4 failure(s)" in r.getMessage()]
    assert (len(failed), len(again)) == (1, 1), [r.getMessage() for r in caplog.records]
    assert "work" not in supervisor.tasks, "the block's end stopped it (a cancellation is no failure)"
    assert state.restarts == 4


async def test_a_loop_whose_every_step_fails_slower_than_its_period_still_counts_as_failing() -> None:
    """A step that times out after more than the period (a hung replica, a slow Redis) fails every try;
    its runs last longer than a period, which must not end the burst: only a good step does."""
    supervisor = Supervisor(failure_limit=5)  # failing after 0.25 s of failures; time alone ended each
    good = False  # burst within 0.15 s (a 0.1 s backoff, then a period into the next try)

    async def step() -> None:
        await asyncio.sleep(0.15)  # longer than the period
        if not good:
            raise RuntimeError("timed out")

    async def loop() -> None:
        await periodically(0.01, step)

    async with supervisor.run("slow-failure", loop, period=0.05) as state:
        await eventually(lambda: bool(supervisor.failing()), "failing after 5 periods of slow failures")
        assert state.steps, "periodically reports its steps to the task it runs in"
        assert "slow-failure" in supervisor.failing()[0]
        good = True
        await eventually(lambda: not supervisor.failing(), "a good step ends the burst")
        assert state.failing_since is None


async def test_a_loop_that_keeps_failing_beside_a_fast_sibling_counts_as_failing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Seen in the issue: the snapshot sync is one task of several loops, and any loop's good step ended the
    burst of all, so a loop failing at every try beside a fast heartbeat restarted 288 times in 20 s, logged
    620 tracebacks and /healthz said 200. Failure is counted per loop: failing within the limit, backing
    off, one traceback for the burst; the burst ends when the failing loop steps again."""
    caplog.set_level(logging.DEBUG, logger="gateway.tasks.supervisor")
    supervisor = Supervisor(failure_limit=5)  # failing after 0.5 s
    crashing = True
    sibling_steps = 0

    async def sibling() -> None:
        nonlocal sibling_steps
        sibling_steps += 1

    async def junk() -> None:
        if crashing:
            raise ValueError("invalid literal for int() with base 10: b'junk'")

    async def sync() -> None:
        async with asyncio.TaskGroup() as group:
            group.create_task(periodically(0.001, sibling))
            group.create_task(periodically(0.001, junk))

    async with supervisor.run("snapshot-sync", sync, period=0.1) as state:
        await eventually(lambda: bool(supervisor.failing()), "failing within 5 periods", within=3)
        assert sibling_steps > 0, "the sibling stepped meanwhile"
        assert state.failing_for(time.monotonic()) < 3
        assert state.restarts <= 6, "backed off (0.1 s doubling), not restarted at every sibling step"
        (reason,) = supervisor.failing()
        assert reason.startswith("background task snapshot-sync has been failing for "), reason
        assert "ValueError: invalid literal" in reason
        crashing = False
        await eventually(lambda: not supervisor.failing(), "the failing loop steps again: the burst ends")
    tracebacks = [r for r in caplog.records if r.exc_info is not None]
    assert len(tracebacks) == 1, [r.getMessage() for r in tracebacks]
    unready = [r for r in caplog.records if "/healthz answers 503" in r.getMessage()]
    assert len(unready) <= 1


async def test_a_task_that_is_not_required_is_restarted_and_shown_but_never_fails_readiness(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Two tasks keep failing; the one that is not ``required`` (a replica's KV events) is restarted
    with the same backoff and shown failing on /healthz, but only the required one fails readiness. Its
    ``expected`` failure is logged in one line; the other's with its traceback."""
    supervisor = Supervisor(failure_limit=1.0)

    async def fails() -> None:
        raise RuntimeError("its replica is down")

    async with (
        supervisor.run("optional", fails, period=0.1, required=False, expected=(RuntimeError,)) as optional,
        supervisor.run("needed", fails, period=0.1),
    ):
        await eventually(
            lambda: supervisor.failing_tasks() == ["needed"], "the required task fails readiness"
        )
        await eventually(
            lambda: optional.restarts >= 2 and optional.failing_for(time.monotonic()) > 0.1,
            "restarted again, and failing past its limit too",
        )
        assert supervisor.failing_tasks() == ["needed"]
        assert [reason.split(" has been")[0] for reason in supervisor.failing()] == ["background task needed"]
        shown = supervisor.health()["optional"]
        assert shown["failing_for_s"] is not None
        assert shown["last_error"] == {"type": "RuntimeError", "message": "its replica is down"}
    logged = {
        r.getMessage().split()[2]: r.exc_info is not None
        for r in caplog.records
        if "failed," in r.getMessage()
    }
    assert logged == {"optional": False, "needed": True}
