"""Minimal proxies, one per HTTP stack candidate, for ``loadtest.stack_compare`` (issue 19, item 3).

Each does the same work per request, the least a kvgate must: read the whole body, parse it (orjson),
put the versioned name in ``model`` (on the bytes), forward to the one upstream on a kept-alive
connection, and relay the answer with the versioned name rewritten back to the logical ID on the bytes
(non-streaming: the whole body; SSE: each received chunk, never buffered). No routing, no metrics, no
deadlines: what is left is the HTTP stack's own cost, server side and client side.

- ``aiohttp``: aiohttp's server (``web.Application``) and client (``ClientSession``), as kvgate uses them.
- ``aiohttp-edge``: the same, served through ``gateway.process.http_edge.running`` (kvgate's edge protocol
  subclass).
- ``aiohttp+htclient``: aiohttp's server; upstream through ``loadtest.http_client`` (httptools, a pool).
- ``httptools``: an asyncio protocol on ``httptools`` on both sides, as uvicorn's server is built.
- ``granian``: granian's RSGI server (Rust) in one worker, upstream through aiohttp's client.

Run: ``python -m loadtest.stack_proxies --stack NAME --port P --upstream URL --versioned NAME@HEX``
(granian's is started by its own command line: see ``loadtest.stack_compare``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
from typing import Any

import aiohttp
import orjson
import uvloop
from aiohttp import web

from loadtest.http_client import Pool

LOGICAL = "bench"
JSON = "application/json"
PLAIN_HEAD = b"HTTP/1.1 %d OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
STREAM_HEAD = b"HTTP/1.1 %d OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
STACKS = ("aiohttp", "aiohttp-edge", "aiohttp+htclient", "httptools", "granian")


class Work:
    """The per-request work every candidate does alike: the model rewritten both ways, on bytes."""

    def __init__(self, versioned: str) -> None:
        self.old_in = b'"model": "' + LOGICAL.encode() + b'"'
        self.new_in = b'"model": "' + versioned.encode() + b'"'
        v, lg = b'"' + versioned.encode() + b'"', b'"' + LOGICAL.encode() + b'"'
        self.pairs = ((b'"model":' + v, b'"model":' + lg), (b'"model": ' + v, b'"model": ' + lg))

    def upstream(self, raw: bytes) -> tuple[bytes, bool]:
        doc = orjson.loads(raw)
        if doc.get("model") != LOGICAL:
            raise ValueError("unknown model")
        return raw.replace(self.old_in, self.new_in, 1), doc.get("stream") is True

    def back(self, data: bytes) -> bytes:
        for old, new in self.pairs:
            if old in data:
                data = data.replace(old, new)
        return data


def aiohttp_app(upstream: str, work: Work, htclient: bool) -> web.Application:
    app = web.Application()
    state: dict[str, Any] = {}
    url = upstream + "/v1/completions"

    async def session_ctx(app: web.Application) -> Any:
        connector = aiohttp.TCPConnector(limit=0, force_close=False)
        state["session"] = aiohttp.ClientSession(connector=connector, auto_decompress=False)
        host, _, port = upstream.removeprefix("http://").partition(":")
        state["pool"] = Pool(host, int(port))
        yield
        await state["session"].close()
        state["pool"].close()

    async def handler(request: web.Request) -> web.StreamResponse:
        body, stream = work.upstream(await request.read())
        if htclient:
            return await _via_pool(request, state["pool"], body, stream, work)
        headers = {"Content-Type": "application/json"}
        async with state["session"].post(url, data=body, headers=headers) as answer:
            if not stream:
                payload = await answer.read()
                return web.Response(
                    body=work.back(payload), status=answer.status, content_type="application/json"
                )
            response = web.StreamResponse(status=answer.status)
            response.content_type = "text/event-stream"
            await response.prepare(request)
            async for chunk in answer.content.iter_any():
                await response.write(work.back(chunk))
            await response.write_eof()
            return response

    app.cleanup_ctx.append(session_ctx)
    app.router.add_post("/v1/completions", handler)
    app.router.add_get("/v1/models", lambda request: _ok())
    return app


async def _ok() -> web.Response:
    return web.json_response({"object": "list", "data": []})


async def _via_pool(
    request: web.Request, pool: Pool, body: bytes, stream: bool, work: Work
) -> web.StreamResponse:
    answer = await pool.post("/v1/completions", body)
    try:
        if not stream:
            payload = await answer.read()
            return web.Response(
                body=work.back(payload), status=answer.status, content_type="application/json"
            )
        response = web.StreamResponse(status=answer.status)
        response.content_type = "text/event-stream"
        await response.prepare(request)
        async for chunk in answer.chunks():
            await response.write(work.back(chunk))
        await response.write_eof()
        return response
    finally:
        answer.release()


def granian_app() -> Any:
    """The RSGI application granian serves (settings from the environment: granian starts it)."""
    work = Work(os.environ["STACK_VERSIONED"])
    url = os.environ["STACK_UPSTREAM"] + "/v1/completions"
    state: dict[str, aiohttp.ClientSession] = {}

    async def app(scope: Any, proto: Any) -> None:
        if scope.path != "/v1/completions":
            proto.response_bytes(200, [("content-type", "application/json")], b'{"data":[]}')
            return
        session = state.get("session")
        if session is None:
            connector = aiohttp.TCPConnector(limit=0)
            session = state["session"] = aiohttp.ClientSession(connector=connector, auto_decompress=False)
        body, stream = work.upstream(await proto())
        async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as answer:
            if not stream:
                payload = await answer.read()
                proto.response_bytes(
                    answer.status, [("content-type", "application/json")], work.back(payload)
                )
                return
            transport = proto.response_stream(answer.status, [("content-type", "text/event-stream")])
            async for chunk in answer.content.iter_any():
                await transport.send_bytes(work.back(chunk))

    return app


class HtServer(asyncio.Protocol):
    """An HTTP/1.1 server connection on httptools (keep-alive, one request at a time, no pipelining)."""

    def __init__(self, pool: Pool, work: Work) -> None:
        import httptools

        self.pool, self.work = pool, work
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.url = b""
        self.body: list[bytes] = []
        self.tasks: set[asyncio.Future[None]] = set()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no asyncio.Transport subclass

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except Exception:  # a malformed request: this benchmark just drops the connection
            if self.transport is not None:
                self.transport.close()

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        raw, url = b"".join(self.body), self.url
        self.body, self.url = [], b""
        task = asyncio.ensure_future(self.answer(url, raw))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def answer(self, url: bytes, raw: bytes) -> None:
        transport = self.transport
        if transport is None:
            return
        if url != b"/v1/completions":
            body = b'{"object":"list","data":[]}'
            transport.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                % (len(body), body)
            )
            return
        body, stream = self.work.upstream(raw)
        answer = await self.pool.post("/v1/completions", body)
        try:
            if not stream:
                payload = self.work.back(await answer.read())
                transport.write(PLAIN_HEAD % (answer.status, len(payload)) + payload)
                return
            transport.write(
                b"HTTP/1.1 %d OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                % answer.status
            )
            async for chunk in answer.chunks():
                data = self.work.back(chunk)
                transport.write(b"%x\r\n%s\r\n" % (len(data), data))
            transport.write(b"0\r\n\r\n")
        finally:
            answer.release()


async def serve(stack: str, port: int, upstream: str, versioned: str) -> None:
    work = Work(versioned)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if stack == "httptools":
        host, _, up_port = upstream.removeprefix("http://").partition(":")
        pool = Pool(host, int(up_port))
        server = await loop.create_server(lambda: HtServer(pool, work), "127.0.0.1", port, backlog=1024)
        await stop.wait()
        server.close()
        pool.close()
        return
    app = aiohttp_app(upstream, work, htclient=stack == "aiohttp+htclient")
    if stack == "aiohttp-edge":
        from gateway.process.http_edge import running

        async with running(app, port=port):
            await stop.wait()
        return
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port, backlog=1024).start()
    await stop.wait()
    await runner.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stack", choices=[s for s in STACKS if s != "granian"], required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--versioned", required=True)
    args = parser.parse_args()
    uvloop.run(serve(args.stack, args.port, args.upstream, args.versioned))


if __name__ == "__main__":
    main()
