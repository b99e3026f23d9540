"""``gateway.healthcheck`` against answers of kvgate's ``/healthz`` (a real aiohttp server)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiohttp import web

from gateway.healthcheck import check
from gateway.process.http_edge import running


@pytest.mark.parametrize(
    ("status", "body", "ready", "alive"),
    [
        (200, {"draining": False}, True, True),
        (503, {"draining": True}, False, True),  # draining, or no healthy replica yet: alive
        (503, {"draining": False, "parent": {"state": "not answering"}}, False, False),  # stuck parent
        (503, {"draining": False, "parent": {"pid": 7, "background": {}}}, False, True),
        (503, {"detail": "a proxy's"}, False, False),  # not kvgate's answer
    ],
)
async def test_ready_and_alive_from_healthz(
    status: int, body: dict[str, Any], ready: bool, alive: bool
) -> None:
    app = web.Application()

    async def healthz(request: web.Request) -> web.Response:
        return web.json_response(body, status=status)

    app.router.add_get("/healthz", healthz)
    async with running(app) as url:
        said = await asyncio.gather(
            *(asyncio.to_thread(check, f"{url}/healthz", alive=a, timeout=5) for a in (False, True))
        )
    assert [problem is None for problem in said] == [ready, alive], said
