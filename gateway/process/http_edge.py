"""Running an aiohttp application on a local port: kvgate itself, the demo, the load tests and test stubs.

Every connection is held to deadlines and limits (``EdgeLimits``; an app carries its own under ``EDGE``,
kvgate's come from its settings, other apps get the settings' defaults):

- **headers**: a request's line and headers must arrive within ``header_timeout``, counted from the
  connection's start for its first request, then from each request's first byte. Late: a 408 (OpenAI
  body) and the connection ends; a connection that never sent a byte just closes. aiohttp has no such
  deadline (it waits for its keep-alive timer, an hour by default).
- **body**: once the headers are in, the whole body must arrive within ``body_timeout``. Late: the
  handler's read raises ``RequestTimeout`` (a 408 through the app's error middleware), and the
  connection ends. A timed-out connection's input is dropped for ``LINGER`` before it closes, so a
  client still sending reads the 408 rather than a reset.
- **idle**: a kept-alive connection closes after ``keepalive_timeout`` without a request (aiohttp's own).
- **per address**: one client address holds at most ``max_connections_per_client`` connections; a
  connection over it is answered 429 (OpenAI body) to its request and closed.
- **the client leaves**: the handler is cancelled (aiohttp's ``handler_cancellation``), so a pending
  upstream request is closed and the replica stops generating.

A stream holds two descriptors in kvgate (client and replica), so ``running`` raises the process's soft
limit on open files to its hard limit (1,024 soft is common; 1,000 streams need about 2,000).

The hooks sit in a subclass of aiohttp's ``RequestHandler`` (the server's protocol): it reads what the
parser produced (``_request_count``, ``_messages``) and the request being handled (``_current_request``).
``tests/request/test_deadlines.py`` fails if a new aiohttp moves them.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import socket
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.streams import StreamReader
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from gateway.core.errors import BadRequest, KvgateError, RequestTimeout, TooManyConnections
from gateway.request.body_lane import Handover
from gateway.settings.model import Settings


@dataclass(frozen=True, slots=True)
class EdgeLimits:
    header_timeout: float
    body_timeout: float
    keepalive_timeout: float
    max_connections_per_client: int  # 0: no cap

    @classmethod
    def of(cls, settings: Settings) -> EdgeLimits:
        return cls(
            header_timeout=settings.header_timeout,
            body_timeout=settings.body_timeout,
            keepalive_timeout=settings.keepalive_timeout,
            max_connections_per_client=settings.max_connections_per_client,
        )


EDGE = web.AppKey("edge", EdgeLimits)
BACKLOG = 1024  # pending connections the kernel queues for accept (aiohttp's default is 128)
LINGER = 1.0
"""Seconds a timed-out connection is still read (input discarded) before it closes: closing on a client
that is still sending makes the kernel answer with a reset, which can destroy the 408 before it is read."""


def session_timeout(settings: Settings) -> aiohttp.ClientTimeout:
    """No total limit (SSE streams run long); bounded connect, and a bound between bytes.

    The connector has no pool limit (the replicas' limit is kvgate's own, ``Replica.connection``), so
    ``connect`` never includes a wait for a pooled connection: it is DNS and the TCP connect alone."""
    return aiohttp.ClientTimeout(
        total=None,
        connect=settings.connect_timeout,
        sock_connect=settings.connect_timeout,
        sock_read=settings.read_timeout,
    )


def raise_open_files_limit() -> int:
    """Raise the soft limit on open files to the hard one; returns the limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        with contextlib.suppress(ValueError, OSError):  # an unlimited hard limit may be refused as a soft one
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@asynccontextmanager
async def running(
    app: web.Application,
    host: str = "127.0.0.1",
    port: int | None = None,
    *,
    sock: socket.socket | None = None,
) -> AsyncIterator[str]:
    """Serve ``app`` (its cleanup contexts run on the way in and out); yields its base URL. With ``sock``
    (a listening socket this process inherited: ``--workers``), on it, not on ``host``:``port``."""
    limits = app.get(EDGE) or EdgeLimits.of(Settings.model_construct())  # defaults, no environment
    raise_open_files_limit()
    app.on_response_prepare.append(_close_handed_over)
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
    await runner.setup()
    server = runner.server
    assert server is not None
    addresses = AddressCounts(limits.max_connections_per_client)
    loop = asyncio.get_running_loop()
    if sock is not None:
        host, port = sock.getsockname()[:2]
    port = port or free_port()

    handler_args = {  # the app's handler_args (its server logger), as aiohttp's own Server passes them
        key: value for key, value in server._kwargs.items() if key not in ("access_log", "keepalive_timeout")
    }

    def connection() -> EdgeConnection:
        return EdgeConnection(server, loop=loop, limits=limits, addresses=addresses, **handler_args)

    if sock is not None:
        listener = await loop.create_server(connection, sock=sock, backlog=BACKLOG)
    else:
        listener = await loop.create_server(connection, host, port, backlog=BACKLOG)
    try:
        yield f"http://{host}:{port}"
    finally:
        listener.close()
        await runner.cleanup()


