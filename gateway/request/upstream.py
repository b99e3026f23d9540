"""The request path's HTTP/1.1 client to the replicas, on ``httptools`` (issue 19: chosen by measurement).

aiohttp's client cost about 75 µs of CPU per proxied request on this machine, more than half of what a
minimal aiohttp proxy costs (``loadtest.stack_compare``, docs/perf.md); this client, an asyncio protocol
on the same C parser uvicorn uses, costs a third of that. It does only what the request path needs:
one request per kept-alive connection at a time, a JSON body (or none) written at once, the answer's
body as the chunks that arrive (a stream is relayed, never buffered), ``connect_timeout`` on the TCP
connect and ``read_timeout`` between received bytes. Its failures are aiohttp's exception classes
(``aiohttp.ClientConnectionError``, ``aiohttp.ClientPayloadError``) and ``TimeoutError``, so
``relay.UpstreamErrors`` maps them as before. Multipart and very large bodies still go through aiohttp's
client (``proxy``): they are rare and aiohttp streams them.

``close`` aborts a response (the client left): its connection closes, so the replica stops generating.
A connection idle for ``IDLE_SECONDS`` is closed, never reused (servers close idle keep-alive connections:
uvicorn, under vLLM, after 5 s), and one whose answer was not read to its end is not kept.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import httptools

IDLE_SECONDS = 2.0
HIGH_WATER = 1 << 20  # bytes received and not yet taken: past this, reading pauses until they are taken
_HEAD = b"%s %s HTTP/1.1\r\nHost: %s\r\n"
Writer = Callable[[int, str, str, str, dict[str, str]], Awaitable[None]]
"""Writes a request on a connection's socket: (fd, method, host, path, headers)."""


