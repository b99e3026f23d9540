"""Streams at the edge: clients that leave, and crowds of slow streams (stub replicas, real Redis).

The stubs answer at an LLM's pace (a delay per SSE chunk) and count the generations whose caller left.
Requests use the base model, which needs no adapter load, so only the edge is under test.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
from redis.asyncio import Redis

from gateway.settings.model import Settings
from tests.request.test_proxy import ADMIN_TOKEN, client, stubs
from tests.support.conditions import eventually
from tests.support.serve_modes import (
    IN_PROCESS_ONLY,
    serve_shape,  # noqa: F401  (autouse: every test here runs in both shapes)
    serving,
)


@asynccontextmanager
async def kvgate(redis: Redis, tmp_path: Path, replicas: list[str], **overrides: Any) -> AsyncIterator[str]:
    """kvgate in front of ``replicas``; polls are rare, so health changes only by what requests do."""
    overrides.setdefault("poll_interval", 60)
    settings = Settings(replicas=replicas, store=tmp_path / "store", admin_token=ADMIN_TOKEN, **overrides)
    async with serving(settings, redis, tmp_path / "serve") as url:
        yield url


STREAM = {"model": "base", "prompt": "p", "stream": True}


async def replica_health(url: str) -> dict[str, bool]:
    async with (
        aiohttp.ClientSession() as http,
        http.get(f"{url}/kvgate/status", headers={"x-kvgate-admin-token": ADMIN_TOKEN}) as response,
    ):
        status = await response.json()
    return {replica["url"]: replica["healthy"] for replica in status["replicas"]}


async def metric(url: str, line_start: str) -> float:
    """The value of the first ``/metrics`` sample whose line starts with ``line_start`` (0 if none)."""
    async with (
        aiohttp.ClientSession() as http,
        http.get(f"{url}/metrics", headers={"x-kvgate-admin-token": ADMIN_TOKEN}) as response,
    ):
        text = await response.text()
    for line in text.splitlines():
        if line.startswith(line_start):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def abort_after_first_chunk(url: str) -> None:
    """Open a stream, read its first event, and close the connection (a client that leaves)."""
    async with aiohttp.ClientSession() as http:
        response = await http.post(f"{url}/v1/completions", json=STREAM)
        assert response.status == 200
        await response.content.readuntil(b"\n\n")
        response.close()  # the connection goes, mid-stream


async def full_stream(http: aiohttp.ClientSession, url: str) -> str:
    async with http.post(f"{url}/v1/completions", json=STREAM) as response:
        text = await response.text()
        return f"{response.status} {text}"


def completed(answer: str, chunks: int) -> bool:
    """A 200 stream with every chunk, ``[DONE]`` and no error event."""
    return (
        answer.startswith("200 ")
        and answer.count("data: ") == chunks + 1
        and answer.rstrip().endswith("data: [DONE]")
        and '"error"' not in answer
    )


async def test_a_client_that_closes_streams_takes_no_replica_out_of_service(
    redis: Redis, tmp_path: Path
) -> None:
    aborted, normal = 6, 6
    async with stubs(2) as backends:
        for _, state in backends:
            state.chunks, state.chunk_delay = 20, 0.05
        async with kvgate(redis, tmp_path, [u for u, _ in backends]) as url, client(url) as api:

            async def other_client() -> list[str]:
                texts = []
                for _ in range(normal):
                    stream = await api.completions.create(model="base", prompt="p", stream=True)
                    texts.append("".join([chunk.choices[0].text async for chunk in stream]))
                return texts

            async def aborting_client() -> None:
                for _ in range(aborted):
                    await abort_after_first_chunk(url)

            texts, _ = await asyncio.gather(other_client(), aborting_client())

            def cancelled() -> int:
                return sum(state.cancelled for _, state in backends)

            async def all_cancelled() -> bool:
                return cancelled() == aborted

            await eventually(all_cancelled, "every aborted stream is cancelled at its replica")
            health = await replica_health(url)
            closed_series = 'kvgate_requests_total{logical_id="base",outcome="client_closed"}'

            async def all_counted() -> bool:  # with workers, a sibling's page is up to a second old
                return await metric(url, closed_series) == aborted

            await eventually(all_counted, "every aborted stream counted client_closed")
            closed = await metric(url, closed_series)
            retries = await metric(url, 'kvgate_routing_decisions_total{decision="retry"}')
    assert texts == ["".join(f"t{i}" for i in range(20))] * normal
    assert health == {u: True for u, _ in backends}
    assert sum(state.completions for _, state in backends) == aborted + normal  # no duplicate generation
    assert retries == 0
    assert closed == aborted


async def test_a_client_that_leaves_a_pending_request_cancels_it_upstream(
    redis: Redis, tmp_path: Path
) -> None:
    async with stubs(1) as backends:
        stub_url, stub = backends[0]
        stub.reply_delay = 60.0
        async with kvgate(redis, tmp_path, [stub_url]) as url:
            body = {"model": "base", "prompt": "p"}
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.5)) as http:
                try:
                    async with http.post(f"{url}/v1/completions", json=body) as response:
                        raise AssertionError(f"answered while the stub waits: {response.status}")
                except TimeoutError:
                    pass  # the client gave up and closed its connection

            async def cancelled_upstream() -> bool:
                return stub.cancelled == 1

            await eventually(cancelled_upstream, "the stub saw the upstream request cancelled")
            health = await replica_health(url)
    assert stub.completions == 1
    assert health == {stub_url: True}


# The cap is per process: with --workers each worker holds its own (docs/workers.md), and which worker a
# connection reaches is the kernel's choice, so the exact cap is tested on one process.
@IN_PROCESS_ONLY
async def test_over_the_per_replica_limit_a_request_waits_then_gets_replica_busy(
    redis: Redis, tmp_path: Path
) -> None:
    async with stubs(1) as backends:
        stub_url, stub = backends[0]
        stub.chunks, stub.chunk_delay = 20, 0.1
        limits = {"max_connections_per_replica": 2, "pool_wait_timeout": 0.2}
        async with kvgate(redis, tmp_path, [stub_url], **limits) as url, aiohttp.ClientSession() as http:
            holding = [await http.post(f"{url}/v1/completions", json=STREAM) for _ in range(2)]
            for response in holding:  # both hold a connection to the replica (their first event is in)
                await response.content.readuntil(b"\n\n")
            async with http.post(f"{url}/v1/completions", json=STREAM) as third:
                status, error = third.status, (await third.json())["error"]
            finished = [await response.text() for response in holding]
            for response in holding:
                response.release()
            health = await replica_health(url)
    assert status == 503
    assert error["code"] == "replica_busy"
    assert "waited 0.2 s for a free connection" in error["message"]
    assert "max_connections_per_replica" in error["message"]
    assert all("data: [DONE]" in text and '"error"' not in text for text in finished)
    assert health == {stub_url: True}
    assert stub.completions == 2


async def test_hundreds_of_slow_streams_to_one_replica_all_complete(redis: Redis, tmp_path: Path) -> None:
    """More streams than aiohttp's old hidden per-host pool (256), each longer than the connect timeout:
    waiting for a pooled connection used to count against it and fail as "replica timed out"."""
    # each stream 8 s: twice the connect timeout, which has room for 300 connects at once on a machine
    # busy with other tests (at 2 s a fresh-clone run saw 260 of them time out: one loop runs the clients,
    # kvgate and the stub)
    streams, chunks = 300, 16
    async with stubs(1) as backends:
        stub_url, stub = backends[0]
        stub.chunks, stub.chunk_delay = chunks, 0.5
        async with (
            kvgate(redis, tmp_path, [stub_url], connect_timeout=4.0) as url,
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http,
        ):
            answers = await asyncio.gather(*(full_stream(http, url) for _ in range(streams)))
    failed = [answer[:300] for answer in answers if not completed(answer, chunks)]
    assert failed == []
    assert stub.completions == streams
