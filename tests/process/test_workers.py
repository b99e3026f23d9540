"""``kvgate serve --workers N`` as a real subprocess: a parent, its workers, the embedded Redis it owns, stub
replicas in this process. Each worker's own views are read on its private socket (``siblings.py``), the
merged ones on the public port, so a test sees both what each worker did and what any worker answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import msgpack
import pytest
import zmq
import zmq.asyncio

from gateway.cli.main import main
from gateway.core.wire import PREFIX_MATCH_HEADER, REPLICA_HEADER
from gateway.process.http_edge import free_port, running
from gateway.process.parent import worker_count
from gateway.process.siblings import socket_path
from gateway.settings.model import Settings
from gateway.table.redis_server import EmbeddedRedis
from tests.kv.test_tokens import model_dir  # noqa: F401  (a small real tokenizer for kv_events)
from tests.support.adapter_files import MakeAdapter
from tests.support.conditions import STARTS_WITHIN_S, eventually
from tests.support.stub_backend import StubState, build_stub

TOKEN = "workers-admin-token"
ADMIN = {"x-kvgate-admin-token": TOKEN}
APPLIED_PUBLISH = 'kvgate_table_log_entries_total{action="publish"}'
MAX_STREAMS = 24  # streams opened one by one until each worker holds one (both at 1 in 2**23 by chance)


@dataclass
class Served:
    url: str
    data: Path
    process: asyncio.subprocess.Process
    log: Path

    async def health(self) -> tuple[int, dict[str, Any]]:
        connector = aiohttp.TCPConnector(force_close=True)  # a new connection: any worker may take it
        async with aiohttp.ClientSession(connector=connector) as http, http.get(f"{self.url}/healthz") as r:
            return r.status, await r.json()

    async def own(self, slot: int, path: str) -> bytes | None:
        """Worker ``slot``'s own view (its private socket), or None if it does not answer."""
        connector = aiohttp.UnixConnector(path=str(socket_path(self.data, slot)))
        with contextlib.suppress(aiohttp.ClientError, OSError):
            async with aiohttp.ClientSession(connector=connector) as http, http.get(f"http://w{path}") as r:
                return await r.read()
        return None

    async def merged_metrics(self) -> str:
        async with aiohttp.ClientSession() as http, http.get(f"{self.url}/metrics", headers=ADMIN) as r:
            assert r.status == 200
            return await r.text()

    def text(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]


def sample(page: str | bytes | None, line_start: str) -> float:
    text = page.decode() if isinstance(page, bytes) else page or ""
    for line in text.splitlines():
        if line.startswith(line_start + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@contextlib.asynccontextmanager
async def serve(data: Path, stub_url: str, *extra: str, workers: int = 2) -> AsyncIterator[Served]:
    port = free_port()
    command = [sys.executable, "-m", "gateway.cli", "serve", "--replica", stub_url, "--port", str(port),
               "--data-dir", str(data), "--store", str(data / "store"), "--workers", str(workers),
               "--poll-interval", "0.2", "--reconcile-interval", "0.2", *extra]  # fmt: skip
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("KVGATE_")},
        "KVGATE_ADMIN_TOKEN": TOKEN,
    }
    log = data.parent / f"serve-{port}.log"
    with log.open("wb") as out:
        process = await asyncio.create_subprocess_exec(*command, stdout=out, stderr=out, env=env)
    served = Served(f"http://127.0.0.1:{port}", data, process, log)
    try:

        async def all_ready() -> bool:
            with contextlib.suppress(aiohttp.ClientError):
                status, body = await served.health()
                return status == 200 and [w["state"] for w in body["workers"]] == ["ready"] * workers
            assert process.returncode is None, served.text()
            return False

        await eventually(all_ready, f"{workers} workers ready", within=STARTS_WITHIN_S)
        yield served
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGTERM)
            await asyncio.wait_for(process.wait(), timeout=60)


