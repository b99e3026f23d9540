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


STARTS_WITHIN_S = 120.0
"""How long a kvgate (or agent) process may take to start: a bound against a hang, not a figure. Starting
Python, its workers, the indexer and the tokenizers beside two vLLM replicas and other xdist workers on two
shared cores took over 60 s in a fresh-clone run (load average 25)."""


async def until_healthy(url: str, within: float = STARTS_WITHIN_S) -> None:
    """Wait for a kvgate started as a process to answer ``/healthz`` with 200."""
    async with aiohttp.ClientSession() as http:

        async def healthy() -> bool:
            try:
                async with http.get(f"{url}/healthz") as health:
                    return health.status == 200
            except aiohttp.ClientError:
                return False

        await eventually(healthy, f"{url} answers /healthz", within)
