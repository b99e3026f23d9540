"""Rollouts (issue 22) on two ``kvgate serve`` processes sharing one real Redis, in front of two stub
replicas: the sticky split is the same in both, close to the weight, monotone as the weight rises; an
abort empties the candidate within the staleness bound; a promote moves everything to it under a new
epoch; the gate aborts a candidate that errs. The real-vLLM rollout test is tests/vllm/test_rollout.py."""

from __future__ import annotations

import asyncio
import functools
import json
import re
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from redis.asyncio import Redis

from gateway.adapters.publish import publish_adapter, rollout_adapter
from gateway.adapters.store import AdapterStore
from gateway.app.wiring import build_app
from gateway.core.wire import ADMIN_TOKEN_HEADER
from gateway.process.http_edge import free_port, running
from gateway.settings.model import Settings
from gateway.table.epoch_table import EpochTable
from gateway.table.redis_server import EmbeddedRedis
from tests.support.adapter_files import MakeAdapter
from tests.support.conditions import eventually, until_healthy
from tests.support.stub_backend import StubState, build_stub

ADMIN = "test-admin-token"
USERS = 1000
SAMPLE = 250  # the abort and promote rounds: users that were on the candidate at 50%
RECONCILE_S = 1.0
STALENESS_BOUND_S = 2 * RECONCILE_S
"""How long a snapshot may lag a change while Redis answers: the change log is followed at once (XREAD
BLOCK), and a heartbeat every ``reconcile_interval`` catches what it missed; two of them bound it."""


@asynccontextmanager
async def gateway_process(
    redis_server: EmbeddedRedis, store: AdapterStore, stubs: list[str], *extra: str
) -> AsyncIterator[str]:
    """``kvgate serve`` as its own process (EXTRA: more flags), gate off (the split alone is under test)."""
    port = free_port()
    command = [sys.executable, "-m", "gateway.cli", "serve", "--port", str(port),
               "--redis-url", redis_server.url, "--store", str(store.root), "--admin-token", ADMIN,
               "--reconcile-interval", str(RECONCILE_S), "--rollout-gate-interval", "0"]  # fmt: skip
    for stub in stubs:
        command += ["--replica", stub]
    command += extra
    process = await asyncio.create_subprocess_exec(*command, stderr=asyncio.subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        await until_healthy(url)
        yield url
    finally:
        process.terminate()
        await process.wait()


def cli(redis_server: EmbeddedRedis, store: AdapterStore, *args: str) -> str:
    """A ``kvgate`` command as an operator runs it (its own process), its standard output."""
    command = [sys.executable, "-m", "gateway.cli", *args, "--redis-url", redis_server.url,
               "--store", str(store.root)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout


async def rollout_of(url: str) -> dict[str, Any] | None:
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"{url}/kvgate/status", headers={ADMIN_TOKEN_HEADER: ADMIN}) as answer,
    ):
        doc = await answer.json()
    rollout: dict[str, Any] | None = doc["versions"]["t"]["rollout"]
    return rollout


async def answered(urls: list[str], users: list[str]) -> dict[str, dict[str, tuple[str, str, str]]]:
    """Every user's request through every kvgate: kvgate URL -> user -> (version, role, epoch)."""
    clients = {url: openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) for url in urls}
    seen: dict[str, dict[str, tuple[str, str, str]]] = {url: {} for url in urls}
    queue = [(url, user) for user in users for url in urls]

    async def worker() -> None:
        while queue:
            url, user = queue.pop()
            raw = await clients[url].completions.with_raw_response.create(
                model="t", prompt="the same prompt for everyone", max_tokens=1, user=user
            )
            assert raw.parse().model == "t"
            headers = raw.headers
            seen[url][user] = (headers["x-kvgate-version"], headers.get("x-kvgate-rollout", ""),
                               headers["x-kvgate-epoch"])  # fmt: skip

    try:
        await asyncio.gather(*(worker() for _ in range(16)))
    finally:
        for api in clients.values():
            await api.close()
    return seen


def on(seen: dict[str, dict[str, tuple[str, str, str]]], name: str) -> set[str]:
    """The users some kvgate answered with version NAME."""
    return {user for by_user in seen.values() for user, (served, _, _) in by_user.items() if served == name}


