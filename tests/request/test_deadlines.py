"""Deadlines and limits on client connections: slow headers, trickling bodies, idle keep-alive, and a cap
per client address. Raw sockets on loopback talk to kvgate (stub replica, real Redis).

The deadlines here are short; each check waits far longer (``PATIENCE``) for the connection to end, so
nothing is timed: without the deadline the connection would stay open and the wait would fail.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from redis.asyncio import Redis

from tests.request.test_edge_streams import kvgate
from tests.request.test_proxy import stubs
from tests.support.conditions import eventually
from tests.support.serve_modes import IN_PROCESS_ONLY, serve_shape  # noqa: F401  (autouse: every test here runs in both shapes)

PATIENCE = 20.0
HEALTH = b"GET /healthz HTTP/1.1\r\nHost: kvgate\r\n\r\n"


@contextlib.asynccontextmanager
async def gateway(redis: Redis, tmp_path: Path, **overrides: Any) -> AsyncIterator[tuple[str, int]]:
    async with stubs(1) as backends, kvgate(redis, tmp_path, [backends[0][0]], **overrides) as url:
        parts = urlsplit(url)
        assert parts.hostname is not None
        assert parts.port is not None
        yield parts.hostname, parts.port


@contextlib.asynccontextmanager
async def connection(
    address: tuple[str, int],
) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    reader, writer = await asyncio.open_connection(*address)
    try:
        yield reader, writer
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 response with a Content-Length: (status, headers, body)."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), PATIENCE)
    status_line, *lines = head.decode("latin-1").rstrip("\r\n").split("\r\n")
    headers = {name.lower(): value.strip() for name, _, value in (line.partition(":") for line in lines)}
    body = await asyncio.wait_for(reader.readexactly(int(headers.get("content-length", "0"))), PATIENCE)
    return int(status_line.split()[1]), headers, body


async def closed(reader: asyncio.StreamReader) -> bytes:
    """Everything the server sends until it closes the connection (fails if it never does)."""
    try:
        return await asyncio.wait_for(reader.read(), PATIENCE)
    except ConnectionResetError:
        return b""


def openai_error(body: bytes) -> dict[str, Any]:
    error: dict[str, Any] = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


async def test_slow_request_headers_are_cut_at_the_header_deadline(redis: Redis, tmp_path: Path) -> None:
    async with gateway(redis, tmp_path, header_timeout=0.5) as address:
        async with connection(address) as (reader, writer):
            writer.write(b"POST /v1/completions HT")  # half a request line, then nothing
            await writer.drain()
            answer = await closed(reader)
        async with connection(address) as (reader, _):
            silent = await closed(reader)  # connected, never sent a byte
        async with connection(address) as (reader, writer):
            writer.write(HEALTH)  # a prompt client is unaffected
            status, _, _ = await read_response(reader)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 ")
    assert b"Connection: close" in head
    error = openai_error(body)
    assert error["code"] == "request_timeout"
    assert "headers" in error["message"]
    assert silent == b""
    assert status == 200


@pytest.mark.parametrize("size", [200, 40_000], ids=["small", "read-by-the-body-lane"])
async def test_a_trickling_body_is_cut_at_the_body_deadline_with_408(
    redis: Redis, tmp_path: Path, size: int
) -> None:
    """Read by the serving process, or (over 32 KiB) by the body lane, on the deadline left to it."""
    body = json.dumps({"model": "base", "prompt": "p" * size}).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: kvgate\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    async with gateway(redis, tmp_path, body_timeout=0.5) as address, connection(address) as (reader, writer):

        async def trickle() -> None:
            writer.write(head + body[:-200])  # a large body's first bytes arrive at once
            for byte in body[-200:]:
                writer.write(bytes([byte]))
                await writer.drain()
                await asyncio.sleep(0.05)

        sending = asyncio.ensure_future(trickle())
        try:
            status, headers, answer = await read_response(reader)
            rest = await closed(reader)
        finally:
            sending.cancel()
            with contextlib.suppress(asyncio.CancelledError, ConnectionError):
                await sending
    assert status == 408
    assert headers["content-type"].startswith("application/json")
    error = openai_error(answer)
    assert error["code"] == "request_timeout"
    assert "body" in error["message"]
    assert rest == b""


async def test_idle_keepalive_connections_are_closed(redis: Redis, tmp_path: Path) -> None:
    async with (
        gateway(redis, tmp_path, keepalive_timeout=0.5, header_timeout=30) as address,
        connection(address) as (reader, writer),
    ):
        writer.write(HEALTH)
        status, headers, _ = await read_response(reader)
        writer.write(HEALTH)  # the connection is kept alive between requests...
        again, _, _ = await read_response(reader)
        rest = await closed(reader)  # ...until it has been idle for keepalive_timeout
    assert (status, again) == (200, 200)
    assert headers.get("connection", "keep-alive").lower() != "close"
    assert rest == b""


# The cap is per process: with --workers each worker holds its own (docs/workers.md), and which worker a
# connection reaches is the kernel's choice, so the exact cap is tested on one process.
@IN_PROCESS_ONLY
async def test_connections_per_client_address_are_capped(redis: Redis, tmp_path: Path) -> None:
    async with gateway(redis, tmp_path, max_connections_per_client=2) as address:
        async with connection(address) as first, connection(address) as (reader, writer):
            for held_reader, held_writer in (first, (reader, writer)):
                held_writer.write(HEALTH)
                assert (await read_response(held_reader))[0] == 200  # both held open (keep-alive)
            async with connection(address) as (third_reader, third_writer):
                third_writer.write(HEALTH)
                status, _, body = await read_response(third_reader)
                rest = await closed(third_reader)

        async def a_new_connection_is_served() -> bool:  # the two held ones are closed now
            async with connection(address) as (fresh_reader, fresh_writer):
                fresh_writer.write(HEALTH)
                return (await read_response(fresh_reader))[0] == 200

        await eventually(a_new_connection_is_served, "a connection under the cap is served again")
    assert status == 429
    error = openai_error(body)
    assert error["code"] == "too_many_connections"
    assert "2 open connections" in error["message"]
    assert rest == b""