class AddressCounts:
    """Open connections per client address, against a cap (0: none)."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.open: Counter[str] = Counter()

    def admit(self, address: str) -> bool:
        if self.cap and self.open[address] >= self.cap:
            return False
        self.open[address] += 1
        return True

    def leave(self, address: str) -> None:
        self.open[address] -= 1
        if self.open[address] <= 0:
            del self.open[address]


def _raw_error(error: KvgateError, reason: str) -> bytes:
    """A whole HTTP/1.1 error response with an OpenAI body, for a connection that is then closed."""
    body = error.json_bytes()
    head = (
        f"HTTP/1.1 {error.status} {reason}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


class EdgeConnection(RequestHandler):
    """aiohttp's server protocol with deadlines on reading a request and a cap per client address."""

    def __init__(
        self, manager: web.Server, *, limits: EdgeLimits, addresses: AddressCounts, **kwargs: Any
    ) -> None:
        # aiohttp documents access_log=None as "no access log"; its annotation says Logger
        no_log: Any = None
        super().__init__(manager, keepalive_timeout=limits.keepalive_timeout, access_log=no_log, **kwargs)
        self.limits = limits
        self.addresses = addresses
        self.address: str | None = None  # counted against the cap while open
        self.deadline: asyncio.TimerHandle | None = None
        self.partial = False  # bytes of a request head arrived while its deadline runs
        self.body: StreamReader | None = None  # the body being received, under the body deadline
        self.discarding = False  # timed out: input is dropped until the connection closes (LINGER)
        self.handed = False  # its request's body was handed over (``hand_over``): it closes after the answer
        self.watching = False  # that body was read whole: input is dropped, a close is seen (``_watch``)

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """A request the HTTP parser refused (or a failure below the app) gets an OpenAI-style JSON body
        too, not aiohttp's plain text; aiohttp logs it (one line, through the app's server logger)."""
        super().handle_error(request, status, exc, message)  # logs it; raises if a response has begun
        if status >= 500:
            error = KvgateError("kvgate failed on this connection (an internal error, logged)")
        else:
            error = BadRequest(f"malformed HTTP request: {' '.join(str(exc or message).split())}")
        error.status = status
        response = web.Response(body=error.json_bytes(), status=status, content_type="application/json")
        response.force_close()
        return response

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        peer = transport.get_extra_info("peername")
        address = str(peer[0]) if isinstance(peer, tuple) else str(peer)
        if self.addresses.admit(address):
            self.address = address
        else:
            self._request_handler = _refuse(address, self.addresses.cap)
        self._arm(self.limits.header_timeout, self._headers_late)

    def connection_lost(self, exc: BaseException | None) -> None:
        self._disarm()
        if self.address is not None:
            self.addresses.leave(self.address)
            self.address = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._force_close or self._close or self.discarding or self.watching:
            return
        if data and self.deadline is None and self._between_requests():
            self._arm(self.limits.header_timeout, self._headers_late)  # a new request's first byte
        if data and self.body is None:
            self.partial = True
        parsed = self._request_count
        super().data_received(data)
        if self._request_count != parsed:  # a request head is in: its body (if any) is on the clock now
            self._disarm()
            payload = self._messages[-1][1] if self._messages else None
            if isinstance(payload, StreamReader) and not payload.is_eof():
                self.body = payload
                self._arm(self.limits.body_timeout, self._body_late)
        elif self.body is not None and self.body.is_eof():
            self._disarm()

    def hand_over(self, request: BaseRequest) -> Handover | None:
        """The body of ``request`` (the one being handled) taken from aiohttp as it arrives: reading
        stops, what arrived is drained from aiohttp's buffers, and the rest is left on the socket, whose
        duplicate goes with it (its deadline too: its timer stops here). aiohttp's parser never sees the
        body end, so the connection closes after the answer (``Connection: close``). None when there is
        nothing to take (no body under way on this connection); ``fd`` None when it had all arrived
        (nothing is taken: the connection goes on as usual)."""
        body, transport, deadline = self.body, self.transport, self.deadline
        sock = transport.get_extra_info("socket") if transport is not None else None
        length = request.content_length
        if body is None or request.content is not body or deadline is None or sock is None or length is None:
            return None
        self._pause_reading_for_buffer()  # aiohttp's own flow control does not resume it now
        seconds = max(0.0, deadline.when() - self._loop.time())
        arrived = []
        while chunk := body.read_nowait(-1):  # reading it may let the parser feed what it held back
            arrived.append(chunk)
        got = b"".join(arrived)
        if body.is_eof():  # it was all in: nothing to take
            self._resume_reading_for_buffer()
            return Handover(got, None, length, seconds, self.limits.body_timeout, _nothing, _nothing)
        self._disarm()
        body.feed_eof()  # aiohttp reads no more of it (nor lingers on it after the answer)
        self.handed = True
        fd = os.dup(sock.fileno())
        return Handover(got, fd, length, seconds, self.limits.body_timeout, self._abandon, self._watch)

    def _watch(self) -> None:
        """A handed-over body read whole: reading resumes, so that a client that leaves is seen (its
        handler is cancelled, as any request's); what else it sends is dropped (it closes after its
        answer)."""
        if self.transport is None:
            return
        self.watching = True
        self._resume_reading_for_buffer()

    def _abandon(self) -> None:
        """A handed-over body not read whole (late, or failed): the rest is dropped, then it closes."""
        if self.transport is None:
            return
        self._resume_reading_for_buffer()
        self._close_after_linger()

    def _between_requests(self) -> bool:
        return self.body is None and not self._messages and self._current_request is None

    def _arm(self, delay: float, late: Callable[[], None]) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
        self.deadline = self._loop.call_later(delay, late)

    def _disarm(self) -> None:
        """No deadline runs: nothing of a request is pending (its head and body are in)."""
        if self.deadline is not None:
            self.deadline.cancel()
        self.deadline, self.partial, self.body = None, False, None

    def _headers_late(self) -> None:
        partial = self.partial
        self.deadline, self.partial = None, False
        if self.transport is None:
            return
        if not partial:
            self.force_close()  # connected and never sent a byte: nothing to answer
            return
        error = RequestTimeout(f"request headers not received within {self.limits.header_timeout:g} s")
        transport = self.transport
        transport.write(_raw_error(error, "Request Timeout"))
        if transport.can_write_eof():
            transport.write_eof()  # the answer, then end of stream: the client reads both
        self._close_after_linger()

    def _body_late(self) -> None:
        body = self.body
        self.deadline, self.body = None, None
        if body is None or body.is_eof() or self.transport is None:
            return
        request = self._current_request
        if request is None or request.content is not body:
            self.force_close()  # no handler reads it (already answered): just close
            return
        # the handler's read raises: it answers 408; the rest of the body is dropped, then the connection ends
        body.set_exception(RequestTimeout(f"request body not received within {self.limits.body_timeout:g} s"))
        body.feed_eof()
        self._close_after_linger()

    def _close_after_linger(self) -> None:
        self.discarding = True
        self._arm(LINGER, self.force_close)


async def _close_handed_over(request: web.Request, response: web.StreamResponse) -> None:
    """A connection whose body was handed over (``EdgeConnection.hand_over``) closes after its answer."""
    protocol = request.protocol
    if isinstance(protocol, EdgeConnection) and protocol.handed:
        response.headers["Connection"] = "close"  # aiohttp wrote its headers before this hook
        if not protocol.discarding:  # else it closes once the rest of the body is dropped (LINGER)
            response.force_close()


def _nothing() -> None:
    pass


def _refuse(address: str, cap: int) -> Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]:
    """The handler of a connection over the cap: 429 to its request, then the connection closes."""

    async def refuse(request: web.BaseRequest) -> web.StreamResponse:
        error = TooManyConnections(
            f"client {address} already holds {cap} open connections (max_connections_per_client)"
        )
        response = web.Response(body=error.json_bytes(), status=error.status, content_type="application/json")
        response.force_close()
        return response

    return refuse