@pytest.mark.timeout(600)  # 5,000 requests through two kvgate processes: about 2 minutes on a loaded machine
async def test_a_weighted_sticky_rollout_agrees_across_two_kvgates_then_aborts_and_promotes(
    redis_server: EmbeddedRedis, redis: Redis, table: EpochTable, make_adapter: MakeAdapter, tmp_path: Path
) -> None:
    store = AdapterStore(tmp_path / "store")
    v1 = await publish_adapter(table, store, "t", make_adapter(b"v1"), "base")
    users = [f"user-{i}" for i in range(USERS)]
    async with AsyncExitStack() as stack:
        stubs = [await stack.enter_async_context(running(build_stub(StubState()))) for _ in range(2)]
        urls = [
            await stack.enter_async_context(gateway_process(redis_server, store, stubs)) for _ in range(2)
        ]
        # weight 25, started with the CLI: both kvgates see it, and split the same way
        out = cli(redis_server, store, "rollout", "t", str(make_adapter(b"v2")), "--percent", "25")
        assert out.startswith("rollout started: t -> t@"), out
        v2_name = out.split(" -> ")[1].split()[0]
        await all_see(urls, 2500)
        seen = await answered(urls, users)
        a, b = seen[urls[0]], seen[urls[1]]
        assert a == b, "every user answered by the same version, in the same role, by both kvgates"
        at_25 = on(seen, v2_name)
        assert on(seen, v1.name) | at_25 == set(users)
        assert 200 <= len(at_25) <= 300, f"candidate share {len(at_25) / USERS:.1%}, wanted 25 ± 5%"
        assert {role for _, role, _ in a.values()} == {"current", "candidate"}
        assert all(role == "candidate" for user, (_, role, _) in a.items() if user in at_25)
        rollout_line = f"rollout: {v2_name} (candidate, epoch 2) at 25%, {v1.name} (current, epoch 1) at 75%"
        assert rollout_line in cli(redis_server, store, "status"), "kvgate status shows the rollout"
        versions = cli(redis_server, store, "versions", "t")
        assert rollout_line in versions
        assert [line[:2].strip() for line in versions.splitlines()[1:3]] == ["+", "*"], versions

        # weight 50 (CLI): every key that was on the candidate stays there
        assert cli(redis_server, store, "rollout", "t", "--percent", "50").startswith("weight changed")
        await all_see(urls, 5000)
        seen = await answered(urls, users)
        assert seen[urls[0]] == seen[urls[1]]
        at_50 = on(seen, v2_name)
        assert at_25 <= at_50, f"{len(at_25 - at_50)} keys left the candidate when its weight rose"
        assert 450 <= len(at_50) <= 550, f"candidate share {len(at_50) / USERS:.1%}, wanted 50 ± 5%"
        sample = sorted(at_50)[:SAMPLE]  # users the candidate answered: after an abort, none of them is

        # abort (CLI): after the staleness bound, no request reaches the candidate
        assert cli(redis_server, store, "abort", "t").startswith("aborted: t rollout of " + v2_name)
        await asyncio.sleep(STALENESS_BOUND_S)
        seen = await answered(urls, sample)
        assert on(seen, v2_name) == set(), "requests still on the aborted candidate"
        assert all(role == "" for by_user in seen.values() for _, role, _ in by_user.values())
        assert (await rollout_of(urls[0])) == {"running": False, "last": _last(await table.read_state("t"))}

        # a new rollout, then promote: every request on it, under the next epoch
        before = await table.read_state("t")
        assert before is not None
        assert before.candidate is None
        await rollout_adapter(table, store, "t", make_adapter(b"v2"), "base", 1000)
        out = cli(redis_server, store, "promote", "t")
        assert out.startswith(f"promoted: t -> {v2_name} epoch {before.epoch + 1}"), out
        await asyncio.sleep(STALENESS_BOUND_S)
        seen = await answered(urls, sample)
        assert on(seen, v2_name) == set(sample)
        assert {epoch for by_user in seen.values() for _, _, epoch in by_user.values()} == {
            str(before.epoch + 1)
        }
        history = cli(redis_server, store, "history", "t")
        actions = [line.split()[3] for line in history.splitlines()[1:]]
        assert actions == ["promote", "rollout", "abort", "weight", "rollout", "publish"], history


async def all_see(urls: list[str], weight: int) -> None:
    for url in urls:
        await eventually(functools.partial(_weight_is, url, weight), f"{url} sees the rollout at {weight} bp")


async def _weight_is(url: str, weight: int) -> bool:
    rollout = await rollout_of(url)
    return rollout is not None and rollout["running"] and rollout["candidate"]["weight"] == weight


def _last(state: Any) -> Any:
    return json.loads(state.last_rollout)


async def test_the_gate_aborts_a_candidate_that_fails_every_request_after_a_few(
    redis: Redis, table: EpochTable, make_adapter: MakeAdapter, tmp_path: Path
) -> None:
    """Stub replicas refuse to load the candidate: its requests fail (503) while the current version's
    succeed; after ``failing_requests`` (3) such failures, not ``rollout_min_requests``, the gate aborts
    the rollout by itself and says why."""
    store = AdapterStore(tmp_path / "store")
    await publish_adapter(table, store, "t", make_adapter(b"v1"), "base")
    state = StubState()
    async with running(build_stub(state)) as stub:
        settings = Settings(replicas=[stub], store=store.root, admin_token=ADMIN, rollout_gate_interval=0.2,
                            rollout_min_requests=50, reconcile_interval=RECONCILE_S)  # fmt: skip
        app = build_app(settings, redis)
        async with running(app) as url:
            done = await rollout_adapter(table, store, "t", make_adapter(b"v2-bad"), "base", 5000)
            state.fail_loads_of = done.name
            await eventually(lambda: _weight_is(url, 5000), "kvgate sees the rollout")
            api = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
            statuses = []
            for i in range(200):
                if (await rollout_of(url) or {}).get("running") is False:
                    break
                try:
                    await api.completions.create(model="t", prompt="p", max_tokens=1, user=f"u{i}")
                    statuses.append(200)
                except openai.APIStatusError as exc:
                    statuses.append(exc.status_code)
            await api.close()
            failed = sum(status >= 500 for status in statuses)
            assert set(statuses) <= {200, 503}, statuses
            assert 3 <= failed < 50, f"{failed} failures: the gate aborts after a few, not min_requests"
            after = await table.read_state("t")
            assert after is not None
            assert after.candidate is None, "the gate aborted the rollout"
            last = _last(after)
            assert last["outcome"] == "aborted"
            assert re.match(r"gate: every one of its \d+ requests failed across the fleet", last["reason"]), (
                last
            )
            history = await table.read_history("t")
            assert (history[0]["action"], history[0]["reason"]) == ("abort", last["reason"])
            metrics = await _get(f"{url}/metrics")
            assert 'kvgate_rollout_gate_aborts_total{logical_id="t",reason="failing"} 1.0' in metrics
            assert 'kvgate_rollout_requests_total{logical_id="t",outcome="error",role="candidate"}' in metrics


async def _get(url: str) -> str:
    async with (
        aiohttp.ClientSession() as session,
        session.get(url, headers={ADMIN_TOKEN_HEADER: ADMIN}) as answer,
    ):
        return await answer.text()