async def publish(data: Path, stub_url: str, logical_id: str, adapter: Path) -> str:
    command = [sys.executable, "-m", "gateway.cli", "publish", logical_id, str(adapter), "--json",
               "--replica", stub_url, "--data-dir", str(data), "--store", str(data / "store")]  # fmt: skip
    done = await asyncio.create_subprocess_exec(*command, stdout=asyncio.subprocess.PIPE)
    out, _ = await done.communicate()
    assert done.returncode == 0
    name: str = json.loads(out)["name"]
    return name


async def complete(url: str, model: str) -> int:
    connector = aiohttp.TCPConnector(force_close=True)
    body = {"model": model, "prompt": "p", "max_tokens": 1}
    async with (
        aiohttp.ClientSession(connector=connector) as http,
        http.post(f"{url}/v1/completions", json=body) as answer,
    ):
        await answer.read()
        return answer.status


async def test_two_workers_serve_a_later_publish_and_metrics_sum_both(
    make_adapter: MakeAdapter, tmp_path: Path
) -> None:
    stub, data = StubState(), tmp_path / "kvgate"
    async with running(build_stub(stub)) as stub_url, serve(data, stub_url) as served:
        status, body = await served.health()
        pids = {worker["pid"] for worker in body["workers"]}
        assert status == 200
        assert len(pids) == 2
        assert served.process.pid not in pids
        owner = json.loads((data / "redis" / "owner.lock").read_text() or "{}")
        assert owner.get("pid") == served.process.pid, "the parent owns the embedded Redis"
        name = await publish(data, stub_url, "tenant-42", make_adapter(b"v1"))  # after both started

        async def both_applied() -> bool:  # each worker follows the change log on its own
            pages = await asyncio.gather(served.own(0, "/metrics"), served.own(1, "/metrics"))
            return all(sample(page, APPLIED_PUBLISH) >= 1 for page in pages)

        await eventually(both_applied, "both workers applied the publish")
        series = 'kvgate_requests_total{logical_id="tenant-42",outcome="200"}'
        sent, answered = 0, set[int]()
        while len(answered) < 2 and sent < 400:  # new connections until both workers served some
            statuses = await asyncio.gather(*(complete(served.url, "tenant-42") for _ in range(10)))
            assert statuses == [200] * 10
            sent += 10
            pages = await asyncio.gather(served.own(0, "/metrics"), served.own(1, "/metrics"))
            answered = {slot for slot, page in enumerate(pages) if sample(page, series) > 0}
        assert answered == {0, 1}, f"one worker took all {sent} connections"
        assert sum(sample(page, series) for page in pages) == sent

        async def summed() -> bool:  # whichever worker answers the scrape; a sibling's page is ≤ 1 s old
            return sample(await served.merged_metrics(), series) == sent

        await eventually(summed, f"the merged page counts all {sent} requests")
        assert {r["model"] for r in stub.received if r.get("prompt") == "p"} == {name}
    assert served.process.returncode == 0, served.text()
    assert not EmbeddedRedis(data).answers(), "the embedded Redis stops with the parent"


async def test_sigterm_drains_every_worker_and_exits_0(tmp_path: Path) -> None:
    stub, data = StubState(chunks=50, chunk_delay=0.1), tmp_path / "kvgate"
    stream = {"model": "base", "prompt": "p", "stream": True, "max_tokens": 50}
    async with running(build_stub(stub)) as stub_url, serve(data, stub_url) as served:
        https: list[aiohttp.ClientSession] = []
        answers: list[aiohttp.ClientResponse] = []
        try:
            begun = [0.0, 0.0]
            while not all(begun):  # the kernel hands connections to whichever worker accepts first
                assert len(answers) < MAX_STREAMS, f"streams per worker {begun}: both must hold one"
                https.append(aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)))
                answers.append(await https[-1].post(f"{served.url}/v1/completions", json=stream))
                await answers[-1].content.readuntil(b"\n\n")  # this stream has begun
                pages = await asyncio.gather(served.own(0, "/metrics"), served.own(1, "/metrics"))
                begun = [sample(page, "kvgate_time_to_first_byte_seconds_count") for page in pages]
            served.process.send_signal(signal.SIGTERM)
            rests = [await answer.text() for answer in answers]
        finally:
            for http in https:
                await http.close()
        code = await asyncio.wait_for(served.process.wait(), timeout=60)
    assert all(rest.rstrip().endswith("data: [DONE]") for rest in rests)
    assert (stub.finished, stub.cancelled) == (len(answers), 0)
    assert code == 0, served.text()
    assert "draining" in served.text()


