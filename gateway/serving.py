"""Running an aiohttp application on a local port: kvgate itself, the demo, the load tests and test stubs."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from aiohttp import web


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@asynccontextmanager
async def running(
    app: web.Application, host: str = "127.0.0.1", port: int | None = None
) -> AsyncIterator[str]:
    """Serve ``app`` (its cleanup contexts run on the way in and out); yields its base URL."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = port or free_port()
    try:
        await web.TCPSite(runner, host, port).start()
        yield f"http://{host}:{port}"
    finally:
        await runner.cleanup()
