"""One gate per rollout per interval, on fleet-wide figures (issue 28, item 6), with two ``kvgate serve
--workers 2`` processes on one real Redis in front of two stub replicas that count the audits they get:
every audit request of the rollout gate says who sent it and in which round (``x-kvgate-audit``), so the
replicas see one gate (one worker of one kvgate, of the four) audit the candidate once per interval; every
kvgate shows the same holder and the same fleet-wide figures, which add up every kvgate's traffic; when
the holder's kvgate is killed (kill -9), another process takes the gate over once its lease ran out.
The real-vLLM gate test is tests/vllm/test_rollout_vllm.py."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from redis.asyncio import Redis

from gateway.adapters.publish import publish_adapter, rollout_adapter
from gateway.adapters.store import AdapterStore
from gateway.core.wire import ADMIN_TOKEN_HEADER, AUDIT_HEADER
from gateway.process.http_edge import free_port, running
from gateway.table.epoch_table import EpochTable
from gateway.table.redis_server import EmbeddedRedis
from tests.support.adapter_files import MakeAdapter
from tests.support.conditions import STARTS_WITHIN_S, eventually
from tests.support.stub_backend import StubState, build_stub

ADMIN = "gate-fleet-admin-token"
INTERVAL_S = 1.0
ROUNDS = 6


@dataclass
class Kvgate:
    name: str  # its --gateway-id: its workers are NAME-w0 and NAME-w1
    url: str
    process: asyncio.subprocess.Process


@contextlib.asynccontextmanager
async def kvgate(
    name: str, redis_server: EmbeddedRedis, store: AdapterStore, stubs: list[str], data: Path
) -> AsyncIterator[Kvgate]:
    port = free_port()
    command = [sys.executable, "-m", "gateway.cli", "serve", "--port", str(port), "--workers", "2",
               "--gateway-id", name, "--redis-url", redis_server.url, "--data-dir", str(data),
               "--store", str(store.root), "--poll-interval", "0.2", "--reconcile-interval", "0.2",
               "--rollout-gate-interval", str(INTERVAL_S), "--rollout-min-requests", "1000"]  # fmt: skip
    for stub in stubs:
        command += ["--replica", stub]
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("KVGATE_")},
        "KVGATE_ADMIN_TOKEN": ADMIN,
    }
    log = data.parent / f"{name}.log"
    with log.open("wb") as out:
        process = await asyncio.create_subprocess_exec(*command, stdout=out, stderr=out, env=env)
    served = Kvgate(name, f"http://127.0.0.1:{port}", process)
    try:

        async def ready() -> bool:
            assert process.returncode is None, log.read_text(errors="replace")[-3000:]
            with contextlib.suppress(aiohttp.ClientError):
                health = await get(f"{served.url}/healthz")
                return [w["state"] for w in health.get("workers", [])] == ["ready", "ready"]
            return False

        await eventually(ready, f"{name}: two workers ready", within=STARTS_WITHIN_S)
        yield served
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGTERM)
            await asyncio.wait_for(process.wait(), timeout=60)


async def get(url: str) -> Any:
    async with aiohttp.ClientSession() as http, http.get(url, headers={ADMIN_TOKEN_HEADER: ADMIN}) as answer:
        return await answer.json(content_type=None)


def rounds(stubs: list[StubState]) -> dict[tuple[str, int], dict[int, int]]:
    """(gate's gateway id, round start ms) -> stub index -> the audit requests it got in that round."""
    seen: dict[tuple[str, int], dict[int, int]] = {}
    for index, stub in enumerate(stubs):
        for headers in stub.received_headers:
            marker = {k.lower(): v for k, v in headers.items()}.get(AUDIT_HEADER)
            if marker is not None:
                gateway, _, round_ms = marker.partition(" round ")
                per_stub = seen.setdefault((gateway, int(round_ms)), {})
                per_stub[index] = per_stub.get(index, 0) + 1
    return seen


@pytest.mark.timeout(300)
async def test_two_kvgates_with_two_workers_audit_a_rollout_from_one_gate_per_interval(
    redis_server: EmbeddedRedis, redis: Redis, table: EpochTable, make_adapter: MakeAdapter, tmp_path: Path
) -> None:
    store = AdapterStore(tmp_path / "store")
    await publish_adapter(table, store, "t", make_adapter(b"v1"), "base")
    states = [StubState(logprobs=True), StubState(logprobs=True)]
    async with AsyncExitStack() as stack:
        stubs = [await stack.enter_async_context(running(build_stub(s))) for s in states]
        gates = [
            await stack.enter_async_context(kvgate(name, redis_server, store, stubs, tmp_path / name))
            for name in ("kv-a", "kv-b")
        ]
        done = await rollout_adapter(table, store, "t", make_adapter(b"v2"), "base", 5000)

        async def all_see_it() -> bool:
            docs = [await get(f"{g.url}/kvgate/status") for g in gates for _ in range(4)]  # any worker
            return all((doc["versions"]["t"]["rollout"] or {}).get("running") for doc in docs)

        await eventually(all_see_it, "every worker sees the rollout")
        sent = await traffic([g.url for g in gates], 40)
        holding = {i for i, s in enumerate(states) if done.name in s.adapters}
        assert holding, "the candidate is loaded"

        async def enough_rounds() -> bool:
            return len(rounds(states)) >= ROUNDS

        await eventually(enough_rounds, f"{ROUNDS} audit rounds", within=60)
        seen = rounds(states)
        holders = {gateway for gateway, _ in seen}
        assert len(holders) == 1, f"one gate audits the rollout, not one per worker: {sorted(holders)}"
        holder = holders.pop()
        assert holder in {f"{g.name}-w{slot}" for g in gates for slot in (0, 1)}
        starts = sorted(start for _, start in seen)
        gaps = [b - a for a, b in itertools.pairwise(starts)]
        assert min(gaps) >= INTERVAL_S * 1000, f"one round per interval: {gaps} ms apart"
        assert all(set(per_stub) == holding for per_stub in seen.values()), (
            "each round audits where it is loaded"
        )
        assert all(n <= 16 for per_stub in seen.values() for n in per_stub.values()), seen

        async def the_same_everywhere() -> bool:
            docs = [(await get(f"{g.url}/kvgate/status"))["rollouts"].get("t", {}) for g in gates]
            return all(
                (doc.get("gate") or {}).get("holder") == holder
                and sum(f["requests"] for f in (doc.get("figures") or {}).values()) == sent
                for doc in docs
            )

        await eventually(the_same_everywhere, "every kvgate shows the holder and the fleet's figures")
        cli = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "gateway.cli", "status", "--redis-url", redis_server.url,
            "--data-dir", str(tmp_path / "cli"), stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        status = (await cli.communicate())[0].decode()
        assert f"gate held by {holder}; across the fleet: candidate 0/" in status, status
        state = await table.read_state("t")
        assert state is not None
        assert state.candidate is not None, "a coherent candidate is left alone"

        # the holder's kvgate dies (kill -9): after its lease (three intervals) another process gates it
        dead = next(g for g in gates if holder.startswith(f"{g.name}-"))
        dead.process.kill()
        await dead.process.wait()
        killed_at = max(starts)

        async def taken_over() -> bool:
            return any(gateway != holder and start > killed_at for gateway, start in rounds(states))

        await eventually(taken_over, "another kvgate's gate audits once the lease ran out", within=30)
        after = {gateway for gateway, start in rounds(states) if start > killed_at}
        survivor = next(g for g in gates if g is not dead)
        assert after <= {holder, f"{survivor.name}-w0", f"{survivor.name}-w1"}
        assert len(after - {holder}) == 1, f"one gate took it over: {after}"


async def traffic(urls: list[str], count: int) -> int:
    """COUNT completions of ``t``, spread over the kvgates and users; every one answered."""
    async with aiohttp.ClientSession() as http:
        for i in range(count):
            body = {"model": "t", "prompt": "p", "max_tokens": 1, "user": f"u{i}"}
            async with http.post(f"{urls[i % len(urls)]}/v1/completions", json=body) as answer:
                assert answer.status == 200, await answer.text()
    return count
