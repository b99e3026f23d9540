"""The rollout gate's judgement on fleet-wide figures (issue 28, item 6), with two gates as two workers
would run them (each its own snapshot, counts and gateway id) on one real Redis: neither worker's own
slice reaches ``rollout_min_requests``, their sum does, and the one gate that holds the rollout aborts it
on the fleet's error rate; the other never judges. No replica is up, so no audit runs (that path:
tests/proof/test_gate_fleet.py, tests/vllm/test_rollout_vllm.py), but for the lease test, whose audit
round is held open (its canary's audit waits for the test) to outlast the lease."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from pathlib import Path

import aiohttp
import pytest_asyncio
from redis.asyncio import Redis

from gateway.adapters.publish import publish_adapter, rollout_adapter
from gateway.adapters.store import AdapterStore
from gateway.core.model import Target, VersionState
from gateway.core.split import CANDIDATE, CURRENT
from gateway.fleet.backends import dialect_for
from gateway.fleet.quarantine import Quarantine
from gateway.fleet.replicas import ReplicaPool
from gateway.proof.canary import Canary
from gateway.proof.gate import Gate, GateRules
from gateway.proof.verdicts import Verdict
from gateway.table import keys
from gateway.table.epoch_table import EpochTable
from gateway.table.rollout_gate import GateTable
from gateway.table.snapshot import Snapshot, SnapshotSync
from gateway.telemetry.metrics import Metrics
from gateway.telemetry.rollout_stats import RolloutStats
from tests.support.adapter_files import MakeAdapter
from tests.support.conditions import eventually


@pytest_asyncio.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as http:
        yield http


class HeldAudit(Canary):
    """A canary whose audit round lasts until the test lets it end (``began``, then ``end``)."""

    began: asyncio.Event
    end: asyncio.Event

    async def audit_version(
        self,
        version: VersionState,
        floor: float = 0.0,
        *,
        quarantine: bool = True,
        headers: Mapping[str, str] | None = None,
    ) -> list[Verdict]:
        self.began.set()
        await self.end.wait()
        return []


async def worker(
    table: EpochTable,
    session: aiohttp.ClientSession,
    gateway_id: str,
    *,
    ttl_ms: int = 30_000,
    interval_ms: int = 10_000,
    canary_class: type[Canary] = Canary,
) -> Gate:
    snapshot = Snapshot()
    await SnapshotSync(table, snapshot, interval=1.0).reconcile()
    pool = ReplicaPool([], dialect_for("vllm"), session, base_with_root=False)
    metrics = Metrics()
    canary = canary_class(snapshot, pool, {}, metrics, Quarantine(pool, metrics))
    shared = GateTable(table, gateway_id, ttl_ms=ttl_ms, interval_ms=interval_ms)
    return Gate(snapshot, table, canary, RolloutStats(), metrics, GateRules(0.05, 50), shared)


def serve(gate: Gate, role: str, requests: int, errors: int) -> None:
    state = gate.snapshot.get("t")
    assert state is not None
    assert state.candidate is not None
    target = Target("t", "base", None, None, [], role=role, rollout=state.candidate.digest)
    for i in range(requests):
        gate.stats.finished(target, error=i < errors)


async def test_two_workers_slices_below_min_requests_fail_the_candidate_together(
    redis: Redis, table: EpochTable, make_adapter: MakeAdapter, tmp_path: Path, session: aiohttp.ClientSession
) -> None:
    store = AdapterStore(tmp_path / "store")
    await publish_adapter(table, store, "t", make_adapter(b"v1"), "base")
    await rollout_adapter(table, store, "t", make_adapter(b"v2"), "base", 5000)
    a, b = await worker(table, session, "gw-a"), await worker(table, session, "gw-b")
    for gate in (a, b):  # 30 candidate requests each (20 failed), 30 current ones (none failed)
        serve(gate, CANDIDATE, 30, 20)
        serve(gate, CURRENT, 30, 0)
    await a.run_round()  # a holds the gate; its 30 alone are below min_requests: nothing to judge yet
    assert a.turns["t"].mine
    state = await table.read_state("t")
    assert state is not None
    assert state.candidate is not None
    assert a.report()["t"]["figures"]["candidate"]["requests"] == 30

    await b.run_round()  # b adds its 30 and finds a holding the gate: it judges nothing
    assert (b.turns["t"].holder, b.turns["t"].mine) == ("gw-a", False)
    fleet = {"requests": 60, "errors": 40, "error_rate": 40 / 60, "ttfb_mean_s": None}
    assert b.report()["t"]["figures"]["candidate"] == fleet
    assert b.report()["t"]["own_figures"]["candidate"]["requests"] == 30
    still = await table.read_state("t")
    assert still is not None
    assert still.candidate is not None

    await a.run_round()  # the fleet's 60 pass min_requests: 66.7% against 0.0%
    state = await table.read_state("t")
    assert state is not None
    assert state.candidate is None, "the holder aborted the rollout on the fleet's error rate"
    assert "error rate 66.7% over 60 requests across the fleet, current 0.0% over 60" in state.last_rollout


async def test_the_holder_keeps_its_gate_while_an_audit_round_outlasts_the_lease(
    redis: Redis, table: EpochTable, make_adapter: MakeAdapter, tmp_path: Path, session: aiohttp.ClientSession
) -> None:
    """A round waits for the audit (cold and warm completions on each replica, on a busy fleet: seconds),
    and the holder's ticks wait for the round: the lease is renewed meanwhile, or another kvgate takes the
    gate over mid-round (seen in a fresh-clone run: the holder changed between two reads of the status)."""
    store = AdapterStore(tmp_path / "store")
    await publish_adapter(table, store, "t", make_adapter(b"v1"), "base")
    await rollout_adapter(table, store, "t", make_adapter(b"v2"), "base", 5000)
    # a lease a loaded machine's stalls do not outlast (the key lives a lease and an interval past a
    # renewal; with 300 ms and a 100 ms interval, a fresh-clone run's stall lost it before the first renewal)
    ttl = 1200
    a = await worker(table, session, "gw-a", ttl_ms=ttl, interval_ms=400, canary_class=HeldAudit)
    b = await worker(table, session, "gw-b", ttl_ms=ttl, interval_ms=400)
    audit = a.canary
    assert isinstance(audit, HeldAudit)
    audit.began, audit.end = asyncio.Event(), asyncio.Event()
    state = await table.read_state("t")
    assert state is not None
    assert state.candidate is not None
    gate_key = keys.rollout_gate("t", state.candidate.digest)

    round_a = asyncio.create_task(a.run_round())
    await asyncio.wait_for(audit.began.wait(), 10)
    first_until = a.turns["t"].until_ms

    async def renewed_past_the_first_lease() -> bool:
        until = await redis.hget(gate_key, "until_ms")
        return until is not None and int(until) > first_until + ttl

    await eventually(renewed_past_the_first_lease, "a renews its lease while its audit runs")
    await b.run_round()  # the first lease is over by now: only a's renewals hold it
    assert (b.turns["t"].holder, b.turns["t"].mine) == ("gw-a", False), "b does not take a's gate mid-round"
    assert int(await redis.hget(gate_key, "round_ms") or 0) == a.turns["t"].round_ms, "no round was started"
    audit.end.set()
    await round_a
    await a.run_round()
    assert a.turns["t"].mine, "a still holds it after its round"
