"""Graceful drain on SIGTERM: /healthz 503 at once, new requests refused, running streams finish,
leases let go, exit 0 (``kvgate serve`` as a process, stub replica, real Redis)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from pathlib import Path

import aiohttp
import openai
import pytest
from aiohttp import web
from redis.asyncio import Redis

from gateway.adapters.publish import publish_adapter
from gateway.adapters.store import AdapterStore
from gateway.app.wiring import build_app
from gateway.process.http_edge import free_port, running
from gateway.request.boundary import Handler
from gateway.settings.model import Settings
from gateway.table import keys
from gateway.table.epoch_table import EpochTable
from gateway.table.redis_server import EmbeddedRedis
from tests.support.adapter_files import MakeAdapter
from tests.support.conditions import eventually, until_healthy
from tests.support.stub_backend import StubState, build_stub


async def test_sigterm_drains_then_exits_0(
    redis: Redis, table: EpochTable, redis_server: EmbeddedRedis, make_adapter: MakeAdapter, tmp_path: Path
) -> None:
    store = AdapterStore(tmp_path / "store")
    await publish_adapter(table, store, "tenant-42", make_adapter(b"v1"), "base")
    state = StubState(chunks=20, chunk_delay=0.1)
    async with running(build_stub(state)) as stub, aiohttp.ClientSession() as http:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        command = [sys.executable, "-m", "gateway.cli", "serve", "--replica", stub, "--port", str(port),
                   "--redis-url", redis_server.url, "--store", str(store.root), "--gateway-id", "gw-drain",
                   "--shutdown-timeout", "30"]  # fmt: skip
        server = await asyncio.create_subprocess_exec(*command, stderr=asyncio.subprocess.PIPE)
        try:
            await until_healthy(url)
            async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as api:
                stream = await api.completions.create(
                    model="tenant-42", prompt="p", max_tokens=20, stream=True
                )
                texts = [(await anext(aiter(stream))).choices[0].text]
                assert await redis.hkeys(keys.leases(stub)), "the running stream holds a lease"
                server.send_signal(signal.SIGTERM)

                async def draining() -> bool:  # as soon as the process has taken the signal
                    async with http.get(f"{url}/healthz") as health:
                        return health.status == 503 and (await health.json())["draining"] is True

                await eventually(draining, "/healthz answers 503 draining", within=5)
                with pytest.raises(openai.APIStatusError) as refused:
                    await api.completions.create(model="tenant-42", prompt="p", max_tokens=1)
                texts += [chunk.choices[0].text async for chunk in stream]
            _, err = await asyncio.wait_for(server.communicate(), timeout=60)
        finally:
            if server.returncode is None:
                server.kill()
                await server.wait()
    assert refused.value.status_code == 503
    assert "shutting down" in str(refused.value.body)
    assert texts == [f"t{i}" for i in range(20)], "the running stream finished"
    assert server.returncode == 0, err.decode()[-2000:]
    assert await redis.hkeys(keys.leases(stub)) == [], "its leases were let go"


PROMPT = "a client's prompt"
SHUTDOWN_500 = {"error": {"message": "cannot schedule new futures after shutdown",
                          "type": "InternalServerError", "param": None, "code": 500}}  # fmt: skip
"""What a vLLM replica answers its last requests while it stops (its tokenizer's executor is shut down)."""


def going_down(state: StubState, answered: list[int]) -> web.Application:
    """A stub replica that stops while answering: its completions answer vLLM's shutdown 500 (each one
    counted in ``answered``), and from then on it answers nothing else (as a stopped vLLM)."""
    app = build_stub(state)

    @web.middleware
    async def stopping(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path == "/v1/completions" and PROMPT in await request.text():  # not kvgate's base print
            answered.append(500)
            return web.json_response(SHUTDOWN_500, status=500)
        if answered:
            assert request.transport is not None
            request.transport.close()
        return await handler(request)

    app.middlewares.append(stopping)
    return app


@pytest.mark.parametrize("others", [0, 1])
async def test_a_replica_that_answers_500_as_it_stops_is_retried_elsewhere_or_a_503(
    redis: Redis, others: int, tmp_path: Path
) -> None:
    """The chaos run's 500 "cannot schedule new futures after shutdown" was a vLLM replica's own answer
    while it stopped, relayed as it was: a request that meets a replica going down goes to another one,
    or gets a 503 that says so."""
    answered: list[int] = []
    held = asyncio.Event()  # a stream on the healthy replica holds it busy: the next request is the other's
    async with contextlib.AsyncExitStack() as stack:
        stopping = await stack.enter_async_context(running(going_down(StubState(), answered)))
        healthy = [await stack.enter_async_context(running(build_stub(StubState(hold=held))))
                   for _ in range(others)]  # fmt: skip
        settings = Settings(replicas=[stopping, *healthy], data_dir=tmp_path, poll_interval=60.0)
        url = await stack.enter_async_context(running(build_app(settings, redis)))
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as api:
            if others:  # the stream meets the stopping replica (retried on the healthy one), or the next does
                stream = await api.completions.create(model="base", prompt=PROMPT, max_tokens=4, stream=True)
                assert (await anext(aiter(stream))).choices, "its first chunk, from the healthy replica"
                if not answered:
                    done = await api.completions.create(model="base", prompt=PROMPT, max_tokens=1)
                    assert done.choices, "answered, after the stopping replica's 500: by the other replica"
                held.set()
                assert [chunk async for chunk in stream], "the rest of the stream"
            else:
                with pytest.raises(openai.APIStatusError) as refused:
                    await api.completions.create(model="base", prompt=PROMPT, max_tokens=1)
                assert refused.value.status_code == 503, refused.value.message
                assert "went down" in refused.value.message
        assert answered == [500], "the stopping replica met one request"
