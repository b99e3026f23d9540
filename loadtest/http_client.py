"""A minimal HTTP/1.1 client on ``httptools`` for ``loadtest.stack_proxies``: a pool of kept-alive
connections to one upstream, POST only, the answer's body as received chunks (SSE relayed, not buffered).

Not kvgate's client: no timeouts, no redirects, no TLS; it measures what an upstream request costs when
the client does nothing else (issue 19, item 3).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httptools


class Answer(asyncio.Protocol):
    """One kept-alive connection; between ``post`` and ``release`` it carries one exchange."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.status = 0
        self.keep = True
        self.pending: list[bytes] = []
        self.complete = False
        self.failed: BaseException | None = None
        self.head: asyncio.Future[None] | None = None
        self.waiter: asyncio.Future[None] | None = None

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no asyncio.Transport subclass

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport, self.keep = None, False
        if not self.complete:
            self.failed = exc or ConnectionResetError("upstream closed the connection")
            self._wake(self.head)
            self._wake(self.waiter)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.failed, self.keep = exc, False
            self._wake(self.head)
            self._wake(self.waiter)
        except httptools.HttpParserUpgrade:  # pragma: no cover - never asked for
            self.keep = False

    # httptools callbacks
    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.keep = self.parser.should_keep_alive()
        self._wake(self.head)

    def on_body(self, body: bytes) -> None:
        self.pending.append(body)
        self._wake(self.waiter)

    def on_message_complete(self) -> None:
        self.complete = True
        self._wake(self.waiter)

    @staticmethod
    def _wake(future: asyncio.Future[None] | None) -> None:
        if future is not None and not future.done():
            future.set_result(None)

    # the exchange
    async def send(self, request: bytes) -> None:
        assert self.transport is not None
        self.status, self.pending, self.complete, self.failed = 0, [], False, None
        self.head = asyncio.get_running_loop().create_future()
        self.transport.write(request)
        await self.head
        if self.failed is not None:
            raise self.failed

    async def read(self) -> bytes:
        parts = [chunk async for chunk in self.chunks_()]
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def chunks(self) -> AsyncIterator[bytes]:
        return self.chunks_()

    async def chunks_(self) -> AsyncIterator[bytes]:
        while True:
            if self.pending:
                ready, self.pending = self.pending, []
                for chunk in ready:
                    yield chunk
                continue
            if self.complete:
                return
            if self.failed is not None:
                raise self.failed
            self.waiter = asyncio.get_running_loop().create_future()
            await self.waiter
            self.waiter = None

    def release(self) -> None:
        if self.complete and self.keep and self.transport is not None:
            self.pool.idle.append(self)
        elif self.transport is not None:
            self.transport.close()


class Pool:
    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.idle: list[Answer] = []
        self.prefix = b"Host: %s:%d\r\n" % (host.encode(), port)

    async def post(self, path: str, body: bytes) -> Answer:
        request = b"POST %s HTTP/1.1\r\n%sContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (
            path.encode(),
            self.prefix,
            len(body),
            body,
        )
        while self.idle:
            answer = self.idle.pop()
            if answer.transport is None or answer.transport.is_closing():
                continue
            try:
                await answer.send(request)
                return answer
            except (ConnectionError, httptools.HttpParserError):
                continue  # a kept-alive connection the upstream closed meanwhile: a fresh one
        loop = asyncio.get_running_loop()
        _, answer = await loop.create_connection(lambda: Answer(self), self.host, self.port)
        await answer.send(request)
        return answer

    def close(self) -> None:
        for answer in self.idle:
            if answer.transport is not None:
                answer.transport.close()
        self.idle.clear()
