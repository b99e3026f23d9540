"""What a replica's error becomes on its way to a client, against fast stubs and a real Redis: an answer that
is not an OpenAI-style error (a proxy's plain-text 413, an HTML 502) becomes kvgate's own OpenAI-style body
with the same status; no error body kvgate builds names a replica URL, a versioned name or a library's
exception text (the budget's 503, a stream cut mid-way, an unreachable replica, a failed load)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import re
from typing import Any

import aiohttp
import pytest

from gateway.core.wire import replica_id
from gateway.process.http_edge import running
from tests.request.test_proxy import Gateway, client, stubs
from tests.request.test_proxy import gateway as gateway
from tests.support.conditions import eventually
from tests.support.stub_backend import StubState, build_stub

# What must never reach a client: an exception's class name (aiohttp's ClientPayloadError, ...) or repr.
_LIBRARY_TEXT = re.compile(r"[A-Z][A-Za-z]+(Error|Exception)\b|\w+\(['\"<]|aiohttp|Traceback")


async def complete(url: str, model: str, **extra: Any) -> tuple[int, bytes]:
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{url}/v1/completions", json={"model": model, "prompt": "p", **extra}) as response,
    ):
        return response.status, await response.read()


def assert_nothing_leaks(message: str, replica_url: str) -> None:
    host_port = replica_url.removeprefix("http://")
    assert host_port not in message, message
    assert "@" not in message, message  # no versioned name
    assert _LIBRARY_TEXT.search(message) is None, message


@pytest.mark.parametrize(
    ("status", "body", "content_type", "kind"),
    [
        (413, b"413 Request Entity Too Large\nnginx/1.25 at 10.0.3.7", "text/plain", "invalid_request_error"),
        (
            502,
            b"<html><body>Bad Gateway: upstream 10.0.3.7:8000</body></html>",
            "text/html",
            "upstream_error",
        ),
        (
            422,
            b'{"detail": [{"loc": ["body"], "msg": "internal field x"}]}',
            "application/json",
            "invalid_request_error",
        ),
        (503, b"", "text/plain", "upstream_error"),
        (400, b'{"error": "a string, not an object"}', "application/json", "invalid_request_error"),
    ],
)
async def test_a_replica_error_that_is_not_openai_style_becomes_kvgates_own(
    gateway: Gateway, publish: Any, status: int, body: bytes, content_type: str, kind: str
) -> None:
    async with stubs(1) as backends:
        await publish("tenant-42", b"v1")
        backends[0][1].error_reply = (status, body, content_type)
        async with gateway([backends[0][0]]) as url:
            for model in ("tenant-42", "base"):
                got, answer = await complete(url, model)
                assert got == status, answer
                error = json.loads(answer)["error"]
                assert error["type"] == kind
                said = f"answered {status} without an OpenAI-style error body"
                assert error["message"] == f"replica {replica_id(backends[0][0])} {said}"
                assert b"10.0.3.7" not in answer
                assert_nothing_leaks(error["message"], backends[0][0])


async def test_a_replica_error_that_is_openai_style_is_relayed_under_the_logical_id(
    gateway: Gateway, publish: Any
) -> None:
    async with stubs(1) as backends:
        v1 = await publish("tenant-42", b"v1")
        backends[0][1].echo_errors = True  # 400 {"error": {"message": "`<versioned name>` cannot ..."}}
        async with gateway([backends[0][0]]) as url:
            got, answer = await complete(url, "tenant-42")
    assert got == 400
    assert json.loads(answer)["error"]["message"] == "`tenant-42` cannot take this request"
    assert v1.encode() not in answer


async def test_the_budget_full_503_names_no_replica_url(gateway: Gateway, publish: Any) -> None:
    async with stubs(1) as backends:
        stub_url, state = backends[0]
        state.hold = asyncio.Event()  # tenant-a's stream holds the only adapter slot after its first chunk
        await publish("tenant-a", b"a")
        await publish("tenant-b", b"b")
        async with (
            gateway([stub_url], max_adapters_per_replica=1, slot_wait_timeout=0.3) as url,
            client(url) as api,
        ):
            stream = await api.completions.create(model="tenant-a", prompt="p", stream=True)
            await anext(aiter(stream))
            got, answer = await complete(url, "tenant-b")
            state.hold.set()
            _ = [chunk async for chunk in stream]
    assert got == 503
    error = json.loads(answer)["error"]
    assert error["code"] == "adapter_budget_full"
    assert f"replica {replica_id(stub_url)}" in error["message"]
    assert_nothing_leaks(error["message"], stub_url)


async def test_a_stream_cut_mid_way_ends_with_an_event_in_kvgates_words(
    gateway: Gateway, publish: Any
) -> None:
    async with stubs(1) as backends:
        backends[0][1].break_stream_after = 2
        await publish("tenant-42", b"v1")
        async with gateway([backends[0][0]]) as url:
            got, answer = await complete(url, "tenant-42", stream=True)
    assert got == 200
    events = [line.removeprefix(b"data: ") for line in answer.splitlines() if line.startswith(b"data: ")]
    error = json.loads(events[-1])["error"]
    assert error["type"] == "upstream_error"
    assert error["message"] == "the replica's stream broke off before its end"
    assert_nothing_leaks(error["message"], backends[0][0])


async def test_an_unreachable_replica_and_a_failed_load_name_no_url_nor_library_text(
    gateway: Gateway, publish: Any
) -> None:
    await publish("tenant-42", b"v1")
    async with (
        running(build_stub(StubState(fail_loads="No adapter"))) as refusing,
        gateway([refusing]) as url,
    ):
        failed_load = await complete(url, "tenant-42")
    async with contextlib.AsyncExitStack() as replica:
        state = StubState()
        stub_url = await replica.enter_async_context(running(build_stub(state)))
        async with gateway([stub_url], poll_interval=60) as url:  # no poll: kvgate keeps it healthy
            # the start's listings and the poll's first step, then none for 60 s: a listing after the
            # replica is gone would mark it unhealthy (a 503 "no healthy replica", not this case)
            await eventually(lambda: state.listings >= 2, "the poll's first step")
            listed = -1
            while listed != state.listings:  # quiet for 0.5 s
                listed = state.listings
                await asyncio.sleep(0.5)
            await replica.aclose()  # the replica is gone
            unreachable = await complete(url, "base")
    assert failed_load[0] == 503
    message = json.loads(failed_load[1])["error"]["message"]
    assert "No adapter" in message  # the replica's reason for refusing the load stays
    assert_nothing_leaks(message, refusing)
    assert unreachable[0] == 502
    message = json.loads(unreachable[1])["error"]["message"]
    assert message == f"replica {replica_id(stub_url)} is unreachable"
    assert_nothing_leaks(message, stub_url)


async def test_a_load_whose_requests_all_left_fails_without_an_unretrieved_task(
    gateway: Gateway, publish: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Seen on SIGTERM: a load kept running (shielded) after every request waiting on it was cancelled,
    then failed, and asyncio logged "Task exception was never retrieved". The loader retrieves it: the
    failure is its log line, and the next request loads again."""
    await publish("tenant-42", b"v1")
    async with stubs(1) as backends:
        stub_url, state = backends[0]
        state.load_gate = asyncio.Event()
        async with gateway([stub_url]) as url:
            waiting = asyncio.create_task(complete(url, "tenant-42"))
            await eventually(lambda: state.load_requests == 1, "the load is at the replica, at its gate")
            waiting.cancel()  # the only client leaves: kvgate cancels its handler, the load goes on
            with contextlib.suppress(asyncio.CancelledError):
                await waiting
            state.fail_loads = "disk gone"
            state.load_gate.set()
            await eventually(
                lambda: "load of tenant-42@" in caplog.text, "the loader logged the load's failure"
            )
            gc.collect()
            state.fail_loads = None
            assert (await complete(url, "tenant-42"))[0] == 200
    assert "never retrieved" not in caplog.text
