"""Waiting on a condition with a bound, never on time alone."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import aiohttp
import pytest

Check = Callable[[], "bool | Awaitable[bool]"]


async def eventually(check: Check, what: str, within: float = 10.0) -> None:
    """Poll ``check`` (plain or async) until it holds; fail naming ``what`` if not within ``within`` s."""
    deadline = asyncio.get_running_loop().time() + within
    while True:
        held = check()
        if held if isinstance(held, bool) else await held:
            return
        if asyncio.get_running_loop().time() > deadline:
            pytest.fail(f"not within {within} s: {what}")
        await asyncio.sleep(0.02)


async def until_healthy(url: str, within: float = 30.0) -> None:
    """Wait for a kvgate started as a process to answer ``/healthz`` with 200."""
    async with aiohttp.ClientSession() as http:

        async def healthy() -> bool:
            try:
                async with http.get(f"{url}/healthz") as health:
                    return health.status == 200
            except aiohttp.ClientError:
                return False

        await eventually(healthy, f"{url} answers /healthz", within)
