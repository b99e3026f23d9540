"""Large request bodies off the serving process: read, parsed and sent on in a process of their own.

Parsing JSON holds the GIL (orjson releases it nowhere), and so do rendering and tokenizing, so a worker
thread does not help (``loadtest/heavy_bodies.py`` measured a thread doing the parse: small requests'
p99 at 15-40x idle). Neither does parsing elsewhere alone: a serving process that still reads 4 MB,
joins it, pickles it to a parsing process and splices kvgate's members into a forwarded copy spends
milliseconds of its loop on each heavy body, and the small requests queued behind them paid for it
(2.3-3.7x idle p99 on a quiet machine). So each serving process has a body lane (one process, started
at its first large body, niced so the serving process keeps the CPU first) that does all of it:

- **take** (a body whose ``Content-Length`` is over ``intake.INLINE_PARSE_BYTES`` and has not all
  arrived when its handler starts, the common case past a few hundred KB): the serving process hands
  the lane what arrived and a duplicate of the client's socket (``http_edge.EdgeConnection.hand_over``:
  its own reading stops), and the lane reads the rest, under what is left of the body deadline. It
  decodes and checks the body (``body.decode``), computes the prompt's tokens when kvgate tokenizes
  (``prompt_tokens.of_route``), keeps the body and hands back the ``bounded`` one: what the request path
  reads, whatever the body's size. That connection closes after its answer (aiohttp's parser never saw
  the body's end).
- **send**: given a duplicate of the socket of the replica connection the request goes on
  (``upstream.Upstream.request_via``), the lane writes the request head and the body, with kvgate's
  members spliced in (``body.forwarded``); the serving process reads the answer as for any request.
  A retry on another replica sends it again; the request's end releases it.
- **parse** (a large body that had all arrived): its bytes go to the lane, which hands back the bounded
  body and tokens, as the parsing process did.

The serving process's loop pays for a few messages per body, not for its bytes. A lane that dies (killed,
out of memory) is replaced at the next large body. A body it was parsing from bytes is parsed in a worker
thread instead (that request is served); a body it held is lost with it, and its request is answered
503 ``body_lost`` (send it again). Counted in ``kvgate_large_bodies_total{read_by, parsed_in}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol, runtime_checkable

import aiohttp

from gateway.core.body import Body, bounded, decode, forwarded
from gateway.core.errors import ClientClosed, KvgateError, RequestTimeout
from gateway.kv.prompt_tokens import PromptTokens, Tokens, of_route
from gateway.request.channel import Channel
from gateway.request.upstream import request_head
from gateway.telemetry.metrics import Metrics

log = logging.getLogger(__name__)

NICE = 10
"""The lane's niceness: on a busy machine the serving process is scheduled first."""


class BodyLost(KvgateError):
    """The body lane stopped while it held this request's body (a new one starts): send it again."""

    status = 503
    type = "service_unavailable"

    def __init__(self, message: str) -> None:
        super().__init__(message, code="body_lost")


@dataclass(frozen=True, slots=True)
class Handover:
    """A request body taken from the serving process's HTTP server as it arrives: what arrived of it,
    a duplicate of the client's socket (``fd``, None: it had all arrived, nothing is taken), its
    ``Content-Length``, the seconds left of its deadline; ``abandon``: called when the body is not
    read whole after all (the connection drops the rest and closes, after the answer is read), ``taken``
    once it was (the server watches the connection again: a client that leaves cancels its request)."""

    arrived: bytes
    fd: int | None
    length: int
    seconds: float
    body_timeout: float
    abandon: Callable[[], None]
    taken: Callable[[], None]


@runtime_checkable
class HandsOver(Protocol):
    """A server connection that can hand a request body over (``http_edge.EdgeConnection``)."""

    def hand_over(self, request: Any) -> Handover | None: ...


PIECE = 256 * 1024
"""Bytes per read or write of the lane's sockets: a kernel without preemption (``PREEMPT_NONE``) runs a
4 MB copy to its end before the serving process gets the core back."""
OPS = frozenset(("parse", "take", "send", "fetch", "release"))

# --- the lane's side (its own process) -------------------------------------------------------------


def run(sock: socket.socket, tokens: PromptTokens | None) -> None:
    """The lane process: serves its channel until the serving process is gone."""
    os.nice(NICE)
    asyncio.run(_Lane(tokens).serve(sock))


