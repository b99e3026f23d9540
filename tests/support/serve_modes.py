"""The edge tests' kvgate in two shapes: in-process (``build_app`` on the test's loop), and
``kvgate serve --workers 2`` as a real subprocess on the same Redis, stub replicas and store, with the
same settings given as flags. A module opts in by importing ``serve_shape`` (an autouse fixture: each of
its tests runs in both shapes); a test that reaches into the process (a monkeypatch, ``caplog``) keeps
to ``in-process`` with ``IN_PROCESS_ONLY``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from pydantic import SecretStr
from redis.asyncio import Redis

from gateway.app.wiring import build_app
from gateway.process.http_edge import free_port, running
from gateway.settings.flags import flag
from gateway.settings.model import Settings

SHAPES = ("in-process", "workers-2")
_shape = {"now": SHAPES[0]}
IN_PROCESS_ONLY = pytest.mark.parametrize("serve_shape", [SHAPES[0]], indirect=True)


@pytest.fixture(autouse=True, params=SHAPES)
def serve_shape(request: pytest.FixtureRequest) -> Iterator[str]:
    _shape["now"] = request.param
    try:
        yield request.param
    finally:
        _shape["now"] = SHAPES[0]


def settings_flags(settings: Settings) -> list[str]:
    """The settings a test set, as ``kvgate serve`` flags."""
    flags: list[str] = []
    for name in sorted(settings.model_fields_set):
        value: Any = getattr(settings, name)
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, bool):
                flags.append(flag(name) if item else "--no-" + flag(name).removeprefix("--"))
            elif item is not None:
                text = item.get_secret_value() if isinstance(item, SecretStr) else str(item)
                flags.extend([flag(name), text])
    return flags


def _redis_url(redis: Redis) -> str:
    kwargs = redis.connection_pool.connection_kwargs
    if "path" in kwargs:
        return f"unix://{kwargs['path']}?db={kwargs.get('db', 0)}"
    return f"redis://{kwargs.get('host', '127.0.0.1')}:{kwargs.get('port', 6379)}/{kwargs.get('db', 0)}"


async def _all_ready(url: str, workers: int) -> bool:
    with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
        async with aiohttp.ClientSession() as http, http.get(f"{url}/healthz") as answer:
            body = await answer.json()
            listed = body.get("workers", [])
            return answer.status == 200 and sum(w.get("state") == "ready" for w in listed) == workers
    return False


READY_WITHIN_S = 120  # two workers starting beside other xdist workers on two busy cores: 30 s was not enough


def _log_in(data_dir: Path) -> Path:
    data_dir.mkdir(parents=True, exist_ok=True)
    return data_dir / "serve.log"


@contextlib.asynccontextmanager
async def serving(settings: Settings, redis: Redis, data_dir: Path) -> AsyncIterator[str]:
    """kvgate with ``settings``, in the shape the test runs in; yields its URL."""
    if _shape["now"] == SHAPES[0]:
        async with running(build_app(settings, redis)) as url:
            yield url
        return
    workers, port = 2, free_port()
    log = _log_in(data_dir)
    command = [sys.executable, "-m", "gateway.cli", "serve", *settings_flags(settings), "--port", str(port),
               "--redis-url", _redis_url(redis), "--data-dir", str(data_dir),
               "--workers", str(workers)]  # fmt: skip
    env = {name: value for name, value in os.environ.items() if not name.startswith("KVGATE_")}
    with log.open("wb") as out:
        server = await asyncio.create_subprocess_exec(*command, stdout=out, stderr=out, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + READY_WITHIN_S
        while not await _all_ready(url, workers):
            if server.returncode is not None:
                pytest.fail(f"kvgate serve exited {server.returncode}: {log.read_text()[-3000:]}")
            if time.monotonic() > deadline:
                pytest.fail(f"kvgate serve --workers {workers} not ready: {log.read_text()[-3000:]}")
            await asyncio.sleep(0.1)
        yield url
    finally:
        if server.returncode is None:
            server.send_signal(signal.SIGTERM)
        code = await asyncio.wait_for(server.wait(), timeout=60)
    assert code == 0, log.read_text()[-3000:]
