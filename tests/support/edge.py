"""Helpers for the edge tests: kvgate in-process in front of one stub replica (real Redis), raw HTTP
requests (bytes no HTTP client would send), and the one shape every error body must have."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from redis.asyncio import Redis

from gateway.adapters.publish import publish_adapter
from gateway.adapters.store import AdapterStore
from gateway.process.http_edge import running
from gateway.settings.model import Settings
from gateway.table.epoch_table import EpochTable
from tests.support.adapter_files import MakeAdapter
from tests.support.serve_modes import serving
from tests.support.stub_backend import StubState, build_stub

ADMIN_TOKEN = "edge-admin-token"
LOGICAL_ID = "tenant-42"


@dataclass
class Edge:
    url: str
    stub: StubState
    table: EpochTable
    versioned: str  # the published version of LOGICAL_ID


@asynccontextmanager
async def kvgate(
    redis: Redis, tmp_path: Path, make_adapter: MakeAdapter, stub: StubState | None = None, **overrides: Any
) -> AsyncIterator[Edge]:
    """kvgate serving one stub replica, with LOGICAL_ID published (real Redis, real store)."""
    stub = stub or StubState()
    store = AdapterStore(tmp_path / "store")
    table = EpochTable(redis)
    published = await publish_adapter(table, store, LOGICAL_ID, make_adapter(b"edge-v1"), "base")
    async with running(build_stub(stub)) as stub_url:
        settings = Settings(
            replicas=[stub_url],
            store=store.root,
            admin_token=overrides.pop("admin_token", ADMIN_TOKEN),
            reconcile_interval=0.1,
            poll_interval=0.1,
            **overrides,
        )
        async with serving(settings, redis, tmp_path / "serve") as url:
            yield Edge(url, stub, table, published.name)


@dataclass
class RawResponse:
    status: int
    headers: dict[str, str]  # lower-cased names
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


async def raw_request(url: str, request: bytes) -> RawResponse:
    """Send ``request`` as it is (the caller adds ``Connection: close``) and read the whole answer."""
    parts = urlsplit(url)
    assert parts.hostname is not None
    assert parts.port is not None
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    try:
        writer.write(request)
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), timeout=30)
    finally:
        writer.close()
        await writer.wait_closed()
    head, _, body = answer.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return RawResponse(int(status_line.split()[1]), headers, body)


def http_request(method: str, path: str, headers: dict[str, bytes], body: bytes = b"") -> bytes:
    """An HTTP/1.1 request as bytes; header values go out exactly as given (any bytes)."""
    lines = [f"{method} {path} HTTP/1.1".encode(), b"Host: kvgate", b"Connection: close"]
    lines += [name.encode() + b": " + value for name, value in headers.items()]
    if body or method in {"POST", "PUT", "PATCH"}:
        lines.append(b"Content-Length: " + str(len(body)).encode())
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def assert_openai_error(content_type: str, body: bytes, status: int) -> dict[str, Any]:
    """The error body every kvgate error has: ``{"error": {"message", "type", "param", "code"}}``."""
    assert content_type.split(";")[0].strip() == "application/json", (content_type, body[:300])
    doc = json.loads(body)
    assert isinstance(doc, dict), doc
    assert set(doc) == {"error"}, doc
    error = doc["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str), error
    assert isinstance(error["type"], str), error
    assert error["message"], error
    assert error["type"], error
    assert error["param"] is None or isinstance(error["param"], str), error
    assert status >= 400
    result: dict[str, Any] = error
    return result