class _Lane:
    def __init__(self, tokens: PromptTokens | None) -> None:
        self.tokens = tokens
        self.held: dict[int, Body] = {}
        self.tasks: set[asyncio.Task[None]] = set()

    async def serve(self, sock: socket.socket) -> None:
        gone = asyncio.Event()
        self.channel = Channel(sock, self.received, gone.set)
        await gone.wait()

    def received(self, message: tuple[int, str, tuple[Any, ...]], fds: list[int]) -> None:
        call, op, args = message
        if op not in OPS:
            raise ValueError(f"the body lane has no operation {op!r}")
        if op == "release":
            self.held.pop(call, None)
            return
        task = asyncio.get_running_loop().create_task(self.answer(call, op, args, fds))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def answer(self, call: int, op: str, args: tuple[Any, ...], fds: list[int]) -> None:
        try:
            value: Any = await getattr(self, op)(call, *args, *fds)
            reply = (call, True, value)
        except Exception as exc:  # every failure goes back to the request it belongs to
            reply = (call, False, exc)
        finally:
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
        with contextlib.suppress(ConnectionError):
            await self.channel.send(reply)

    def parsed(self, raw: bytes, path: str, model_optional: bool, owned: frozenset[str]) -> tuple[Body, Any]:
        body = decode(raw, model_optional=model_optional, owned=owned)
        tokens = of_route(self.tokens, path, body.doc) if self.tokens is not None else None
        return body, tokens

    async def parse(
        self, call: int, raw: bytes, path: str, model_optional: bool, owned: frozenset[str]
    ) -> tuple[Body, Any]:
        body, tokens = self.parsed(raw, path, model_optional, owned)
        return bounded(body), tokens

    async def take(
        self,
        call: int,
        arrived: bytes,
        length: int,
        seconds: float,
        body_timeout: float,
        path: str,
        model_optional: bool,
        owned: frozenset[str],
        fd: int,
    ) -> tuple[Body, Any]:
        """The body read from the client's socket (``fd``: non-blocking, as the serving process's
        server set it: never changed here), then parsed and kept under ``call``."""
        buffer = bytearray(length)
        buffer[: len(arrived)] = arrived
        view, got = memoryview(buffer), len(arrived)
        loop = asyncio.get_running_loop()
        deadline = time.monotonic() + seconds
        with socket.socket(fileno=os.dup(fd)) as client:
            client.setblocking(False)
            while got < length:
                try:
                    async with asyncio.timeout(deadline - time.monotonic()):
                        read = await loop.sock_recv_into(client, view[got : got + PIECE])
                except TimeoutError:
                    raise RequestTimeout(f"request body not received within {body_timeout:g} s") from None
                except OSError as exc:
                    raise ClientClosed(f"the client's connection failed as its body was read: {exc}") from exc
                if read == 0:
                    raise ClientClosed(f"the client closed its connection after {got} of {length} body bytes")
                got += read
        view.release()
        body, tokens = self.parsed(bytes(buffer), path, model_optional, owned)
        self.held[call] = body
        return replace(bounded(body), rest=None), tokens

    async def send(
        self,
        call: int,
        held: int,
        owned: dict[str, str] | None,
        method: str,
        host: str,
        path: str,
        headers: dict[str, str],
        seconds: float,
        fd: int,
    ) -> None:
        """The held body (with ``owned`` spliced in, if given) sent as a request on the replica
        connection ``fd``; its answer is the serving process's to read."""
        body = self.held[held]
        data = forwarded(body, owned) if owned is not None else body.raw
        loop = asyncio.get_running_loop()
        with socket.socket(fileno=os.dup(fd)) as replica:
            replica.setblocking(False)
            async with asyncio.timeout(seconds):
                await loop.sock_sendall(replica, request_head(method, host, path, headers, len(data)))
                sending = memoryview(data)
                for at in range(0, len(data), PIECE):
                    await loop.sock_sendall(replica, sending[at : at + PIECE])

    async def fetch(self, call: int, held: int, owned: dict[str, str] | None) -> bytes:
        """The held body's bytes as ``send`` would send them (for a replica only aiohttp reaches)."""
        body = self.held[held]
        return forwarded(body, owned) if owned is not None else body.raw


# --- the serving process's side --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Held:
    """A body the lane holds (it read it from the client): sent from there, released at the end."""

    lane: BodyLane
    id: int
    generation: int  # the lane that holds it: one that died took it along

    def release(self) -> None:
        self.lane.release(self)


@dataclass(frozen=True, slots=True)
class HeldUpstream:
    """What goes upstream for a held body: it, with kvgate's members (``owned``; None: as it came)."""

    held: Held
    owned: dict[str, str] | None

    async def write(self, fd: int, method: str, host: str, path: str, headers: dict[str, str]) -> None:
        """Sent on the replica connection ``fd`` (a failure is the replica's: aiohttp's error class)."""
        lane = self.held.lane
        lane.holds(self.held)
        args = (self.held.id, self.owned, method, host, path, headers, lane.send_timeout)
        try:
            await lane.call("send", args, (fd,))
        except TimeoutError:
            raise TimeoutError(f"the replica took no body bytes for {lane.send_timeout:g} s") from None
        except OSError as exc:
            raise aiohttp.ClientConnectionError(f"sending the body to the replica failed: {exc!r}") from exc

    async def fetch(self) -> bytes:
        self.held.lane.holds(self.held)
        data: bytes = await self.held.lane.call("fetch", (self.held.id, self.owned))
        return data