class Answer(asyncio.Protocol):
    """One connection to a replica; between ``Upstream.request`` and ``release`` it carries one answer."""

    def __init__(self, upstream: Upstream, key: str, read_timeout: float) -> None:
        self.upstream, self.key, self.read_timeout = upstream, key, read_timeout
        self.parser = httptools.HttpResponseParser(self)
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.status = 0
        self.content_type = "application/octet-stream"
        self.keep = False
        self.pending: list[bytes] = []
        self.buffered = 0  # bytes in ``pending``
        self.paused = False  # reading paused: a slow client has not taken ``pending`` yet
        self.body: bytes | None = None  # the whole body, once read
        self.complete = False
        self.failed: BaseException | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.last = 0.0  # loop time of the last bytes received
        self.idle_since = 0.0

    # --- asyncio.Protocol -------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no asyncio.Transport subclass

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport, self.keep = None, False
        if not self.complete:
            self._fail(aiohttp.ServerDisconnectedError(f"replica closed the connection ({exc!r})"))

    def data_received(self, data: bytes) -> None:
        self.last = self.loop.time()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(aiohttp.ClientPayloadError(f"malformed answer from the replica: {exc}"))
            self._drop()

    # --- httptools callbacks ----------------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"content-type":
            mime = value.split(b";", 1)[0].strip().lower()
            self.content_type = mime.decode("latin-1") or self.content_type

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self._wake()

    def on_body(self, body: bytes) -> None:
        self.pending.append(body)
        self.buffered += len(body)
        if self.buffered > HIGH_WATER and not self.paused and self.transport is not None:
            self.transport.pause_reading()  # the replica waits (TCP backpressure); memory does not grow
            self.paused = True
        self._wake()

    def on_message_complete(self) -> None:
        self.keep = self.parser.should_keep_alive()
        self.complete = True
        self._disarm()
        self._wake()

    # --- the exchange -----------------------------------------------------------------------------

    async def send(self, request: bytes | None) -> None:
        """``request`` written (None: the body lane wrote it), then its answer's head awaited."""
        assert self.transport is not None
        if request is not None:
            self.transport.write(request)
        while not self.status:
            await self._next()

    def fileno(self) -> int:
        """A duplicate of this connection's socket (the caller closes it)."""
        assert self.transport is not None
        sock = self.transport.get_extra_info("socket")
        return os.dup(sock.fileno())

    async def read(self) -> bytes:
        """The whole body (kept: a second read gives it again)."""
        if self.body is None and self.complete and len(self.pending) == 1 and not self.paused:
            self.body, self.pending, self.buffered = self.pending[0], [], 0  # all in: the common answer
        if self.body is None:
            parts = [chunk async for chunk in self.chunks()]
            self.body = parts[0] if len(parts) == 1 else b"".join(parts)
        return self.body

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives (decoded from chunked transfer coding): each time, all that has
        arrived since the last time, in one piece (nothing waits for more)."""
        while True:
            if self.pending:
                ready, self.pending, self.buffered = self.pending, [], 0
                if self.paused:
                    self.paused = False
                    if self.transport is not None:
                        self.transport.resume_reading()
                yield ready[0] if len(ready) == 1 else b"".join(ready)
            elif self.complete:
                return
            else:
                await self._next()

    async def _next(self) -> None:
        if self.failed is not None:
            raise self.failed
        self.waiter = self.loop.create_future()
        if self.timer is None:
            self.timer = self.loop.call_at(self.last + self.read_timeout, self._late)
        try:
            await self.waiter
        finally:
            self.waiter = None
        if self.failed is not None and not self.pending and not self.complete:
            raise self.failed

    def _late(self) -> None:
        self.timer = None
        if self.complete or self.transport is None:
            return
        due = self.last + self.read_timeout
        if self.paused:  # nothing comes because kvgate stopped reading: not the replica's delay
            self.last = self.loop.time()
            due = self.last + self.read_timeout
        if self.loop.time() < due:  # bytes came meanwhile: wait from the last of them
            self.timer = self.loop.call_at(due, self._late)
            return
        self._fail(TimeoutError(f"no bytes from the replica for {self.read_timeout:g} s"))
        self._drop()

    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def _fail(self, exc: BaseException) -> None:
        if self.failed is None:
            self.failed = exc
        self._disarm()
        self._wake()

    def _disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _drop(self) -> None:
        self.keep = False
        if self.transport is not None:
            self.transport.close()

    def close(self) -> None:
        """Abort: the connection closes (the replica sees it and stops generating)."""
        self._disarm()
        self._drop()

    def release(self) -> None:
        """Done with the answer: its connection goes back to the pool if the answer was read to its end."""
        self._disarm()
        if self.complete and self.keep and self.transport is not None and not self.transport.is_closing():
            self.idle_since = time.monotonic()
            self.status, self.pending, self.body, self.complete = 0, [], None, False
            self.content_type = "application/octet-stream"
            self.upstream.keep(self)
        else:
            self._drop()


class Upstream:
    """Kept-alive connections to every replica (``url``: ``http://host:port``)."""

    def __init__(self, connect_timeout: float, read_timeout: float) -> None:
        self.connect_timeout, self.read_timeout = connect_timeout, read_timeout
        self.idle: dict[str, deque[Answer]] = {}  # per replica: the newest last (reused first)
        self.sweep: asyncio.TimerHandle | None = None

    def keep(self, answer: Answer) -> None:
        """``answer``'s connection is idle now; connections idle past ``IDLE_SECONDS`` are closed."""
        self.idle.setdefault(answer.key, deque()).append(answer)
        if self.sweep is None:
            self.sweep = answer.loop.call_later(IDLE_SECONDS, self._sweep)

    def _sweep(self) -> None:
        self.sweep = None
        oldest = time.monotonic() - IDLE_SECONDS
        for url, idle in list(self.idle.items()):
            while idle and idle[0].idle_since <= oldest:
                idle.popleft().close()
            if not idle:
                del self.idle[url]
        if self.idle:
            self.sweep = asyncio.get_running_loop().call_later(IDLE_SECONDS / 2, self._sweep)

    @staticmethod
    def serves(url: str) -> bool:
        """Whether this client can reach ``url`` (plain HTTP, no path); others go through aiohttp's."""
        return url.startswith("http://") and "/" not in url.removeprefix("http://")

    async def request(
        self, method: str, url: str, path: str, body: bytes | None, headers: dict[str, str]
    ) -> Answer:
        """Send one request; returns once the answer's status line and headers are in (``release`` it)."""
        host = url.removeprefix("http://")
        length = len(body or b"") if body is not None or method == "POST" else None
        head = request_head(method, host, path, headers, length)
        answer = await self._connection(url, host)
        try:
            await answer.send(head + body if body else head)
        except BaseException:
            answer.close()
            raise
        return answer

    async def request_via(
        self, method: str, url: str, path: str, headers: dict[str, str], write: Writer
    ) -> Answer:
        """As ``request``, with the request written by ``write(fd, method, host, path, headers)`` on a
        duplicate of the connection's socket, from another process (the body lane: ``body_lane``)."""
        host = url.removeprefix("http://")
        answer = await self._connection(url, host)
        try:
            fd = answer.fileno()
            try:
                await write(fd, method, host, path, headers)
            finally:
                os.close(fd)
            await answer.send(None)
        except BaseException:
            answer.close()
            raise
        return answer

    async def _connection(self, url: str, host: str) -> Answer:
        idle = self.idle.get(url)
        now = time.monotonic()
        while idle:
            answer = idle.pop()
            usable = answer.transport is not None and not answer.transport.is_closing()
            if usable and now - answer.idle_since < IDLE_SECONDS:
                answer.failed, answer.last = None, answer.loop.time()
                return answer
            answer.close()
        name, port = _address(host)
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, answer = await loop.create_connection(
                    lambda: Answer(self, url, self.read_timeout), name, port
                )
        except TimeoutError:  # an OSError too: it stays a timeout (504), as aiohttp's connect timeout was
            raise TimeoutError(f"no connection to {url} within {self.connect_timeout:g} s") from None
        except (OSError, ValueError) as exc:
            raise aiohttp.ClientConnectionError(f"cannot connect to {url}: {exc!r}") from exc
        answer.last = loop.time()
        return answer

    def close(self) -> None:
        if self.sweep is not None:
            self.sweep.cancel()
            self.sweep = None
        for answers in self.idle.values():
            for answer in answers:
                answer.close()
        self.idle.clear()


def request_head(method: str, host: str, path: str, headers: dict[str, str], length: int | None) -> bytes:
    """A request's line and headers (``length``: its ``Content-Length``, None for none)."""
    lines = [
        _HEAD % (method.encode(), path.encode("utf-8", "surrogateescape"), host.encode()),
        *(f"{name}: {value}\r\n".encode("utf-8", "surrogateescape") for name, value in headers.items()),
    ]
    if length is not None:
        lines.append(b"Content-Length: %d\r\n" % length)
    lines.append(b"\r\n")
    return b"".join(lines)


def _address(host: str) -> tuple[str, int]:
    """``host[:port]`` (an IPv6 address in brackets) as (host, port); port 80 when none is given."""
    if host.startswith("["):
        name, _, rest = host[1:].partition("]")
        return name, int(rest.removeprefix(":") or 80)
    name, _, port = host.partition(":")
    return name, int(port or 80)
