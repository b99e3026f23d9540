"""One error tree: every error kvgate defines is a ``KvgateError``; tools that meet one say it in a line."""

from __future__ import annotations

import asyncio
import importlib
import inspect
import logging
import pkgutil
import sys
from pathlib import Path

import aiohttp
import pytest
from redis.asyncio import Redis

import gateway
from gateway.app.wiring import build_app
from gateway.core.errors import AuditError, KvgateError
from gateway.fleet.backends import VllmDialect
from gateway.fleet.quarantine import Quarantine
from gateway.fleet.replicas import ReplicaPool
from gateway.process.http_edge import running
from gateway.proof.canary import Canary
from gateway.settings.model import Settings
from gateway.table.snapshot import Snapshot
from gateway.telemetry.metrics import Metrics
from tests.support.stub_backend import StubState, build_stub


def test_every_error_kvgate_defines_is_in_the_tree() -> None:
    defined = []
    for info in pkgutil.walk_packages(gateway.__path__, "gateway."):
        module = importlib.import_module(info.name)
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ == info.name and issubclass(cls, BaseException):
                defined.append(cls)
    assert len(defined) > 10, "the walk finds the error classes (so this test can fail)"
    outside = [f"{cls.__module__}.{cls.__qualname__}" for cls in defined if not issubclass(cls, KvgateError)]
    assert outside == []


async def test_audit_with_a_wrong_admin_token_says_so_in_one_line(redis: Redis, tmp_path: Path) -> None:
    async with running(build_stub(StubState())) as stub:
        settings = Settings(replicas=[stub], store=tmp_path / "store", admin_token="right-token")
        async with running(build_app(settings, redis)) as url:
            audit = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "gateway.cli", "audit", "tenant-42", "--gateway", url,
                "--admin-token", "wrong-token", "--data-dir", str(tmp_path / "k"),
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            )  # fmt: skip
            _, err = await asyncio.wait_for(audit.communicate(), timeout=60)
    assert audit.returncode == 2, err.decode()
    lines = err.decode().strip().splitlines()
    assert len(lines) == 1, lines
    assert "refused the admin token" in lines[0]


async def test_the_canary_logs_a_replica_it_cannot_audit_and_never_hides_a_bug(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with aiohttp.ClientSession() as session:
        pool = ReplicaPool([], VllmDialect(), session, base_with_root=False)
    metrics = Metrics()
    canary = Canary(Snapshot(), pool, {"t": 0.0}, metrics, Quarantine(pool, metrics))
    canary.snapshot.flushed = False
    monkeypatch.setattr("time.monotonic", lambda: 1.0)

    async def unobservable(logical_id: str) -> None:
        raise AuditError("http://r0 answered 500: boom")

    monkeypatch.setattr(canary, "_audit", unobservable)
    with caplog.at_level(logging.WARNING, logger="gateway.proof.canary"):
        await canary.run_round()
    assert "answered 500: boom" in caplog.text

    async def buggy(logical_id: str) -> None:
        raise KeyError("a bug in kvgate, not a replica's answer")

    monkeypatch.setattr(canary, "_audit", buggy)
    with pytest.raises(KeyError):
        await canary.run_round()
