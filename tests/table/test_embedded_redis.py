"""The embedded Redis has one owner per data directory: ``kvgate serve`` supervises it, CLI commands use it.

Real processes throughout: ``kvgate serve`` and ``kvgate publish`` as subprocesses, a real
``redis-server`` stalled with SIGSTOP or killed with SIGKILL, and the process table read from /proc.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from gateway.core.errors import TableUnavailable
from gateway.process.http_edge import free_port, running
from gateway.table.redis_server import EmbeddedRedis, find_redis_server, redis_servers_in
from tests.cli.test_cli import kvgate, ok
from tests.support.adapter_files import MakeAdapter
from tests.support.conditions import STARTS_WITHIN_S, eventually
from tests.support.stub_backend import StubState, build_stub


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie that has exited counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@contextlib.asynccontextmanager
async def kvgate_serve(data: Path) -> AsyncIterator[tuple[str, asyncio.subprocess.Process]]:
    """``kvgate serve`` on DATA's embedded Redis, in front of one stub replica; stopped with SIGTERM."""
    async with running(build_stub(StubState())) as stub_url:
        port = free_port()
        command = [sys.executable, "-m", "gateway.cli", "serve", "--replica", stub_url, "--port", str(port),
                   "--data-dir", str(data), "--store", str(data / "store"),
                   "--reconcile-interval", "0.1", "--poll-interval", "0.1"]  # fmt: skip
        server = await asyncio.create_subprocess_exec(*command, stderr=asyncio.subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}"
        try:
            await eventually(lambda: healthy(url), "kvgate serve answers /healthz", within=STARTS_WITHIN_S)
            yield url, server
        finally:
            if server.returncode is None:
                server.send_signal(signal.SIGTERM)
                await asyncio.wait_for(server.wait(), timeout=30)


async def healthy(url: str) -> bool:
    try:
        async with aiohttp.ClientSession() as http, http.get(f"{url}/healthz") as response:
            return response.status == 200
    except aiohttp.ClientError:
        return False


async def served_version(url: str, logical_id: str) -> str | None:
    """The versioned name serve answers LOGICAL_ID with (None: not a 200)."""
    body = {"model": logical_id, "prompt": "p", "max_tokens": 1}
    async with aiohttp.ClientSession() as http, http.post(f"{url}/v1/completions", json=body) as response:
        return response.headers.get("x-kvgate-version") if response.status == 200 else None


def run_kvgate(*args: str, data: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "gateway.cli", *args,
               "--data-dir", str(data), "--store", str(data / "store")]  # fmt: skip
    env = {**os.environ, **env}
    return subprocess.run(command, capture_output=True, text=True, timeout=120, check=False, env=env)


def redis_dir(data: Path) -> Path:
    return (data / "redis").resolve()


def stored(data: Path) -> set[str]:
    return {path.name for path in (data / "store").iterdir()} if (data / "store").exists() else set()


async def test_publish_beside_a_stalled_serving_redis_fails_with_one_line_and_starts_no_second_one(
    make_adapter: MakeAdapter, tmp_path: Path
) -> None:
    data = tmp_path / "kvgate"
    async with kvgate_serve(data) as (url, _):
        v1 = ok("publish", "tenant-42", str(make_adapter(b"v1")), data_dir=data)
        (redis_pid,) = redis_servers_in(redis_dir(data))
        store_before = stored(data)
        os.kill(redis_pid, signal.SIGSTOP)
        try:
            done = run_kvgate("publish", "tenant-42", str(make_adapter(b"v2")), data=data,
                              env={"KVGATE_REDIS_TIMEOUT": "1"})  # fmt: skip
            servers_while_stalled = redis_servers_in(redis_dir(data))
        finally:
            os.kill(redis_pid, signal.SIGCONT)
        assert done.returncode == 1, done.stdout
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr
        assert "does not answer" in done.stderr
        assert servers_while_stalled == [redis_pid], "no second redis-server beside the stalled one"
        assert stored(data) == store_before, "nothing was written to the store"
        assert (redis_dir(data) / "redis.sock").exists(), "the live socket was left alone"

        status = ok("status", data_dir=data)  # the same server, now answering again: nothing was published
        assert [(row["digest"], row["epoch"]) for row in status["logical_ids"]] == [(v1["digest"], 1)]
        v2 = ok("publish", "tenant-42", str(make_adapter(b"v2")), data_dir=data)
        await eventually(
            lambda: _serves(url, "tenant-42", v2["name"]), "serve reaches the publish made after SIGCONT"
        )
        assert redis_servers_in(redis_dir(data)) == [redis_pid]


