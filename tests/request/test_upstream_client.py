"""``request.upstream``: the forward's httptools client against the stub replica (a real aiohttp server):
kept-alive reuse, chunked SSE as received chunks, the between-bytes timeout, an abort, an unreachable
replica, each as aiohttp's exception classes (``relay.UpstreamErrors`` maps them)."""

from __future__ import annotations

import asyncio
import socket

import aiohttp
import orjson
import pytest
from aiohttp import web

from gateway.process.http_edge import free_port, running
from gateway.request.upstream import HIGH_WATER, Upstream
from tests.support.conditions import eventually
from tests.support.stub_backend import StubState, build_stub

HEADERS = {"Content-Type": "application/json"}


def body(stream: bool, tokens: int = 3) -> bytes:
    return orjson.dumps({"model": "base", "prompt": "p", "max_tokens": tokens, "stream": stream})


async def test_answers_reuse_one_kept_alive_connection_and_streams_arrive_as_chunks() -> None:
    state = StubState(chunks=4)
    upstream = Upstream(connect_timeout=5, read_timeout=10)
    async with running(build_stub(state)) as stub:
        first = await upstream.request("POST", stub, "/v1/completions", body(False), HEADERS)
        assert (first.status, first.content_type) == (200, "application/json")
        doc = orjson.loads(await first.read())
        assert doc["model"] == "base"
        assert orjson.loads(await first.read()) == doc, "a second read gives the body again"
        connection = first.transport
        first.release()
        second = await upstream.request("POST", stub, "/v1/completions", body(True), HEADERS)
        assert second.transport is connection, "the kept-alive connection is reused"
        assert second.content_type == "text/event-stream"
        data = b"".join([chunk async for chunk in second.chunks()])
        assert data.count(b"data: ") == 5
        assert data.endswith(b"data: [DONE]\n\n")
        second.release()
        missing = await upstream.request("GET", stub, "/v1/nothing-here", None, {})
        assert missing.status == 404
        await missing.read()
        missing.release()
    upstream.close()


async def test_silence_longer_than_the_read_timeout_is_a_timeout_and_the_connection_is_dropped() -> None:
    state = StubState(chunks=3, chunk_delay=0.5)
    upstream = Upstream(connect_timeout=5, read_timeout=0.2)
    async with running(build_stub(state)) as stub:
        answer = await upstream.request("POST", stub, "/v1/completions", body(True), HEADERS)
        with pytest.raises(TimeoutError):
            async for _ in answer.chunks():
                pass
        answer.release()
        assert not upstream.idle.get(stub), "a timed-out connection is never reused"
        await eventually(lambda: state.cancelled == 1, "the replica saw the connection close and stopped")


async def test_an_abort_closes_the_connection_and_the_replica_stops() -> None:
    state = StubState(chunks=50, chunk_delay=0.02)
    upstream = Upstream(connect_timeout=5, read_timeout=10)
    async with running(build_stub(state)) as stub:
        answer = await upstream.request("POST", stub, "/v1/completions", body(True, 50), HEADERS)
        async for _ in answer.chunks():
            break
        answer.close()
        answer.release()
        await eventually(lambda: state.cancelled == 1, "the replica saw the connection close and stopped")
        assert not upstream.idle.get(stub)


async def test_an_unreachable_replica_is_a_client_connection_error() -> None:
    upstream = Upstream(connect_timeout=2, read_timeout=10)
    with pytest.raises(aiohttp.ClientConnectionError):
        await upstream.request("POST", f"http://127.0.0.1:{free_port()}", "/v1/completions", b"{}", HEADERS)
    assert Upstream.serves("http://127.0.0.1:8000")
    assert Upstream.serves("http://[::1]:8000")
    assert not Upstream.serves("https://replica:8000")
    assert not Upstream.serves("http://replica:8000/prefix")


async def test_idle_connections_are_closed_after_the_idle_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("gateway.request.upstream.IDLE_SECONDS", 0.2)
    upstream = Upstream(connect_timeout=5, read_timeout=10)
    async with running(build_stub(StubState())) as stub:
        answers = [
            await upstream.request("POST", stub, "/v1/completions", body(False), HEADERS) for _ in "ab"
        ]
        for answer in answers:
            await answer.read()
            answer.release()
        assert len(upstream.idle[stub]) == 2
        await eventually(lambda: stub not in upstream.idle, "both out of the pool once idle", 10)
        await eventually(  # a closed transport tells its protocol on a later turn of the loop
            lambda: all(answer.transport is None for answer in answers), "both connections closed", 10
        )
    upstream.close()


async def test_a_header_value_that_is_not_text_goes_up_as_the_bytes_that_came() -> None:
    """aiohttp's server decodes a header's non-UTF-8 bytes with surrogates: they go up as those bytes."""
    state = StubState()
    upstream = Upstream(connect_timeout=5, read_timeout=10)
    async with running(build_stub(state)) as stub:
        headers = {**HEADERS, "Authorization": "Bearer \udc80é"}
        answer = await upstream.request("POST", stub, "/v1/completions", body(False), headers)
        await answer.read()
        answer.release()
    upstream.close()
    assert state.received_headers[-1]["Authorization"] == "Bearer \udc80é"


async def test_a_connect_that_does_not_finish_in_time_is_a_timeout() -> None:
    """Not an unreachable replica: as aiohttp's connect timeout was, a TimeoutError (kvgate's 504)."""
    with socket.socket() as listener:  # listening, never accepting, its backlog full: connects hang
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        port = listener.getsockname()[1]
        held = [socket.socket() for _ in range(4)]
        for sock in held:  # fill the backlog without waiting
            sock.setblocking(False)
            sock.connect_ex(("127.0.0.1", port))
        upstream = Upstream(connect_timeout=0.3, read_timeout=10)
        try:
            with pytest.raises(TimeoutError) as caught:
                await upstream.request("POST", f"http://127.0.0.1:{port}", "/v1/completions", b"{}", HEADERS)
            assert not isinstance(caught.value, aiohttp.ClientError)
            assert "no connection to" in str(caught.value), "the connect timed out, not a read"
        finally:
            for sock in held:
                sock.close()


async def test_a_slow_reader_pauses_the_replica_instead_of_buffering_its_answer() -> None:
    """8 MiB sent as fast as the replica can, taken slowly: reading pauses past ``HIGH_WATER`` (so kvgate's
    memory stays bounded and the replica waits on TCP), it is not a read timeout, and every byte arrives."""
    size, piece = 8 << 20, b"x" * 65536

    async def big(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
        await response.prepare(request)
        for _ in range(size // len(piece)):
            await response.write(piece)
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_get("/big", big)
    upstream = Upstream(connect_timeout=5, read_timeout=0.2)
    async with running(app) as url:
        answer = await upstream.request("GET", url, "/big", None, {})
        received, most, paused = 0, 0, False
        async for chunk in answer.chunks():
            received += len(chunk)
            most = max(most, len(chunk))
            await asyncio.sleep(0.3)  # longer than the read timeout, each time
            paused = paused or answer.paused
        answer.release()
    upstream.close()
    assert received == size
    assert paused, "reading paused while the reader was slow"
    assert most <= HIGH_WATER + (1 << 20), most  # what was buffered at most, one read past the mark
