"""A fleet of kvgates on one Redis in front of the two real vLLM replicas: leases hold what another
kvgate streams on, a dead kvgate's leases expire, out-of-band loads are quarantined and repaired, and
the canary catches a replica serving other bytes under a versioned name.

A is a kvgate in this process (``make_gateway``); B is ``kvgate serve`` as a child process.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import ExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from redis.asyncio import Redis

from gateway.core.errors import AuditError
from gateway.core.wire import ADMIN_TOKEN_HEADER, PIN_HEADER
from gateway.dev.vllm_process import VllmProcess
from gateway.fleet.backends import fetch_model_list
from gateway.process.http_edge import free_port
from gateway.proof.experiment import complete
from gateway.settings.flags import flag
from gateway.table import keys
from gateway.table.epoch_table import EpochTable
from gateway.table.redis_server import EmbeddedRedis
from tests.support.adapter_files import swap_back, swap_bytes
from tests.support.conditions import STARTS_WITHIN_S, eventually
from tests.support.engine_pause import EngineThrottle
from tests.vllm.conftest import ADMIN_TOKEN, GatewayFactory, kvgate_json, post_json

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.timeout(600)]
FAST = {"reconcile_interval": 0.2, "poll_interval": 0.2, "drain_grace": 0.3, "lease_ttl": 10.0}
"""Fast polls and sweeps, the leases' default time to live: B's workers were seen here with Redis reads
timing out (the 5 s ``redis_timeout``) on a loaded machine, and a 2 s lease lapses across one such read."""


@asynccontextmanager
async def kvgate_process(
    replicas: list[VllmProcess], redis_url: str, store: Path, http: aiohttp.ClientSession
) -> AsyncIterator[tuple[str, asyncio.subprocess.Process]]:
    port = free_port()
    fast = [arg for name, value in FAST.items() for arg in (flag(name), str(value))]
    urls = [arg for r in replicas for arg in ("--replica", r.url)]
    command = [sys.executable, "-m", "gateway.cli", "serve", "--port", str(port), "--redis-url", redis_url,
               "--store", str(store), *urls, *fast]  # fmt: skip
    env = {**os.environ, "KVGATE_ADMIN_TOKEN": ADMIN_TOKEN}
    with (store.parent / "kvgate-b.log").open("wb") as log:  # read back when a test fails (``b_said``)
        process = await asyncio.create_subprocess_exec(*command, env=env, stderr=log)
    url = f"http://127.0.0.1:{port}"

    async def healthy() -> bool:
        try:
            async with http.get(f"{url}/healthz") as response:
                return response.status == 200
        except aiohttp.ClientError:
            return False

    try:
        await eventually(healthy, "kvgate B answers /healthz", within=STARTS_WITHIN_S)
        yield url, process
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


STREAM_TOKENS = 1000  # the most the replicas' 1,024-token context leaves: about a second on an idle machine
DEFERRED = "kvgate_adapter_unloads_deferred_total"


async def long_stream(
    http: aiohttp.ClientSession,
    url: str,
    model: str,
    replica: VllmProcess,
    paused: ExitStack,
    began: asyncio.Event,
) -> tuple[int, bool]:
    """A streamed completion of ``STREAM_TOKENS`` tokens through ``url`` pinned to ``replica``: (the
    completion tokens its final usage reports, whether an error event came). The replica's engine runs
    slowed (``EngineThrottle``) from the request on and is held still at the first chunk (``paused``: the
    test resumes it by closing that stack): the stream stays in flight for certain. At full speed a busy
    test could read the first chunk after the whole stream ran (seen: ``(1000, False)`` before a pause)."""
    body = {"model": model, "prompt": "Count the boats:", "max_tokens": STREAM_TOKENS, "ignore_eos": True,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    headers = {PIN_HEADER: replica.url, ADMIN_TOKEN_HEADER: ADMIN_TOKEN}
    generated, broke = 0, False
    throttle = paused.enter_context(EngineThrottle(replica.pid))
    async with http.post(f"{url}/v1/completions", json=body, headers=headers) as response:
        assert response.status == 200, await response.text()
        async for line in response.content:
            if line.startswith(b"data: {"):
                chunk = json.loads(line[len(b"data: ") :])
                broke = broke or "error" in chunk
                generated = (chunk.get("usage") or {}).get("completion_tokens", generated)
                if not began.is_set():
                    throttle.hold()  # no await between the chunk and the hold
                    began.set()
    return generated, broke


async def publish(logical_id: str, adapter: Path, redis_server: EmbeddedRedis, store: Path) -> dict[str, str]:
    return await kvgate_json("publish", logical_id, str(adapter), redis_url=redis_server.url, store=store)


async def until_paused(began: asyncio.Event, stream: asyncio.Task[tuple[int, bool]]) -> None:
    """Wait for ``long_stream``'s first chunk, at which it paused the replica's engine."""

    def first_chunk() -> bool:
        if stream.done():
            pytest.fail(f"the stream ended before its first chunk: {ended(stream)}")
        return began.is_set()

    await eventually(first_chunk, "B's stream sends its first chunk", within=60)


def ended(stream: asyncio.Task[tuple[int, bool]]) -> str:
    """How a stream task stands, for a failure message."""
    if not stream.done():
        return "still running"
    return f"ended: {stream.exception()!r}" if stream.exception() else f"ended: {stream.result()}"


async def loaded(http: aiohttp.ClientSession, replica: VllmProcess) -> dict[str, str]:
    return (await fetch_model_list(http, replica.url)).adapters


async def test_a_stream_through_b_survives_a_version_change_and_sweep_by_a_and_dies_with_b(
    make_gateway: GatewayFactory,
    vllm_replicas: list[VllmProcess],
    redis_server: EmbeddedRedis,
    fixture_dir: Path,
    tmp_path: Path,
    http: aiohttp.ClientSession,
) -> None:
    """The current version changes mid-stream by a rollback through Redis (an operator's way), so A retires
    the version B streams on and sweeps while the stream runs. The replica's engine is paused meanwhile, so
    the stream is in flight for certain until A's sweep has found B's lease (A's deferred-unload count)."""
    store, redis_url, replica = tmp_path / "store", redis_server.url, vllm_replicas[0]
    v1 = await publish("fleet-a", fixture_dir / "adapters" / "v1", redis_server, store)
    v2 = await publish("fleet-a", fixture_dir / "adapters" / "v2", redis_server, store)
    async with Redis.from_url(redis_url) as redis:
        table = EpochTable(redis)
        await table.rollback("fleet-a", v1["digest"], v1["base"])  # v1 current, v2 one rollback away
        async with (
            make_gateway(**FAST) as gateway_a,
            kvgate_process(vllm_replicas, redis_url, store, http) as (url_b, b),
        ):

            def deferred(reason: str = "leased") -> float:
                labels = {"replica": replica.url, "reason": reason}
                value = gateway_a.metrics.registry.get_sample_value(DEFERRED, labels)
                return value or 0.0

            notes: list[str] = []  # what the replica's leases were as each stream began

            async def deferral(what: str) -> None:
                """Wait until A's sweep puts off an unload for B's lease; on failure, say what A saw."""
                before = deferred()
                try:
                    await eventually(lambda: deferred() > before, what)
                except pytest.fail.Exception:
                    headers = {ADMIN_TOKEN_HEADER: ADMIN_TOKEN}
                    async with http.get(f"{gateway_a.url}/kvgate/status", headers=headers) as response:
                        seen = [r for r in (await response.json())["replicas"] if r["url"] == replica.url]
                    held = await redis.hgetall(keys.leases(replica.url))
                    unloads = {s.labels["reason"]: s.value for m in gateway_a.metrics.registry.collect()
                               for s in m.samples if s.name == "kvgate_adapter_unloads_total"}  # fmt: skip
                    b_log = (tmp_path / "kvgate-b.log").read_text(errors="replace").splitlines()
                    said = [line for line in b_log if "aiohttp.access" not in line and (
                        "fleet-a" in line or "lease" in line or " INFO " not in line)][-30:]  # fmt: skip
                    pytest.fail(f"{what}: A's view of the replica {seen}, its other deferrals "
                                f"{deferred('unloading')}, its unloads {unloads}, the replica's leases in "
                                f"Redis {held}, {notes}, B's stream {ended(stream)}, "
                                f"B's exit {b.returncode}, B said {said}")  # fmt: skip

            with ExitStack() as paused:  # the engine slowed, held at B's first chunk, resumed on leaving
                began = asyncio.Event()
                stream = asyncio.create_task(long_stream(http, url_b, "fleet-a", replica, paused, began))
                await until_paused(began, stream)
                notes.append(
                    f"leases as the first stream began {await redis.hgetall(keys.leases(replica.url))}"
                )
                await table.rollback("fleet-a", v2["digest"], v2["base"])
                await deferral("A's sweep puts off unloading v1: B leases it")
                assert not stream.done(), "the engine is paused: B's stream is in flight"
                assert v1["name"] in await loaded(http, replica), "A left v1 to B's stream"
            chunks, broke = await stream
            assert (chunks, broke) == (STREAM_TOKENS, False), "B's stream ran to its end while A retired v1"

            async def v1_gone() -> bool:
                return v1["name"] not in await loaded(http, replica)

            # A unloads v1 once B's lease on it ends: done before the engine is paused again, or that
            # unload would wait on the paused engine and hold A's sweep
            await eventually(v1_gone, "A unloads the retired v1 once B's stream ended", within=60)
            with ExitStack() as paused:  # now B streams on v2, v1 comes back, and B dies mid-stream
                began = asyncio.Event()
                stream = asyncio.create_task(long_stream(http, url_b, "fleet-a", replica, paused, began))
                await until_paused(began, stream)
                notes.append(
                    f"leases as the second stream began {await redis.hgetall(keys.leases(replica.url))}"
                )
                v2_name = next(
                    name for name in await loaded(http, replica) if name != v1["name"] and "fleet-a@" in name
                )
                await table.rollback("fleet-a", v1["digest"], v1["base"])
                await deferral("A's sweep puts off unloading v2: B leases it")
                assert not stream.done(), "B still streams on v2"
                assert v2_name in await loaded(http, replica), "B's lease holds v2 while B lives"
                b.send_signal(signal.SIGKILL)
                await b.wait()
            stream.cancel()

            async def v2_gone() -> bool:
                return v2_name not in await loaded(http, replica)

            await eventually(
                v2_gone, "A unloads v2 once the killed B's lease expired (lease_ttl 10 s)", within=60
            )


async def test_an_eviction_never_takes_the_adapter_b_streams_on(
    make_gateway: GatewayFactory,
    vllm_replicas: list[VllmProcess],
    redis_server: EmbeddedRedis,
    fixture_dir: Path,
    tmp_path: Path,
    http: aiohttp.ClientSession,
) -> None:
    store, redis_url, replica = tmp_path / "store", redis_server.url, vllm_replicas[1]
    a = await publish("budget-a", fixture_dir / "adapters" / "v1", redis_server, store)
    await publish("budget-b", fixture_dir / "adapters" / "v2", redis_server, store)
    async with (
        make_gateway(**FAST, max_adapters_per_replica=1, slot_wait_timeout=0.5) as gateway_a,
        kvgate_process(vllm_replicas, redis_url, store, http) as (url_b, _),
    ):
        headers = {PIN_HEADER: replica.url, ADMIN_TOKEN_HEADER: ADMIN_TOKEN}
        with ExitStack() as paused:  # B's stream stays in flight while A waits for a slot
            began = asyncio.Event()
            stream = asyncio.create_task(long_stream(http, url_b, "budget-a", replica, paused, began))
            await until_paused(began, stream)
            ask = complete(http, gateway_a.url, "budget-b", "p", max_tokens=1, headers=headers)
            with pytest.raises(AuditError) as full:  # budget full, its one adapter in use by B
                await asyncio.wait_for(ask, 60)  # an eviction's unload would wait on the paused engine
            assert not stream.done(), "the engine is paused: B's stream is in flight"
            assert a["name"] in await loaded(http, replica), "A evicted the adapter B streams on"
        assert await stream == (STREAM_TOKENS, False)
    assert "503" in str(full.value)
    assert "adapter_budget_full" in str(full.value)


async def test_an_out_of_band_load_is_quarantined_reported_and_repaired(
    make_gateway: GatewayFactory,
    vllm_replicas: list[VllmProcess],
    redis_server: EmbeddedRedis,
    fixture_dir: Path,
    tmp_path: Path,
    http: aiohttp.ClientSession,
) -> None:
    store, replica = tmp_path / "store", vllm_replicas[0]
    v1 = await publish("oob", fixture_dir / "adapters" / "v1", redis_server, store)
    by_hand = tmp_path / "by-hand"
    shutil.copytree(fixture_dir / "adapters" / "v2", by_hand)  # other bytes, under kvgate's versioned name
    await post_json(
        http, f"{replica.url}/v1/load_lora_adapter", {"lora_name": v1["name"], "lora_path": str(by_hand)}
    )
    async with make_gateway(**FAST) as gateway:

        async def repaired() -> bool:
            return (await loaded(http, replica)).get(v1["name"]) != str(by_hand)

        await eventually(repaired, "the foreign copy is unloaded", within=60)
        pin = {PIN_HEADER: replica.url, ADMIN_TOKEN_HEADER: ADMIN_TOKEN}
        answer = await complete(http, gateway.url, "oob", "p", max_tokens=1, headers=pin)
        counted = gateway.metrics.registry.get_sample_value(
            "kvgate_quarantines_total", {"replica": replica.url, "reason": "foreign-root"}
        )
    assert counted == 1, "quarantined once, as foreign-root"
    assert answer.evidence["x-kvgate-version"] == v1["name"]
    assert (await loaded(http, replica))[v1["name"]] == v1["path"], "reloaded from the store"


async def test_the_canary_catches_a_replica_serving_other_bytes_under_a_versioned_name(
    make_gateway: GatewayFactory,
    vllm_replicas: list[VllmProcess],
    redis_server: EmbeddedRedis,
    fixture_dir: Path,
    tmp_path: Path,
    http: aiohttp.ClientSession,
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = tmp_path / "store"
    v1 = await publish("canary", fixture_dir / "adapters" / "v1", redis_server, store)
    good, bad = vllm_replicas
    pin = {PIN_HEADER: good.url, ADMIN_TOKEN_HEADER: ADMIN_TOKEN}
    async with make_gateway(**FAST) as loader:  # no canary yet: it would read the store while it is swapped
        await complete(http, loader.url, "canary", "p", max_tokens=1, headers=pin)  # v1 on the good one
    path = Path(v1["path"])  # other bytes at the very path the bad replica loads from, then put back
    saved = swap_bytes(path, fixture_dir / "adapters" / "v2")
    try:
        await post_json(
            http, f"{bad.url}/v1/load_lora_adapter", {"lora_name": v1["name"], "lora_path": v1["path"]}
        )
    finally:
        swap_back(path, saved)
    caplog.set_level(logging.ERROR, logger="gateway.fleet.quarantine")
    async with make_gateway(**FAST, canary_interval=0.5) as gateway:  # both list v1 from its store path
        registry = gateway.metrics.registry

        def verdicts(replica: VllmProcess, verdict: str) -> float:
            labels = {"logical_id": "canary", "replica": replica.url, "verdict": verdict}
            return registry.get_sample_value("kvgate_audit_verdicts_total", labels) or 0

        await complete(http, gateway.url, "canary", "p", max_tokens=1, headers=pin)  # the ID is active

        async def caught() -> bool:
            return verdicts(bad, "replica-mismatch") >= 1

        await eventually(caught, "the canary says replica-mismatch for the bad replica", within=120)

        async def status() -> dict[str, Any]:
            headers = {ADMIN_TOKEN_HEADER: ADMIN_TOKEN}
            async with http.get(f"{gateway.url}/kvgate/status", headers=headers) as response:
                page: dict[str, Any] = await response.json()
                return page

        async def repaired() -> bool:  # the quarantined copy is unloaded (no kvgate leases it there)
            return v1["name"] not in await loaded(http, bad) and (await status())["quarantined"] == []

        await eventually(repaired, "the bad replica's copy of v1 is unloaded and out of quarantine", 60)
        last = (await status())["audits"]["canary"]  # the status page's "last audit verdict", per replica
        repairs = registry.get_sample_value(
            "kvgate_adapter_unloads_total", {"replica": bad.url, "reason": "repair"}
        )
        quarantines = {  # every quarantine this kvgate made, by (replica, reason): a counter, so a finding
            tuple(s.labels.values()): s.value  # lifted by the repair above still counts here
            for m in registry.collect() if m.name == "kvgate_quarantines"
            for s in m.samples if s.name.endswith("_total") and s.value
        }  # fmt: skip
    assert verdicts(good, "replica-mismatch") == 0
    assert quarantines == {(bad.url, "canary: replica-mismatch"): 1}, "the bad replica alone, once"
    quarantine_log = [r.args for r in caplog.records if r.name == "gateway.fleet.quarantine"
                      and str(r.msg).startswith("quarantined")]  # fmt: skip
    assert [args[:3] for args in quarantine_log if isinstance(args, tuple)] == [
        (v1["name"], bad.url, "canary: replica-mismatch")
    ], "quarantined v1 on the bad replica, nothing else"
    assert repairs == 1, "the quarantined copy was unloaded by the repair"
    assert v1["name"] in await loaded(http, good), "the good replica's v1 was never quarantined nor unloaded"
    assert last[good.url]["verdict"] == "coherent"
    assert last[bad.url]["name"] == v1["name"]