async def test_a_killed_worker_is_restarted_and_counted_and_the_merged_counters_never_drop(
    tmp_path: Path,
) -> None:
    data = tmp_path / "kvgate"
    async with running(build_stub(StubState())) as stub_url, serve(data, stub_url) as served:
        sent = 0
        while sample(await served.own(1, "/metrics"), "kvgate_request_duration_seconds_count") == 0:
            assert sent < 400, "worker 1 took no connection"
            await asyncio.gather(*(complete(served.url, "base") for _ in range(10)))
            sent += 10

        async def counted(want: int) -> bool:
            return sample(await served.merged_metrics(), "kvgate_request_duration_seconds_count") == want

        await eventually(lambda: counted(sent), f"the merged page counts all {sent} requests")
        _, body = await served.health()
        victim = body["workers"][1]
        os.kill(victim["pid"], signal.SIGKILL)
        statuses = await asyncio.gather(*(complete(served.url, "base") for _ in range(20)))
        assert statuses == [200] * 20, "the other worker takes every connection meanwhile"
        assert sample(await served.merged_metrics(), "kvgate_request_duration_seconds_count") >= sent, (
            "a dead worker's requests still count"
        )

        async def back() -> bool:
            _, now = await served.health()
            slot = now["workers"][1]
            return bool(slot["state"] == "ready" and slot["pid"] != victim["pid"] and slot["restarts"] == 1)

        await eventually(back, "worker 1 restarted and ready", within=STARTS_WITHIN_S)
        await eventually(lambda: counted(sent + 20), "the new worker 1 carries the old one's counts on")
        page = await served.merged_metrics()
        assert sample(page, 'kvgate_worker_restarts_total{worker="1"}') == 1
        assert sample(page, 'kvgate_worker_restarts_total{worker="0"}') == 0
        assert sample(page, "kvgate_workers_answering") == 2
    assert served.process.returncode == 0
    assert f"worker 1 (pid {victim['pid']}) exited with signal SIGKILL; restarting it" in served.text()


PROMPT = list(range(1, 33))  # token ids: 8 blocks of 4
PRECISE = 'kvgate_prefix_matched_blocks_count{source="precise"}'


@dataclass
class Events:
    """A replica's KV event publisher (a real XPUB socket: it sees every subscription)."""

    socket: zmq.asyncio.Socket
    endpoint: str
    seq: int = 0
    subscriptions: int = 0

    async def subscribed(self, within: float = 30.0) -> None:
        """Wait for one more subscription."""
        want = self.subscriptions + 1
        while self.subscriptions < want:
            assert await self.socket.poll(int(within * 1000)), "a subscription"
            self.subscriptions += (await self.socket.recv()).startswith(b"\x01")

    async def no_more_subscriptions(self) -> None:
        while await self.socket.poll(0):
            self.subscriptions += (await self.socket.recv()).startswith(b"\x01")

    async def store(self, salt: str | None, *, age: float = 0.0) -> None:
        """The replica stored ``PROMPT``'s blocks (salted as kvgate salts base requests), stamped ``age``
        seconds ago."""
        stored = {"type": "BlockStored", "block_hashes": [1000 * (self.seq + 1) + i for i in range(8)],
                  "parent_block_hash": None, "token_ids": PROMPT, "block_size": 4,
                  "extra_keys": [None if salt is None else [salt]] + [None] * 7}  # fmt: skip
        payload = msgpack.packb([time.time() - age, [stored], 0])
        await self.socket.send_multipart([b"kv", self.seq.to_bytes(8, "big"), payload])
        self.seq += 1