class BodyLane:
    """The body lane of one serving process (``close`` stops it)."""

    def __init__(
        self, tokens: PromptTokens | None, metrics: Metrics | None = None, send_timeout: float = 600.0
    ) -> None:
        self.tokens, self.metrics, self.send_timeout = tokens, metrics, send_timeout
        self.process: multiprocessing.process.BaseProcess | None = None
        self.channel: Channel | None = None
        self.generation = 0
        self.calls: dict[int, asyncio.Future[Any]] = {}
        self.ids = itertools.count(1)

    async def parse(
        self, raw: bytes, path: str, *, model_optional: bool, owned: frozenset[str]
    ) -> tuple[Body, Tokens | None]:
        """``raw`` decoded in the lane: its bounded body (with ``raw`` back in it) and tokens."""
        try:
            body, tokens = await self.call("parse", (raw, path, model_optional, owned))
        except BodyLost:
            log.warning("the body lane died; a new one starts, this body is parsed in a thread")
            self._count("loop", "thread")
            body = await asyncio.to_thread(decode, raw, model_optional=model_optional, owned=owned)
            return body, None
        self._count("loop", "process")
        return replace(body, raw=raw), tokens

    async def take(
        self, handover: Handover, path: str, *, model_optional: bool, owned: frozenset[str]
    ) -> tuple[Body, Tokens | None, Held]:
        """The body of ``handover`` read and decoded in the lane, which keeps it (``Held``)."""
        assert handover.fd is not None
        args = (
            handover.arrived,
            handover.length,
            handover.seconds,
            handover.body_timeout,
            path,
            model_optional,
            owned,
        )
        try:
            call = next(self.ids)
            body, tokens = await self.call("take", args, (handover.fd,), call=call)
        except BodyLost:
            self._count("lane", "lost")
            raise
        self._count("lane", "process")
        return body, tokens, Held(self, call, self.generation)

    async def call(
        self, op: str, args: tuple[Any, ...], fds: tuple[int, ...] = (), *, call: int | None = None
    ) -> Any:
        """``op`` run in the lane; its value, or its exception raised here (``BodyLost``: the lane died)."""
        channel = self._channel()
        call = next(self.ids) if call is None else call
        answer = asyncio.get_running_loop().create_future()
        self.calls[call] = answer
        try:
            try:
                await channel.send((call, op, args), fds)
            except ConnectionError:
                raise _lost() from None
            return await answer
        finally:
            self.calls.pop(call, None)

    def holds(self, held: Held) -> None:
        """Raises ``BodyLost`` if the lane that held ``held`` is gone (a new one does not have it)."""
        if self.channel is None or held.generation != self.generation:
            raise _lost()

    def release(self, held: Held) -> None:
        if self.channel is not None and held.generation == self.generation:
            sending = asyncio.get_running_loop().create_task(self.channel.send((held.id, "release", ())))
            sending.add_done_callback(_ignore)

    def _channel(self) -> Channel:
        if self.channel is None:
            multiprocessing.active_children()  # reaps a lane that died
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            self.process = multiprocessing.get_context("spawn").Process(  # never a fork of a threaded process
                target=run, args=(theirs, self.tokens), name="kvgate-body-lane", daemon=True
            )
            self.process.start()
            theirs.close()
            self.generation += 1
            self.channel = Channel(ours, self._answered, self._lost)
            if self.metrics is not None:
                self.metrics.body_lane_starts.inc()
        return self.channel

    def _answered(self, message: tuple[int, bool, Any], fds: list[int]) -> None:
        for fd in fds:
            os.close(fd)
        call, ok, value = message
        answer = self.calls.get(call)
        if answer is None or answer.done():
            return
        if ok:
            answer.set_result(value)
        else:
            answer.set_exception(value)

    def _lost(self) -> None:
        """The lane is gone: every call waiting on it fails; the next large body starts a new one."""
        log.warning("the body lane (pid %s) stopped", self.process.pid if self.process else None)
        self.channel, self.process = None, None
        calls, self.calls = self.calls, {}
        for answer in calls.values():
            if not answer.done():
                answer.set_exception(_lost())

    def _count(self, read_by: str, parsed_in: str) -> None:
        if self.metrics is not None:
            self.metrics.large_bodies.labels(read_by, parsed_in).inc()

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()  # the lane sees its channel close and exits
            self.channel = None
        if self.process is not None:
            self.process.join(timeout=2)
            if self.process.is_alive():
                self.process.kill()
            self.process = None


def _lost() -> BodyLost:
    return BodyLost("kvgate's body process stopped while it held this request's body; send it again")


def _ignore(task: asyncio.Task[None]) -> None:
    if not task.cancelled():
        task.exception()  # a release to a lane that just died: nothing to release