async def _serves(url: str, logical_id: str, name: str) -> bool:
    return await served_version(url, logical_id) == name


async def test_serve_restarts_its_redis_after_kill_9_and_keeps_serving(
    make_adapter: MakeAdapter, tmp_path: Path
) -> None:
    data = tmp_path / "kvgate"
    async with kvgate_serve(data) as (url, _):
        v1 = ok("publish", "tenant-42", str(make_adapter(b"v1")), data_dir=data)
        await eventually(lambda: _serves(url, "tenant-42", v1["name"]), "serve serves v1")
        (first,) = redis_servers_in(redis_dir(data))
        os.kill(first, signal.SIGKILL)

        async def restarted() -> bool:
            servers = redis_servers_in(redis_dir(data))
            return len(servers) == 1 and servers[0] != first and EmbeddedRedis(data).answers()

        await eventually(restarted, "serve restarts its redis-server", within=30)
        assert await served_version(url, "tenant-42") == v1["name"]
        v2 = ok("publish", "tenant-42", str(make_adapter(b"v2")), data_dir=data)
        assert v2["epoch"] == 2, "the restarted server came back from its append-only file"
        await eventually(lambda: _serves(url, "tenant-42", v2["name"]), "the publish reaches serve")
        assert len(redis_servers_in(redis_dir(data))) == 1


async def test_redis_server_exits_when_serve_is_killed(tmp_path: Path) -> None:
    data = tmp_path / "kvgate"
    async with kvgate_serve(data) as (_, server):
        (redis_pid,) = redis_servers_in(redis_dir(data))
        server.kill()
        await server.wait()

        async def gone() -> bool:
            return not alive(redis_pid)

        await eventually(gone, "the embedded redis-server exits after kill -9 of its kvgate", within=15)
    assert redis_servers_in(redis_dir(data)) == []
    assert kvgate("status", data_dir=data).returncode == 0, "the next command owns the directory afresh"
    assert redis_servers_in(redis_dir(data)) == [], "and stops what it started"


def test_one_owner_per_data_directory(tmp_path: Path) -> None:
    with EmbeddedRedis(tmp_path, start_timeout=1.0) as first:
        second = EmbeddedRedis(tmp_path, start_timeout=1.0)
        with pytest.raises(TableUnavailable, match="owned by"):
            second.start()
        assert not second.owned
        assert redis_servers_in(first.dir) == [first.pid]
        with second.using():  # a user of the owner's server, not a second server
            assert second.answers()
        assert first.answers()
    assert redis_servers_in(first.dir) == []


def test_a_new_owner_stops_an_orphan_nobody_owns(tmp_path: Path) -> None:
    """A redis-server left on the directory by a kvgate that predates the lock is stopped, not adopted."""
    server = EmbeddedRedis(tmp_path)
    server.dir.mkdir(parents=True)
    orphan = subprocess.Popen(
        [find_redis_server(), "--port", "0", "--unixsocket", str(server.socket), "--dir", str(server.dir),
         "--appendonly", "yes", "--save", ""],
        stdout=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 20
        while not server.answers():
            assert orphan.poll() is None, "the orphan did not start"
            assert time.monotonic() < deadline, "the orphan did not answer"
        with server:
            assert redis_servers_in(server.dir) == [server.pid]
            assert orphan.wait(timeout=15) == 0, "the orphan was stopped cleanly (SIGTERM)"
    finally:
        if orphan.poll() is None:
            orphan.kill()
            orphan.wait()