@contextlib.asynccontextmanager
async def publisher() -> AsyncIterator[Events]:
    context = zmq.asyncio.Context()
    pub = context.socket(zmq.XPUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscriber's subscription, not only the first
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    pub.bind(endpoint)
    try:
        yield Events(pub, endpoint)
    finally:
        pub.close()
        context.term()


async def route(url: str) -> tuple[str, str]:
    """``PROMPT`` through kvgate on a new connection (any worker may take it): the replica that served
    it and what the decision matched."""
    connector = aiohttp.TCPConnector(force_close=True)
    body = {"model": "base", "prompt": PROMPT, "max_tokens": 1}
    async with (
        aiohttp.ClientSession(connector=connector) as http,
        http.post(f"{url}/v1/completions", json=body) as r,
    ):
        assert r.status == 200, await r.text()
        return r.headers[REPLICA_HEADER], r.headers[PREFIX_MATCH_HEADER]


async def detail(served: Served) -> dict[str, Any]:
    async with aiohttp.ClientSession() as http, http.get(f"{served.url}/healthz", headers=ADMIN) as r:
        body: dict[str, Any] = await r.json()
        return body


@contextlib.asynccontextmanager
async def precise_kvgate(
    tmp_path: Path, tokenizer: Path, events: Events
) -> AsyncIterator[tuple[Served, str, str | None]]:
    """``kvgate serve --workers 2`` over two stub replicas, the second publishing KV events at
    ``events``, subscribed once; yields it, the replica with events and the salt of base requests."""
    states = StubState(), StubState()
    async with running(build_stub(states[0])) as plain, running(build_stub(states[1])) as holder:
        extra = ("--replica", holder, "--kv-events", "--tokenizer", str(tokenizer), "--expose-replica-urls",
                 "--kv-event-endpoints", f"{holder}={events.endpoint}")  # fmt: skip
        async with serve(tmp_path / "kvgate", plain, *extra) as served:
            await events.subscribed()
            await route(served.url)  # the salt kvgate gives base requests (either replica's)
            yield served, holder, [*states[0].received, *states[1].received][-1].get("cache_salt")


async def test_the_events_are_followed_once_and_every_worker_routes_on_them(
    tmp_path: Path,
    model_dir: Path,  # noqa: F811
) -> None:
    """With --workers 2 the replica's stream is subscribed once (the KV indexer's); both workers send a
    prompt to the replica whose events say it holds it; a worker killed and restarted routes precisely
    again at once, from the shared table, with no new subscription (the stream is not read again)."""
    async with publisher() as events, precise_kvgate(tmp_path, model_dir, events) as (served, holder, salt):
        await events.store(salt)

        async def precise_in(slot: int, above: float = 0) -> bool:
            replica, matched = await route(served.url)
            assert (replica, matched) == (holder, "precise:8") or not matched.startswith("precise")
            return sample(await served.own(slot, "/metrics"), PRECISE) > above

        for slot in (0, 1):
            await eventually(
                functools.partial(precise_in, slot), f"worker {slot} routes precisely", within=30
            )
        _, body = await served.health()
        pid = body["workers"][1]["pid"]
        before = sample(await served.own(1, "/metrics"), PRECISE)
        os.kill(pid, signal.SIGKILL)

        async def back() -> bool:
            status, body = await served.health()
            return (
                status == 200 and body["workers"][1]["state"] == "ready" and body["workers"][1]["pid"] != pid
            )

        await eventually(back, "worker 1 restarted", within=60)
        await eventually(
            functools.partial(precise_in, 1, before), "the new worker 1 routes precisely", within=30
        )
        await events.no_more_subscriptions()
        assert events.subscriptions == 1
        stored = f'kvgate_kv_events_total{{kind="BlockStored",replica="{holder}"}}'
        assert sample(await served.merged_metrics(), stored) == 1  # decoded once, by the indexer


async def test_a_lagging_stream_degrades_to_predicted_and_recovers(
    tmp_path: Path,
    model_dir: Path,  # noqa: F811
) -> None:
    """Batches arriving later than the bound: the replica's view is emptied, its batches dropped and
    counted, /healthz shows its lag and 'lagging' (routing: predicted), and no decision is precise; a
    fresh batch brings it back by itself."""
    async with publisher() as events, precise_kvgate(tmp_path, model_dir, events) as (served, holder, salt):
        await events.store(salt)
        await eventually(lambda: route_matched(served, "precise:8"), "routed precisely", within=30)
        await events.store(salt, age=30)  # 30 s later than the stream's freshest batch

        async def lagging() -> bool:
            replica = (await detail(served))["kv_events"][holder]
            return bool(
                replica["state"] == "lagging" and replica["lag_s"] > 20 and replica["routing"] == "predicted"
            )

        await eventually(lagging, "/healthz shows the replica lagging", within=20)
        _, matched = await route(served.url)
        assert not matched.startswith("precise")
        dropped = f'kvgate_kv_event_batches_dropped_total{{replica="{holder}"}}'
        await eventually(lambda: merged_at_least(served, dropped, 1), "the dropped batch is counted")
        await events.store(salt)  # fresh again

        async def following() -> bool:
            return bool((await detail(served))["kv_events"][holder]["state"] == "following")

        await eventually(following, "following again", within=20)
        await eventually(lambda: route_matched(served, "precise:8"), "routed precisely again", within=30)


async def test_a_killed_indexer_is_restarted_from_an_empty_table_and_learns_again(
    tmp_path: Path,
    model_dir: Path,  # noqa: F811
) -> None:
    """The KV indexer killed with SIGKILL: its keeper (the parent) starts the next generation, whose
    table starts empty (it cannot vouch for what the one before applied: no decision is precise), it
    subscribes again, and the replica's next events route precisely again; the workers never restart."""
    async with publisher() as events, precise_kvgate(tmp_path, model_dir, events) as (served, _, salt):
        await events.store(salt)
        await eventually(lambda: route_matched(served, "precise:8"), "routed precisely", within=30)
        before = await detail(served)
        indexer, workers = before["kv_indexer"], [w["pid"] for w in before["workers"]]
        assert indexer["generation"] == 1
        os.kill(indexer["pid"], signal.SIGKILL)

        async def next_generation() -> bool:
            now = (await detail(served))["kv_indexer"]
            return bool(now["generation"] == 2 and now["pid"] != indexer["pid"])

        await eventually(next_generation, "the indexer's next generation", within=30)
        assert not (await route(served.url))[1].startswith("precise")  # its table starts empty
        await events.subscribed()  # the new indexer's subscription
        await events.store(salt)
        await eventually(lambda: route_matched(served, "precise:8"), "routed precisely again", within=30)
        assert [w["pid"] for w in (await detail(served))["workers"]] == workers


async def route_matched(served: Served, want: str) -> bool:
    return (await route(served.url))[1] == want


async def merged_at_least(served: Served, name: str, value: float) -> bool:
    return sample(await served.merged_metrics(), name) >= value


@pytest.mark.parametrize("value", ["0", "-1", "257"])
def test_a_bad_worker_count_exits_2(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--replica", "http://127.0.0.1:9", "--workers", value]) == 2
    assert "invalid settings: workers:" in capsys.readouterr().err


def test_a_worker_count_that_is_not_a_number_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--replica", "http://127.0.0.1:9", "--workers", "two"])
    assert exited.value.code == 2
    assert "--workers: invalid int value: 'two'" in capsys.readouterr().err


def test_the_default_is_one_worker_per_core_within_the_cgroup_quota(tmp_path: Path) -> None:
    cores = len(os.sched_getaffinity(0))
    cpu_max = tmp_path / "cpu.max"
    assert worker_count(Settings(), cpu_max) == cores  # no cgroup file: the affinity
    cpu_max.write_text("max 100000\n")
    assert worker_count(Settings(), cpu_max) == cores
    cpu_max.write_text("50000 100000\n")  # half a CPU: one worker
    assert worker_count(Settings(), cpu_max) == 1
    cpu_max.write_text(f"{100000 * (cores + 4)} 100000\n")  # a quota above the affinity: the affinity
    assert worker_count(Settings(), cpu_max) == cores
    assert worker_count(Settings(workers=3), cpu_max) == 3
